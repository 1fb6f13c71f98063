"""``reconcile()`` of one rank: the per-rank formula table, its degrees read from the run (the parameters' DTensor
placements, FSDP2's units and policy), each term's bytes against sums taken independently, the measured rank and
its simulation giving the same table; ``merge()`` of simulated ranks."""

from __future__ import annotations

import json
import tempfile

import pytest
import torch
import torch.distributed as dist

import memprof
from memprof import Category as C
from memprof.errors import TraceFormatError

from test_parallelize import IDS, build, fsdp_bf16, loss_fn, measured, simulated, tp_sp

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

# The test model (Tiny: vocab 96, dim 32, ffn 64, 2 blocks), in elements.
EMB = HEAD = 96 * 32
NORM = 32
BLOCK = NORM + 32 * 64 + 64 * 32  # its norm, w1, w2
PARAMS = EMB + 2 * BLOCK + NORM + HEAD  # 14,432
ROOT = EMB + NORM + HEAD  # the root FSDP unit: what no block holds


@pytest.fixture(scope="module")
def fsdp_rank():
    rep, _model, _opt = measured(fsdp_bf16)
    return rep


def test_an_fsdp2_rank_records_its_layout(fsdp_rank):
    lay = fsdp_rank.trace.distributed.layout_detail
    assert lay.mesh == (("dp_shard", 2),)  # FSDP2's own unnamed mesh, named by its role
    (group,) = lay.groups
    assert (group.sharded_by, group.elements, group.bytes) == (("dp_shard",), PARAMS, PARAMS * 4)
    assert (lay.param_dtype, lay.reduce_dtype, lay.offload, lay.units) == ("bfloat16", None, False, 3)
    # The largest unit gathered is the root's (emb + norm + head = 6,176 elements, every dim 0 even) in bf16.
    assert lay.largest_unit_bytes == ROOT * 2 == 12_352
    assert "rank 0 of 2 (fake, fsdp2)" in str(fsdp_rank) and "; mesh dp_shard 2, gathered in bfloat16" in str(fsdp_rank)
    # The record goes to a file and back unchanged.
    with tempfile.TemporaryDirectory() as d:
        fsdp_rank.save(f"{d}/r.json")
        assert memprof.load(f"{d}/r.json").trace.distributed == fsdp_rank.trace.distributed


def test_the_per_rank_table_at_the_backward_peak_names_every_weight_byte(fsdp_rank):
    rec = memprof.reconcile(fsdp_rank, at=(1, "backward", "peak"))
    t = rec.per_rank
    assert (t.rank, t.world_size, t.degrees, t.simulated) == (0, 2, (("dp_shard", 2),), False)
    w = t.row("weights")
    # At rest 14,432 x 4 B / 2 = 28,864 B; gathered: the largest unit, 12,352 B.
    assert w.value == PARAMS * 4 // 2 + ROOT * 2 == 41_216
    assert "/ (dp_shard = 2)" in w.formula and "bfloat16" in w.formula
    assert w.actual == rec.row("weights").measured
    # What is gathered beside the root at this moment is one block's unit: (32 + 2 x 2,048) x 2 B = 8,256 B.
    assert w.parts == (("units gathered beside the largest", BLOCK * 2, w.parts[0][2]),)
    assert w.unexplained == 0
    # Rows without a per-rank formula say so, never 0.
    for cat in (C.ACTIVATIONS, C.COMMUNICATION, C.TEMPORARIES):
        row = t.row(cat)
        assert row.value is None and "not modelled" in row.formula and row.actual


def test_at_the_optimizer_end_the_states_are_the_formula(fsdp_rank):
    t = memprof.reconcile(fsdp_rank, at=(1, "optimizer", "end")).per_rank
    w, g, o = t.row("weights"), t.row("gradients"), t.row("optimizer_states")
    # Every dim 0 divides by 2: no padding, the rank's shards are an even half: 28,864 B of weights and of (fp32)
    # gradients, nothing gathered.
    assert (w.value, w.actual, w.parts) == (PARAMS * 2, PARAMS * 2, ())
    assert (g.value, g.actual) == (PARAMS * 2, PARAMS * 2)
    # AdamW: exp_avg and exp_avg_sq like each shard (2 x 28,864 B) and a 4-byte step per parameter tensor (9), whole
    # on every rank: the formula shares the steps out (9 x 4 / 2 B), the named part is the other half.
    assert o.actual == 2 * PARAMS * 2 + 9 * 4 == 57_764
    assert o.value + sum(b for _, b, _ in o.parts) == o.actual
    assert [n for n, _, _ in o.parts] == ["unsharded step counters"]


def test_a_simulated_rank_gives_the_measured_table(fsdp_rank):
    est = simulated(fsdp_bf16)
    for at in ("peak", (0, "forward", "peak"), (1, "optimizer", "end")):
        sim, real = memprof.reconcile(est, at=at).per_rank, memprof.reconcile(fsdp_rank, at=at).per_rank
        assert sim.simulated and not real.simulated
        assert [(r.category, r.value, r.actual, r.parts) for r in sim.rows] == \
            [(r.category, r.value, r.actual, r.parts) for r in real.rows]
    text = str(memprof.reconcile(est))
    assert "Per rank: rank 0 of 2, mesh dp_shard 2" in text and "simulated" in text


def _fsdp_tp(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    tp_sp(model, mesh["tp"])
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=mp)
    return fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


def test_fsdp_over_tensor_parallel_divides_each_group_by_its_own_degrees():
    rep, model, _opt = measured(_fsdp_tp, world=4, rank=3, mesh={"dp": 2, "tp": 2})
    d = rep.trace.distributed
    lay = d.layout_detail
    assert lay.mesh == (("dp", 2), ("tp", 2))
    by = {g.sharded_by: g for g in lay.groups}
    # Sequence parallelism leaves the three norms whole on tp (Replicate), FSDP cuts them on dp; the rest is cut
    # on both (FSDP's _StridedShard over the tensor-parallel shard counts as a cut).
    assert sorted(by) == [("dp",), ("dp", "tp")]
    assert (by[("dp",)].elements, by[("dp",)].replicated_over) == (3 * NORM, ("tp",))
    assert by[("dp", "tp")].elements == PARAMS - 3 * NORM
    local = sum(p.to_local().numel() for p in model.parameters())
    assert d.params_per_rank == local == (PARAMS - 3 * NORM) // 4 + 3 * NORM // 2 == 3_632
    shape = {"seq_len": 8, "batch": 2, "hidden": 32, "heads": 1, "layers": 2}
    t = memprof.reconcile(rep, at=(1, "optimizer", "end"), transformer=shape).per_rank
    w = t.row("weights")
    assert w.value == w.actual == local * 4 == 14_528  # 14,336 x 4 / (2 x 2) + 96 x 4 / 2
    assert "/ (dp·tp = 4)" in w.formula and "/ (dp = 2)" in w.formula
    act = t.row("activations")
    assert "34/t" in act.formula and "t = 2" in act.formula and "sequence parallelism" in act.formula
    # Rank 0 simulated in this process right after rank 3 measured on its own process group (DTensor's caches keep that
    # group's names under a mesh hash that ignores the rank): the same table.
    est = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                           world_size=4, rank=0, mesh={"dp": 2, "tp": 2}, parallelize=_fsdp_tp)
    sim = memprof.reconcile(est, at=(1, "optimizer", "end"), transformer=shape).per_rank
    assert [(r.category, r.value, r.actual) for r in sim.rows] == [(r.category, r.value, r.actual) for r in t.rows]


def test_hsdp_replicas_do_not_divide():
    def hsdp(model, mesh):
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    rep, _model, _opt = measured(hsdp, world=4, mesh={"replicate": 2, "shard": 2})
    (group,) = rep.trace.distributed.layout_detail.groups
    assert (group.sharded_by, group.replicated_over) == (("shard",), ("replicate",))
    w = memprof.reconcile(rep, at=(1, "optimizer", "end")).per_rank.row("weights")
    assert w.value == w.actual == PARAMS * 4 // 2  # halved by the shard dimension only


def test_a_ddp_rank_holds_everything_whole(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(build())
        opt = torch.optim.AdamW(model.parameters())
        with memprof.profile(model, opt) as prof:
            loss_fn(model(IDS), IDS).backward()
            opt.step()
        t = memprof.reconcile(prof.report(), at=(0, "optimizer", "end")).per_rank
    finally:
        dist.destroy_process_group()
    assert t.degrees == (("dp_replicate", 1),)
    assert t.row("weights").value == t.row("weights").actual == PARAMS * 4
    # DDP's bucket: one copy of the gradients (57,728 B), unless they are views of it.
    assert t.row("communication").value == t.row("communication").actual == PARAMS * 4


def test_a_corrupt_layout_is_refused(fsdp_rank):
    data = fsdp_rank.trace.to_dict()
    data["distributed"]["layout_detail"]["mesh"] = [["dp", -1]]
    with pytest.raises(TraceFormatError, match="mesh dimension"):
        type(fsdp_rank.trace).from_dict(json.loads(json.dumps(data)))


def test_merging_simulated_ranks(capsys):
    ests = [simulated(fsdp_bf16, 2, r) for r in (0, 1)]
    merged = memprof.merge(ests)
    assert merged.simulated and sorted(merged.ranks) == [0, 1] and merged.classes == ()
    peaks = [e.peak_bytes for e in ests]
    assert merged.worst == max((0, 1), key=lambda r: (peaks[r], -r))
    assert merged.spread[0] == max(peaks) - min(peaks)
    data = json.loads(json.dumps(merged.to_dict()))
    assert data["ranks"]["1"]["peak"] == peaks[1] and data["simulated"] is True
    assert "2 of 2 simulated rank(s)" in str(merged)
    # The same from saved traces on the command line, as JSON.
    from memprof.cli import main

    with tempfile.TemporaryDirectory() as d:
        paths = []
        for e in ests:
            paths.append(f"{d}/rank{e.trace.distributed.rank}.json")
            memprof.Report(e.trace).save(paths[-1])
        assert main(["merge", "--json", *paths]) == 0
    assert json.loads(capsys.readouterr().out) == data


def test_the_fsdp_shortcut_gives_the_table_of_fsdp2_itself():
    def fsdp(model, mesh):
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    rep, _model, _opt = measured(fsdp)
    est = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                           world_size=2, parallel="fsdp")
    lay = est.trace.distributed.layout_detail
    # The layout the shortcut plays: every parameter cut over 2 ranks, the root the largest unit, gathered in fp32.
    assert lay.mesh == (("dp_shard", 2),) and lay.largest_unit_bytes == ROOT * 4 == 24_704
    assert lay.largest_unit_bytes == rep.trace.distributed.layout_detail.largest_unit_bytes
    # The forward's peak and the states at rest are FSDP2's to the byte. (At backward's peak the shortcut holds
    # its buffers at other moments than FSDP2 on this model: 192 B over at the peak, an over-estimate.)
    assert est.peak_bytes - rep.peak.total == 192
    for at in ((1, "forward", "peak"), (1, "optimizer", "end")):
        sim, real = memprof.reconcile(est, at=at).per_rank, memprof.reconcile(rep, at=at).per_rank
        assert [(r.category, r.value, r.actual) for r in sim.rows] == [(r.category, r.value, r.actual)
                                                                       for r in real.rows]


def test_cpu_offload_is_read_from_the_run_and_said():
    def offloaded(model, mesh):
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        policy = CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        return fully_shard(model, mesh=mesh, offload_policy=policy)

    rep, _model, _opt = measured(offloaded)
    lay = rep.trace.distributed.layout_detail
    assert lay.offload and lay.param_dtype is None and lay.largest_unit_bytes == ROOT * 4
    w = memprof.reconcile(rep, at=(1, "optimizer", "end")).per_rank.row("weights")
    assert w.value == w.actual == PARAMS * 2 and "shards live on the host" in w.formula


def test_tensor_parallel_alone_names_its_mesh_tp():
    rep, _model, _opt = measured(tp_sp)
    lay = rep.trace.distributed.layout_detail
    assert rep.trace.distributed.layout == "tp" and lay.mesh == (("tp", 2),)
    assert {g.sharded_by: (g.elements, g.replicated_over) for g in lay.groups} == {
        (): (3 * NORM, ("tp",)), ("tp",): (PARAMS - 3 * NORM, ())}
    t = memprof.reconcile(rep, at=(1, "backward", "end"),
                          transformer={"seq_len": 8, "batch": 2, "hidden": 32, "heads": 1, "layers": 2}).per_rank
    w, g = t.row("weights"), t.row("gradients")
    # 96 x 4 B whole + 14,336 x 4 B / 2 = 29,056 B, the rank's local shards (test_parallelize counts them).
    assert w.value == w.actual == 29_056
    # The row-wise embedding's gradient arrives whole (Replicate: 96 x 32 x 4 B where its shard is half), as
    # DTensor's embedding backward makes it: 6,144 B no part names yet.
    assert (g.value, g.gap, g.parts) == (29_056, 6_144, ())
    assert "sequence parallelism" in t.row("activations").formula
