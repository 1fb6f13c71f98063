"""``estimate(..., world_size=N, parallelize=fn)``: the user's own parallelize function, simulated on fake
tensors on torch's fake process group, against the same function run on real tensors on the fake process group
(rank 0 of 2: FSDP2 and DTensor run their own code; collectives return at once). Every category, at the peak and
the end of every phase of both steps, to the byte."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C
from memprof.errors import InvalidArgumentError
from phases import assert_equal_everywhere, phase_records

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


class Block(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return x + self.w2(F.silu(self.w1(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, vocab: int = 96, dim: int = 32, ffn: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build() -> nn.Module:
    torch.manual_seed(0)
    return Tiny()


IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))


def fsdp_bf16(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def tp_sp(model, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    # Megatron's split (Shoeybi et al. 2019, §3): w1 by columns, w2 by rows; sequence parallelism (Korthikanti et
    # al. 2022, §4.2.2) shards the norms' activations along the sequence.
    parallelize_module(model, mesh, {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, mesh, {
            "norm": SequenceParallel(),
            "w1": ColwiseParallel(input_layouts=Shard(1)),
            "w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return model


def measured(fn, world: int = 2, rank: int = 0, mesh: "dict[str, int] | None" = None, **options):
    """The same function on real tensors, rank ``rank`` of ``world`` on the fake process group (on a mesh of one
    dimension, or of ``mesh``'s named ones), the estimate's loop: forward, loss, backward, step, zero_grad, twice,
    on one batch; AdamW with ``options``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        device_mesh = (init_device_mesh("cpu", (world,)) if mesh is None
                       else init_device_mesh("cpu", tuple(mesh.values()), mesh_dim_names=tuple(mesh)))
        model = fn(build(), device_mesh)
        opt = torch.optim.AdamW(model.parameters(), **options)
        with memprof.profile(model, opt) as prof:
            for _ in range(2):  # the loss held through the step and released when the loop ends, as the estimate's loop holds it
                loss = loss_fn(model(IDS), IDS)
                loss.backward()
                opt.step()
                opt.zero_grad()
            del loss
        loss_fn(model(IDS), IDS).backward()  # once more, outside the profile: the gradients to count
        return prof.report(), model, opt
    finally:
        dist.destroy_process_group()


def simulated(fn, world: int = 2, rank: int = 0):
    return memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                            world_size=world, rank=rank, parallelize=fn)


def _local_bytes(tensors) -> int:
    """Bytes of the local shards, each storage once."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        st = local.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def test_fsdp2_with_bf16_mixed_precision_is_simulated_to_the_byte():
    est = simulated(fsdp_bf16)
    rep, _model, _opt = measured(fsdp_bf16)
    assert_equal_everywhere(est, rep)
    d = est.trace.distributed
    # Rank 0 of 2 holds half of every parameter: (96*32 + 2*(32 + 32*64 + 64*32) + 32 + 32*96) * 4 / 2 B, with
    # bf16 gathers of the whole model (x 2 B).
    params = 96 * 32 + 2 * (32 + 32 * 64 + 64 * 32) + 32 + 32 * 96
    assert (d.rank, d.world_size, d.layout) == (0, 2, "fsdp2")
    assert d.sharded_bytes == params * 4 // 2 == 28_864  # 14,432 parameters
    assert d.unsharded_bytes == params * 2 == 28_864
    assert any("parallelize function" in n for n in est.notes)


def test_tensor_and_sequence_parallel_is_simulated_to_the_byte_and_holds_the_local_shards():
    est = simulated(tp_sp)
    rep, model, opt = measured(tp_sp)
    assert_equal_everywhere(est, rep)
    # An independent count on the measured rank's own tensors: its local shards, storages once.
    weights = _local_bytes(model.parameters())
    # emb rows 96/2, head rows 96/2, w1 rows 64/2, w2 columns 64/2, norms whole: (48*32 + 48*32 + 2*(32*32 +
    # 32*32 + 32) + 32) * 4 B.
    assert weights == (48 * 32 + 48 * 32 + 2 * (32 * 32 + 32 * 32 + 32) + 32) * 4 == 29_056
    end = phase_records(rep.trace)[(1, "optimizer", 0)].end
    assert end[C.WEIGHTS] == weights
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert end[C.OPTIMIZER_STATES] == _local_bytes(states) == 2 * weights + 4 * len(list(model.parameters()))
    bwd = phase_records(rep.trace)[(1, "backward", 0)].end
    # Each gradient is like its local shard, except the row-wise embedding's: it arrives Replicate, the whole
    # vocabulary (96 x 32 x 4 = 12,288 B where its shard is 6,144 B), as DTensor's embedding backward makes it.
    assert bwd[C.GRADIENTS] == _local_bytes(p.grad for p in model.parameters()) == weights + 6_144


def test_another_rank_and_a_named_mesh():
    def fsdp_named(model, mesh):
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model

    est = memprof.estimate(
        build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn, world_size=4, rank=3,
        mesh={"dp": 4}, parallelize=fsdp_named)
    assert (est.trace.distributed.rank, est.trace.distributed.world_size) == (3, 4)
    assert not dist.is_initialized()  # the fake process group is gone with the estimate


def test_refusals():
    with pytest.raises(InvalidArgumentError, match="both say how"):
        memprof.estimate(build(), inputs=IDS, world_size=2, parallel="fsdp", parallelize=fsdp_bf16)
    with pytest.raises(InvalidArgumentError, match="multiply to the world size"):
        memprof.estimate(build(), inputs=IDS, world_size=4, mesh=(3,), parallelize=fsdp_bf16)
    with pytest.raises(InvalidArgumentError, match="rank must be"):
        memprof.estimate(build(), inputs=IDS, world_size=2, rank=2, parallelize=fsdp_bf16)
    # An estimate inside a job's own process group is no longer refused: test_estimate_in_a_job.py.


def test_cpu_offload_reports_host_and_device():
    def offloaded(model, mesh):
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        # pin_memory=False: pinning needs an accelerator (torch/distributed/fsdp/_fully_shard/_fsdp_param.py).
        policy = CPUOffloadPolicy(pin_memory=False)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        return model

    est = simulated(offloaded)
    rep, _model, _opt = measured(offloaded)
    assert_equal_everywhere(est, rep)  # on the CPU, FSDP2's host/device copies are no-ops: the same run
    # Host: the padded shards (14,432 parameters / 2 x 4 B = 28,864 B), as many bytes of sharded gradients, and
    # AdamW's two states per shard plus a 4-byte step per parameter (2 x 28,864 + 9 x 4 = 57,764 B).
    assert est.host_bytes == 28_864 + 28_864 + 57_764 == 115_492
    # Device: the peak (backward) less the shards and the states in it, plus the largest unit's shards copied to
    # the device before its all-gather (the root's: emb + norm + head = (3,072 + 32 + 3,072) / 2 x 4 B = 12,352 B).
    peak = est.trace.peak
    assert est.device_peak_bytes == peak.total - 28_864 - 57_764 + 12_352
    assert any(n.startswith("CPUOffloadPolicy") for n in est.notes)


def _hsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:  # replicated over mesh dim 0, sharded over dim 1
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _kept_unsharded_with_prefetching(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    layers = list(model.layers)
    for a, b in zip(layers, layers[1:]):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])
    return model


@pytest.mark.parametrize(("fn", "mesh"), [(_hsdp, {"replicate": 2, "shard": 2}),
                                          (_kept_unsharded_with_prefetching, {"dp": 4})],
                         ids=["hsdp", "reshard_after_forward_false_prefetch"])
def test_other_fsdp2_options_are_simulated_to_the_byte(fn, mesh):
    est = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                           world_size=4, mesh=mesh, parallelize=fn)
    rep, _model, _opt = measured(fn, world=4, mesh=mesh)
    assert_equal_everywhere(est, rep)
