"""A plan's rows searched in forked processes (memprof.simulate.plan_processes): the groups that share no simulation,
the rows back in the grid's order, and what a process raised raised here as it was."""

from __future__ import annotations

import os
import sys

import pytest

from memprof.errors import InvalidArgumentError, MemprofError, UnknownNameError
from memprof.simulate.layouts import Layout
from memprof.simulate.forked import processes_for
from memprof.simulate.plan_processes import groups_of, searched

DDP, FSDP = Layout("ddp", family="data-parallel"), Layout("fsdp", family="data-parallel")
TP = Layout("tp2")  # a family of its own
CONFIGS = [(ckpt, p, lay) for ckpt in (False, True) for p in ("bf16", "autocast") for lay in (DDP, FSDP, TP)]


def test_groups_are_a_precision_and_a_family_each_in_the_grids_order():
    # 12 rows: 2 precisions x 2 families (data-parallel: ddp and fsdp; tp2 alone), each group's rows in order.
    assert groups_of(CONFIGS) == [[0, 1, 6, 7], [2, 8], [3, 4, 9, 10], [5, 11]]


def _label(config) -> str:
    ckpt, precision, layout = config
    return f"{layout.name} {precision}{' ckpt' if ckpt else ''} in {os.getpid()}"


def test_rows_come_back_in_the_grids_order_from_forked_processes():
    rows, n = searched(CONFIGS, lambda configs: [_label(c) for c in configs], processes=2)
    assert n == 2
    assert [r.rsplit(" in ", 1)[0] for r in rows] == [_label(c).rsplit(" in ", 1)[0] for c in CONFIGS]
    pids = {r.rsplit(" in ", 1)[1] for r in rows}
    assert len(pids) == 2 and str(os.getpid()) not in pids  # two forked processes searched, not this one
    here, n = searched(CONFIGS, lambda configs: [_label(c) for c in configs], processes=1)
    assert n == 1
    assert {r.rsplit(" in ", 1)[1] for r in here} == {str(os.getpid())}


def test_what_a_process_raised_is_raised_here():
    def failing(configs):
        if any(lay is TP for _c, _p, lay in configs):
            raise UnknownNameError("no such layout: tp2")
        return [_label(c) for c in configs]

    with pytest.raises(UnknownNameError, match="no such layout: tp2"):
        searched(CONFIGS, failing, processes=2)


def test_a_process_that_ends_without_an_answer_is_named_with_the_fix():
    def dying(configs):
        os._exit(3)

    with pytest.raises(MemprofError, match=r"exit code 3\); pass processes=1"):
        searched(CONFIGS, dying, processes=2)


def test_the_number_of_processes():
    assert processes_for(8, 3) == 3  # never more than the groups
    assert processes_for(1, 4) == 1
    assert 1 <= processes_for(None, 4) <= 4
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidArgumentError, match="processes must be a positive int"):
            processes_for(bad, 2)


def test_by_default_a_process_per_part_at_most_twice_the_cores(monkeypatch):
    from memprof.simulate import forked

    rule = getattr(forked.processes_for, "__wrapped__", forked.processes_for)  # the suite's workers fork none
    if not sys.platform.startswith("linux"):
        assert rule(None, 3) == 1
        return
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # two cores
    # Parts of unequal cost (a plan's groups) each in a process of their own: the system balances the cores.
    assert [rule(None, parts) for parts in (1, 2, 3, 4, 5, 9)] == [1, 2, 3, 4, 4, 4]
    assert rule(3, 5) == 3  # as asked, never more than the parts
    monkeypatch.setattr(forked, "_IN_CHILD", True)  # a forked part forks no further
    assert rule(None, 4) == 1 and rule(3, 4) == 1


def test_a_process_still_running_when_another_raised_is_ended_even_if_it_holds_sigterm():
    # A simulation holds signals until the op under way returns (memprof.simulate.held_signals): a deep model's
    # backward can keep a forked process deaf to SIGTERM for minutes. When another part raised (or the caller was
    # interrupted), the caller must not wait on it: it is killed after a grace period.
    import signal
    import time

    from memprof.simulate import forked

    def deaf():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)
        return "never"

    def failing():
        time.sleep(0.5)  # the other process is deaf by now
        raise ValueError("the first part failed")

    start = time.monotonic()
    with pytest.raises(ValueError, match="the first part failed"):
        forked.forked([failing, deaf], 2, "two parts")
    assert time.monotonic() - start < 30  # the grace period (2 s), not the deaf part's 120 s


class TwoArgError(Exception):
    """An exception whose ``__init__`` takes other arguments than its message: pickled, it cannot be made again."""

    def __init__(self, stage, why):
        super().__init__(f"stage {stage}: {why}")


def _raise_chained():
    try:
        {}["missing"]
    except KeyError as exc:
        raise RuntimeError("the part failed") from exc


def _parts(failing):
    return [lambda: "fine", failing]


def test_an_exception_from_a_process_is_raised_from_its_traceback_there():
    from memprof.simulate import forked
    from memprof.simulate.forked_answers import ForkedTraceback

    with pytest.raises(RuntimeError, match="the part failed") as got:
        forked.forked(_parts(_raise_chained), 2, "two parts")
    # Pickled, an exception keeps neither its traceback nor its causes: they come as its cause, as printed there.
    cause = got.value.__cause__
    assert isinstance(cause, ForkedTraceback)
    assert "_raise_chained" in str(cause) and "KeyError: 'missing'" in str(cause)


def test_an_exception_that_cannot_come_back_is_a_memprof_error_naming_it():
    from memprof.simulate import forked

    class Local(Exception):  # made inside a function: it does not pickle
        pass

    def local():
        raise Local("made here")

    def two_args():
        raise TwoArgError(1, "no head")

    for failing, name in ((local, "Local: made here"), (two_args, "TwoArgError: stage 1: no head")):
        with pytest.raises(MemprofError, match=f"raised {name}, which cannot be sent back") as got:
            forked.forked(_parts(failing), 2, "two parts")
        assert "processes=1" in str(got.value) and failing.__name__ in str(got.value.__cause__)


def test_the_callers_signal_handlers_do_not_run_in_the_processes():
    # A preemption handler (save a checkpoint on SIGTERM) must not run in a process the user does not know of, nor
    # keep it from ending when it is asked to.
    import signal

    from memprof.simulate import forked

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: print("saving a checkpoint"))
    try:
        got = forked.forked([lambda: (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))] * 2, 2,
                            "two parts")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert got == [(signal.SIG_DFL, signal.default_int_handler)] * 2
