"""A pipeline's rank classes simulated in processes forked from this one (``estimate(..., processes=)``,
:func:`memprof.simulate.stages.in_processes`): the same figures as in one process, the caller's random streams
untouched, a failure in a forked simulation raised here as it was raised there, and what a forked simulation learnt
of the model's cuts learnt here too."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import memprof
from memprof import Pipeline
from memprof.errors import InvalidArgumentError
from memprof.simulate import stages

from test_parallelize import loss_fn
from test_pipeline import IDS, MICRO, PP, Stage, build

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

FORKED = "pipeline: the 2 rank classes were simulated by 2 processes forked from this one"


def simulated(split=Stage, **options):
    return memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                            world_size=PP, pipeline=Pipeline(split, schedule="1f1b", microbatches=MICRO), **options)


def test_rank_classes_in_two_processes_are_the_ones_simulated_here():
    torch.manual_seed(5)
    here = simulated(processes=1)
    after_here = torch.get_rng_state()
    torch.manual_seed(5)
    there = simulated(processes=2)
    # The caller's random stream is where one process leaves it: what the forks drew stays in them.
    assert torch.equal(torch.get_rng_state(), after_here)
    assert any(n.startswith(FORKED) for n in there.notes) and not any(n.startswith(FORKED) for n in here.notes)
    assert there.ranks == here.ranks  # every class: its ranks, stages, peak, the moment and its whole trace
    assert there.trace == here.trace
    assert (there.peak_bytes, there.device_peak) == (here.peak_bytes, here.device_peak)
    assert [n for n in there.notes if not n.startswith(FORKED)] == list(here.notes)


def test_a_failure_in_a_forked_simulation_is_raised_here_as_it_was():
    class Failing(Stage):
        # The last stage cannot run on what the first hands it: only rank class 1's simulation meets it.
        def __init__(self, full, k, n):
            if k == n - 1:
                raise ValueError("no head here")
            super().__init__(full, k, n)

    for processes in (1, 2):
        with pytest.raises(ValueError, match="no head here"):
            simulated(Failing, processes=processes)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_a_bad_count_of_processes_is_refused_before_anything_runs(bad):
    with pytest.raises(InvalidArgumentError, match="processes must be a positive int"):
        simulated(processes=bad)


def test_what_a_forked_simulation_learnt_of_the_cuts_is_learnt_here():
    model = build()

    def one(rank: int):
        # As at_depth does where a run's cuts did not check: remembered in the process that simulated it.
        stages._remember_not_cut(model, ("run", rank))
        return simulated(rank=rank)

    got = stages.in_processes(one, model, [0, 1], processes=2)
    assert [e.trace.distributed.rank for e in got] == [0, 1]
    assert {("run", 0), ("run", 1)} <= stages._not_cut(model)


class Warning_(Stage):
    def forward(self, x):
        # Every forward of every class, cut and step; issued from this line (stacklevel 1), which the test reads.
        warnings.warn("a stage's forward warns", UserWarning, stacklevel=1)
        return super().forward(x)


def test_a_warning_the_forked_simulations_issue_reaches_the_callers_filters_once():
    # Each forked process issued its warnings to its own stderr, past the caller's filters and catch_warnings, and
    # each in its own copy of the registry: the FSDP2 warning of a view returned by a sharded module was printed
    # once per rank class. They are issued here again, at the place each was issued, with that module's registry.
    def caught(processes):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("default")
            simulated(Warning_, processes=processes)
        return [w for w in got if "warns" in str(w.message)]

    forked = caught(2)
    assert [(str(w.message), w.filename) for w in forked] == [("a stage's forward warns", __file__)]
    # One process shows it as often or more: the simulation's own use of the filters (a catch_warnings around a
    # step) starts the default filter's count again.
    assert len(caught(1)) >= 1
