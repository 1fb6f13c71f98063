"""Runs inside a torch.distributed process group record their rank; memprof.merge puts the ranks of one run
side by side."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memprof
from memprof.cli import main
from memprof.errors import MergeError
from memprof.record.parts import Breakdown, RankInfo

from training import output_sum, profile_training


@pytest.fixture
def gloo_world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return profile_training(model, opt, lambda i: (torch.randn(4, 8), None), steps=1, loss=output_sum,
                            zero_grad=False, keep_batch=False)


def test_a_rank_records_where_it_ran(gloo_world_of_one, tmp_path):
    rep = _run(nn.parallel.DistributedDataParallel(nn.Linear(8, 8)))
    assert rep.trace.distributed == RankInfo(rank=0, world_size=1, backend="gloo", layout="ddp", bucket_view=False)
    assert (rep.rank, rep.world_size) == (0, 1)
    rep.save(tmp_path / "rank0.json")
    assert memprof.load(tmp_path / "rank0.json").trace.distributed == rep.trace.distributed


def test_outside_a_process_group_there_is_no_rank():
    rep = _run(nn.Linear(8, 8))
    assert rep.trace.distributed is None and rep.rank is None and rep.world_size is None


def _ranks(peaks, world=None):
    """Reports of the same run as ranks with the given peak totals (weights scaled: the peak moves with them)."""
    base = _run(nn.Linear(8, 8)).trace
    out = []
    for rank, extra in enumerate(peaks):
        values = {c: base.peak[c] for c in memprof.Category}
        values[memprof.Category.WEIGHTS] += extra  # the total is their sum: it moves with them
        peak = Breakdown.from_mapping(values)
        # A peak no phase reached: the file names no step and phase for it (the loader holds a named one to its
        # phases' peaks).
        t = dataclasses.replace(base, peak=peak, peak_step=None, peak_phase=None,
                                distributed=RankInfo(rank, world or len(peaks), "gloo", "ddp"))
        out.append(memprof.Report(t))
    return out


def test_merge_names_the_worst_rank_and_the_spread(tmp_path):
    reports = _ranks([0, 3000, 1000])
    merged = memprof.merge(reports)
    assert merged.worst == 1 and sorted(merged.ranks) == [0, 1, 2] and merged.missing == ()
    base = reports[0].peak.total
    spread, ratio = merged.spread
    assert spread == 3000
    assert ratio == pytest.approx((base + 3000) / ((3 * base + 4000) / 3))
    frame = merged.to_frame()
    assert list(frame.index) == [0, 1, 2] and list(frame["peak"]) == [base, base + 3000, base + 1000]
    assert "worst rank 1" in str(merged) and "rank(s)" in merged._repr_html_()
    # Paths work as well as reports, and so does the command line.
    paths = []
    for r in reports:
        path = tmp_path / f"rank{r.rank}.json"
        r.save(path)
        paths.append(str(path))
    assert memprof.merge(paths).worst == 1
    assert main(["merge", *paths]) == 0


def test_missing_ranks_are_named_not_refused():
    merged = memprof.merge(_ranks([0, 10], world=4))
    assert merged.missing == (2, 3)
    assert any("ranks 2, 3 of 4 were not given" in n for n in merged.notes)


def test_reports_that_are_not_one_run_are_refused():
    two = _ranks([0, 0])
    with pytest.raises(MergeError, match="rank 0 is given twice"):
        memprof.merge([two[0], two[0]])
    other_world = _ranks([0, 0, 0])
    with pytest.raises(MergeError, match="different world sizes"):
        memprof.merge([two[0], other_world[1]])
    with pytest.raises(MergeError, match="not profiled inside a torch.distributed process group"):
        memprof.merge([_run(nn.Linear(8, 8))])
    bigger = dataclasses.replace(two[1].trace, facts=dataclasses.replace(two[1].trace.facts, num_params=1))
    with pytest.raises(MergeError, match="models of different sizes"):
        memprof.merge([two[0], memprof.Report(bigger)])
    with pytest.raises(MergeError, match="at least one report"):
        memprof.merge([])
    with pytest.raises(MergeError, match=r"do not exist in a world of 2"):
        memprof.merge([memprof.Report(dataclasses.replace(two[0].trace, distributed=RankInfo(5, 2)))])


def _ddp_step(gabv):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)),
                                                gradient_as_bucket_view=gabv)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.profile(model, opt) as prof:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    buckets = [int(b) for b in str(model._get_ddp_logging_data()["bucket_sizes"]).split(",")]
    return prof.report(), model, buckets


@pytest.mark.parametrize("gabv", [False, True], ids=["buckets", "gradient_as_bucket_view"])
def test_ddp_buckets_are_communication_unless_they_are_the_gradients(gloo_world_of_one, gabv):
    from memprof import Category as C

    rep, model, buckets = _ddp_step(gabv)
    backward = next(p for p in rep.trace.phases if p.phase.value == "backward")
    # The gradients: (8*8 + 8 + 4*8 + 4) fp32 = 108 * 4 = 432 bytes; DDP's one bucket holds the same 432 bytes.
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    assert grads == 432 and buckets == [432]
    if gabv:  # the gradients are views of the bucket: one storage, counted once, as gradients
        assert (backward.end[C.GRADIENTS], backward.end[C.COMMUNICATION]) == (432, 0)
    else:  # the bucket is its own storage, handed to the allreduce
        assert (backward.end[C.GRADIENTS], backward.end[C.COMMUNICATION]) == (432, sum(buckets))
    assert backward.end[C.INPUTS] == 0  # no longer taken for inputs


def _rank_worker(rank, world, store, out):
    from gloo_settled import join_gloo

    join_gloo(rank, world, store)
    try:
        rep, _model, _buckets = _ddp_step(False)
        rep.save(f"{out}/memprof-rank{rank}.json")
        dist.barrier()  # no rank leaves (and tears gloo down) before the others are done
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_of_ddp_merge(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    merged = memprof.merge(sorted(str(p) for p in tmp_path.glob("memprof-rank*.json")))
    assert sorted(merged.ranks) == [0, 1] and merged.world_size == 2 and merged.missing == ()
    for rank, rep in merged.ranks.items():
        assert rep.trace.distributed == RankInfo(rank=rank, world_size=2, backend="gloo", layout="ddp",
                                                 bucket_view=False)
        backward = next(p for p in rep.trace.phases if p.phase.value == "backward")
        assert backward.end["communication"] == 432  # the one bucket, on each rank
    assert merged.spread[0] == 0  # the same model and batch on both ranks: the same peak


def test_a_collective_output_that_autograd_saves_is_an_activation(gloo_world_of_one):
    from memprof import Category as C

    class RowParallel(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 8)

        def forward(self, x):
            h = self.a(x).detach()
            dist.all_reduce(h)  # in place: h is the collective's buffer, then b saves it for its gradient
            return self.b(h)

    model = RowParallel()
    with memprof.profile(model) as prof:
        out = model(torch.randn(512, 256))
        out.sum().backward()
    forward = prof.report().trace.phases[1]
    assert forward.phase.value == "forward"
    # h: 512 x 256 fp32 = 524,288 bytes, saved by b: an activation, not a communication buffer.
    assert forward.end[C.ACTIVATIONS] >= 512 * 256 * 4
    assert forward.end[C.COMMUNICATION] == 0


def test_merge_refuses_what_is_not_a_list_of_ranks(tmp_path):
    from memprof.errors import InvalidArgumentError

    for bad in ("rank0.json", b"rank0.json", {0: "rank0.json"}):
        with pytest.raises(InvalidArgumentError, match="a list of reports or paths"):
            memprof.merge(bad)
    with pytest.raises(InvalidArgumentError, match="got int"):
        memprof.merge([3])
    plain = _run(nn.Linear(8, 8))
    path = tmp_path / "plain.json"
    plain.save(path)
    with pytest.raises(MergeError, match="plain.json was not profiled inside"):
        memprof.merge([str(path)])


def test_a_merge_of_unmeasured_peaks_names_no_worst_rank():
    reports = _ranks([0, 10])
    blank = [memprof.Report(dataclasses.replace(r.trace, peak=dataclasses.replace(r.trace.peak, total=None)))
             for r in reports]
    merged = memprof.merge(blank)
    assert "peaks not measured on every rank" in str(merged) and merged.spread is None
    assert any("was not measured" in n for n in merged.notes)


def test_a_budget_is_judged_on_every_rank():
    from memprof import check_budget
    from memprof.errors import MemoryBudgetExceeded

    reports = _ranks([0, 5000, 1000])
    merged = memprof.merge(reports)
    base = reports[0].peak.total
    # Within budget on every rank: the result is the worst rank's (rank 1, base + 5000 bytes).
    assert check_budget(merged, total=base + 5000)["total"].measured == base + 5000
    with pytest.raises(MemoryBudgetExceeded, match=r"rank\(s\) 1, 2 of 3 over budget"):
        check_budget(merged, total=base + 500)


@pytest.mark.parametrize("gabv", [False, True], ids=["buckets", "gradient_as_bucket_view"])
def test_a_ddp_rank_reconciles_its_buckets(gloo_world_of_one, gabv):
    rep, _model, buckets = _ddp_step(gabv)
    assert rep.trace.distributed.bucket_view is gabv
    rec = rep.reconcile(at=(0, "backward", "end"))
    row = rec.row("communication")
    # DDP's buckets copy every gradient: 432 bytes (108 fp32 gradients); none with gradient_as_bucket_view.
    assert row.formula == row.measured == (0 if gabv else 432)
