"""Pipeline x FSDP x TP measured: 8 ranks on a mesh pp 2 x dp 2 x tp 2, each pipeline stage parallelised inside by
tensor parallelism with sequence parallelism and FSDP2 with bf16 gathers, run by torch's 1F1B schedule on real
tensors on torch's fake process group (one rank per call: P2P and collectives return at once, every buffer is the
rank's own allocation), against ``estimate(..., pipeline=..., parallelize=fn)``: each stage's rank and the worst
stage the simulation picks, every category at the peak and end of every phase, to the byte."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import memprof
from memprof import Pipeline
from memprof.simulate.pipeline import static_shapes

from test_parallelize import assert_equal_everywhere, loss_fn
from test_pipeline import IDS, MICRO, Stage, build

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

MESH = {"pp": 2, "dp": 2, "tp": 2}
WORLD = 8


def stage_fn(stage, mesh):
    """What a training script does to its stage: Megatron's split with sequence parallelism over tp (the first
    stage's embedding row-wise, the last's head column-wise), then FSDP2 over dp with bf16 gathers."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    tp = mesh["tp"]
    plan = {}
    if stage.emb is not None:
        plan["emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if stage.head is not None:
        plan["norm"] = SequenceParallel()
        plan["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if plan:
        parallelize_module(stage, tp, plan)
    for block in stage.layers:
        parallelize_module(block, tp, {"norm": SequenceParallel(), "w1": ColwiseParallel(input_layouts=Shard(1)),
                                       "w2": RowwiseParallel(output_layouts=Shard(1))})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in stage.layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
    return fully_shard(stage, mesh=mesh["dp"], mp_policy=mp)


def measured(rank: int):
    """Rank ``rank`` of the 8 on real tensors: its stage cut from the model, ``stage_fn`` on it, 1F1B over the pp
    group, two steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", tuple(MESH.values()), mesh_dim_names=tuple(MESH))
        k = mesh["pp"].get_local_rank()
        stage_mod = stage_fn(Stage(build(), k, 2), mesh)
        mb = IDS.shape[0] // MICRO
        seq = IDS.shape[1]
        # Between the stages the activations are sequence-sharded over tp (local seq / 2) and in bf16 (FSDP2's
        # param_dtype is the compute dtype, and no output_dtype casts back); the head's logits whole, in bf16.
        bf16 = torch.bfloat16
        x_in = IDS[:mb] if k == 0 else torch.empty(mb, seq // 2, 32, dtype=bf16, requires_grad=True)
        x_out = torch.empty(mb, seq, 96, dtype=bf16, requires_grad=True) if k == 1 else torch.empty(
            mb, seq // 2, 32, dtype=bf16, requires_grad=True)
        stage = PipelineStage(stage_mod, k, 2, torch.device("cpu"), input_args=(x_in,), output_args=(x_out,),
                              group=mesh["pp"].get_group())
        sched = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=loss_fn)
        opt = torch.optim.AdamW(stage_mod.parameters())
        with static_shapes(), memprof.profile(stage_mod, opt) as prof:
            for _ in range(2):
                sched.step(IDS) if k == 0 else sched.step(target=IDS, losses=[])
                opt.step()
                opt.zero_grad()
        return prof.report()
    finally:
        dist.destroy_process_group()
        # DTensor's sharding caches key on meshes whose hash ignores the rank and the process group: the next
        # rank in this process must not be handed this one's groups.
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()


def simulated(rank=None):
    return memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                            world_size=WORLD, mesh=MESH, rank=rank, parallelize=stage_fn,
                            pipeline=Pipeline(Stage, schedule="1f1b", microbatches=MICRO))


def test_the_worst_stage_of_pp_fsdp_tp_is_simulated_to_the_byte():
    est = simulated()
    assert [c.stages for c in est.ranks] == [(0,), (1,)]
    assert [c.ranks for c in est.ranks] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    worst = max(est.ranks, key=lambda c: c.peak_bytes)
    rep = measured(worst.representative)
    assert_equal_everywhere(est, rep)
    lay = rep.trace.distributed.layout_detail
    assert lay.mesh == (("pp", 2), ("dp", 2), ("tp", 2)) and lay.param_dtype == "bfloat16"
    # The other stage too: the merge of the simulated classes names the worst and the spread.
    other = next(c for c in est.ranks if c is not worst)
    assert_equal_everywhere(simulated(other.representative), measured(other.representative))
    merged = memprof.merge(est)
    assert merged.worst == worst.representative and merged.simulated
    assert merged.spread[0] == worst.peak_bytes - other.peak_bytes
    # Each simulated rank stands for its class: the mean of the world is the classes' mean, both of 4 ranks.
    assert merged.spread[1] == worst.peak_bytes / ((worst.peak_bytes + other.peak_bytes) / 2)
    assert merged.missing == () and [c.ranks for c in merged.classes] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    text = str(merged)
    assert "2 of 8 simulated rank(s)" in text and "0-3" in text and "4-7" in text
    assert "Rank classes" in merged._repr_html_()
    assert merged.to_dict()["classes"][0] == {"ranks": [0, 1, 2, 3], "simulated_rank": 0, "stages": [0],
                                              "peak": est.ranks[0].peak_bytes, "peak_step": est.ranks[0].peak_step,
                                              "peak_phase": est.ranks[0].peak_phase}
    # The measured stage's per-rank table: the degrees read from its parameters, the stage's weights at rest an even
    # share (every dim divides by its degrees), nothing named.
    t = memprof.reconcile(rep, at=(1, "optimizer", "end")).per_rank
    assert t.degrees == (("pp", 2), ("dp", 2), ("tp", 2))
    assert t.row("weights").value == t.row("weights").actual and t.row("weights").parts == ()
    assert any("pp = 2" in n for n in t.notes)
