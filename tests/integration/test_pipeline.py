"""``estimate(..., pipeline=Pipeline(...))``: one pipeline rank's stage(s) under torch's own schedules, simulated on
fake tensors, against the same stage run on real tensors on torch's fake process group (P2P returns at once; the
receive buffers are the stage's own allocations). Every category at the peak and end of every phase, to the
byte; then every rank class listed and the worst one returned."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memprof
from memprof.simulate.pipeline import static_shapes
from memprof import Pipeline

from test_parallelize import Tiny, assert_equal_everywhere, loss_fn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

PP, MICRO = 2, 4
IDS = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(1))


class Stage(nn.Module):
    """torchtitan's cut: stage ``k`` keeps its share of the layers, the first the embedding, the last the head."""

    def __init__(self, full: Tiny, k: int, n: int) -> None:
        super().__init__()
        per = len(full.layers) // n
        self.emb = full.emb if k == 0 else None
        self.layers = nn.ModuleList(full.layers[per * k: per * (k + 1)])
        self.norm = full.norm if k == n - 1 else None
        self.head = full.head if k == n - 1 else None

    def forward(self, x):
        h = self.emb(x) if self.emb is not None else x
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h)) if self.head is not None else h


def build() -> nn.Module:
    torch.manual_seed(0)
    return Tiny(layers=4)


def measured(schedule: str, k: int, context=contextlib.nullcontext):
    """Stage ``k`` of ``PP`` on real tensors, rank ``k`` on the fake process group, each schedule step inside
    ``context()`` (torchtitan's train context around ``pp_schedule.step``)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=k, world_size=PP)
    try:
        stage_mod = Stage(build(), k, PP)
        mb = IDS.shape[0] // MICRO
        x_in = IDS[:mb] if k == 0 else torch.empty(mb, 8, 32, requires_grad=True)
        x_out = torch.empty(mb, 8, 96 if k == PP - 1 else 32, requires_grad=True)
        stage = PipelineStage(stage_mod, k, PP, torch.device("cpu"), input_args=(x_in,), output_args=(x_out,))
        sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stage, n_microbatches=MICRO, loss_fn=loss_fn)
        opt = torch.optim.AdamW(stage_mod.parameters())
        with static_shapes(), memprof.profile(stage_mod, opt) as prof:  # no real peer to vote on the shapes
            for _ in range(2):
                with context():
                    sched.step(IDS) if k == 0 else sched.step(target=IDS, losses=[])
                opt.step()
                opt.zero_grad()
        return prof.report()
    finally:
        dist.destroy_process_group()


def simulated(schedule: str, rank=None, step_context=None, **kw):
    return memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                            world_size=PP, rank=rank, pipeline=Pipeline(Stage, schedule=schedule, microbatches=MICRO,
                                                                         **kw), step_context=step_context)


@pytest.mark.parametrize(("schedule", "k"), [("gpipe", 1), ("1f1b", 0)])  # the last stage's loss; the first's inputs
def test_a_stage_is_simulated_to_the_byte(schedule, k):
    assert_equal_everywhere(simulated(schedule, rank=k), measured(schedule, k))


class Holding:
    """A train context that keeps a buffer of its own while the step runs (1,000 fp32: 4,000 B)."""

    entered: list = []

    def __init__(self, parts) -> None:  # a class is a step_context too: called with the step's parts
        self.parts = parts

    def __enter__(self):
        Holding.entered.append(self.parts)
        self.buffer = torch.empty(1000)
        return self

    def __exit__(self, *exc):
        del self.buffer


@pytest.mark.parametrize("k", [0, 1])
def test_a_step_context_wraps_each_schedule_step_as_measured(k):
    Holding.entered.clear()
    est = simulated("1f1b", rank=k, step_context=Holding)
    # Entered once per step (2 steps), handed the rank's stage module, its inputs on the first stage only.
    assert len(Holding.entered) == 2
    parts = Holding.entered[0]
    assert len(parts.model.layers) == 2 and (parts.model.emb is not None) == (k == 0)
    assert (parts.inputs is not None) == (k == 0) and (parts.targets is not None) == (k == PP - 1)
    assert_equal_everywhere(est, measured("1f1b", k, context=lambda: Holding(None)))
    # The context's buffer is in the step's peak: 4,000 B more than without it (a multiple of nothing: CPU).
    assert est.peak_bytes - simulated("1f1b", rank=k).peak_bytes == 4_000


def test_every_rank_class_is_listed_and_the_worst_returned():
    gpipe, one_f_one_b = simulated("gpipe"), simulated("1f1b")
    for est in (gpipe, one_f_one_b):
        assert [c.stages for c in est.ranks] == [(0,), (1,)]
        assert est.peak_bytes == max(c.peak_bytes for c in est.ranks)
        assert any(n.startswith("the worst rank is") for n in est.notes)
    # GPipe keeps all four micro-batches' activations on a stage until its backward; 1F1B at most pp - k of them.
    for g, o in zip(gpipe.ranks, one_f_one_b.ranks):
        assert g.peak_bytes > o.peak_bytes


def test_interleaved_ranks_hold_two_stages():
    est = simulated("interleaved1f1b", stages_per_rank=2)
    assert [c.stages for c in est.ranks] == [(0, 2), (1, 3)]


def test_a_schedule_that_refuses_its_micro_batches_is_a_memprof_error():
    # torch's 1F1B needs at least as many micro-batches as stages; 1 over 2 stages was its ValueError, raised from
    # torch/distributed/pipelining/schedules.py through the simulation (found by a review trying 2 over 4 stages).
    from memprof.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"Schedule1F1B refuses Pipeline\(microbatches=1\) over 2 "
                       r"pipeline stages: Number of microbatches \(1\) must be greater .* Give a number of"):
        memprof.estimate(Tiny(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                         world_size=PP, rank=0, pipeline=Pipeline(Stage, schedule="1f1b", microbatches=1))
