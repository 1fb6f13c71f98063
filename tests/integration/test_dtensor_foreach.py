"""A pointwise foreach op over DTensor lists runs on their local shards in a simulation
(:mod:`memprof.simulate.dtensor_foreach`), and the figures are those of DTensor's own dispatch: against the same
simulation without the rule (DTensor's sharding propagation on the fake shards), and against a real AdamW foreach
step on real DTensors over the fake process group; on real DTensors the rule gives DTensor's values and placements,
and it leaves to DTensor what it cannot answer alike (a Partial placement, a lone tensor, lists laid out apart)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import memprof
from memprof.simulate import dtensor_foreach
from memprof.simulate.dtensor_foreach import DTensorForeach
from memprof.simulate.twin import Twin

from phases import assert_equal_everywhere
from test_depth_default import _identical
import test_parallelize
from test_parallelize import IDS, build, fsdp_bf16, loss_fn, tp_sp

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


@pytest.fixture
def counted(monkeypatch):
    """How many list arguments the rule handed to the local op: a test that compares with and without the rule
    compares nothing where the rule never ran."""
    seen = []
    local = dtensor_foreach._local

    def counting(value):
        out = local(value)
        seen.append(out is not value)
        return out

    monkeypatch.setattr(dtensor_foreach, "_local", counting)
    return seen


def fsdp_tp(model, mesh):
    """TP with sequence parallelism inside each dp group, then FSDP2 with bf16 gathers: parameters laid out as
    Shard(0) with Replicate or Shard on the tp dimension, their bf16 and fp32 lists side by side."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    tp_sp(model, mesh["tp"])
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=mp)
    return fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


def _estimate(fn, mesh, options=None, **kw):
    return memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps, **(options or {})), inputs=IDS,
                            targets=IDS, loss_fn=loss_fn, world_size=4 if mesh else 2, mesh=mesh, rank=1,
                            parallelize=fn, **kw)


@pytest.mark.parametrize("fn, mesh", [(fsdp_bf16, None), (fsdp_tp, {"dp": 2, "tp": 2})], ids=["fsdp2", "fsdp2_tp"])
def test_a_foreach_step_on_dtensors_is_dtensors_own_to_the_byte(fn, mesh, counted, monkeypatch):
    # On an H100 target torch's AdamW takes the foreach step (memprof.simulate.twin._stepping_as_on): 8 pointwise
    # foreach ops a step over the rank's shards.
    fast = _estimate(fn, mesh, gpu="h100-80gb")
    assert sum(counted) > 0
    monkeypatch.setattr(Twin, "_foreach", lambda self: None)
    counted.clear()
    slow = _estimate(fn, mesh, gpu="h100-80gb")
    assert not any(counted)
    _identical(fast, slow)


def test_a_foreach_step_on_dtensors_is_the_real_runs(counted):
    # Real tensors, rank 1 of 2 on the fake process group, AdamW's foreach step asked for on the CPU: DTensor's
    # own dispatch ran it, the profile measured it.
    measured, _model, _opt = test_parallelize.measured(fsdp_bf16, rank=1, foreach=True)
    assert not counted  # the rule is the simulation's alone
    est = _estimate(fsdp_bf16, None, options={"foreach": True})
    assert sum(counted) > 0
    assert_equal_everywhere(est, measured)


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _lists(mesh, placements, dtype=torch.float32):
    from torch.distributed.tensor import DTensor

    g = torch.Generator().manual_seed(0)
    return [[DTensor.from_local(torch.randn(3, 4, generator=g).to(dtype), mesh, [p], run_check=False)
             for _ in range(2)] for p in placements]


def test_on_real_dtensors_the_rule_gives_dtensors_values_and_placements(mesh, counted):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for placement in (Shard(0), Replicate()):
        a, b = _lists(mesh, [placement, placement])
        a2, b2 = [[t.to_local().clone() for t in x] for x in (a, b)]
        a2 = [DTensor.from_local(t, mesh, [placement], run_check=False) for t in a2]
        b2 = [DTensor.from_local(t, mesh, [placement], run_check=False) for t in b2]
        with DTensorForeach():
            out = torch._foreach_add(a, b, alpha=0.5)
            back = torch._foreach_addcmul_(a, b, b, value=2.0)
            sq = torch._foreach_sqrt(torch._foreach_abs(b))
        want, want_sq = torch._foreach_add(a2, b2, alpha=0.5), torch._foreach_sqrt(torch._foreach_abs(b2))
        torch._foreach_addcmul_(a2, b2, b2, value=2.0)
        assert back is a  # in place: the list changed, handed back as torch hands it back
        with DTensorForeach():
            assert torch._foreach_mul_(self=b, scalar=1.0) is b  # also where the list is given by keyword
        for got, ref in ((out, want), (a, a2), (sq, want_sq)):
            assert all(type(t) is DTensor and t.placements == r.placements and t.shape == r.shape
                       and t.dtype == r.dtype and torch.equal(t.to_local(), r.to_local()) for t, r in zip(got, ref))
    assert sum(counted) >= 8  # 2 placements x (2 + 3 + 1 + 1 + 1) lists of DTensors unwrapped


def test_a_promoted_output_is_placed_with_its_own_dtype(mesh, counted):
    from torch.distributed.tensor import Shard

    low, high = _lists(mesh, [Shard(0), Shard(0)])
    low = [t.to(torch.bfloat16) for t in low]
    with DTensorForeach():
        out = torch._foreach_mul(low, high)
    assert sum(counted) == 2
    assert [(t.dtype, t._spec.tensor_meta.dtype, t.placements) for t in out] == [(torch.float32, torch.float32,
                                                                                   (Shard(0),))] * 2


@pytest.mark.parametrize("case", ["partial", "lone tensor", "placed apart", "a reduction", "plain tensors",
                                  "grad", "an overload DTensor refuses", "strided globals"])
def test_what_the_rule_cannot_answer_alike_goes_to_dtensor(mesh, counted, case):
    from torch.distributed.tensor import Partial, Replicate, Shard

    from torch.distributed.tensor import DTensor

    a, b = _lists(mesh, [Shard(0), Shard(0)])
    if case == "placed apart":  # the same global shapes (6 x 4), one list sharded, the other replicated
        b = [DTensor.from_local(torch.cat([t.to_local()] * 2), mesh, [Replicate()], run_check=False) for t in b]
    with DTensorForeach():
        if case == "partial":
            p, = _lists(mesh, [Partial()])
            torch._foreach_mul_(p, 2.0)
        elif case == "lone tensor":
            torch._foreach_mul_(a, DTensor.from_local(torch.tensor(2.0), mesh, [Replicate()], run_check=False))
        elif case == "placed apart":
            torch._foreach_add(a, b)
        elif case == "a reduction":
            torch._foreach_norm(a)
        elif case == "plain tensors":
            torch._foreach_add_([t.to_local() for t in a], 1.0)
        elif case == "an overload DTensor refuses":
            # DTensor registers no strategy for _foreach_maximum_.Scalar: a real run fails, and so must the rule.
            with pytest.raises(NotImplementedError, match="sharding strategy"):
                torch._foreach_maximum_(a, -1.0)
        elif case == "strided globals":
            # An expanded global (stride 0): DTensor works out the output's strides afresh (4, 1), which copying
            # the input's spec would not.
            wide = [DTensor.from_local(torch.randn(1, 4).expand(3, 4), mesh, [Shard(0)], run_check=False)
                    for _ in range(2)]
            out = torch._foreach_neg(wide)
            assert [t.stride() for t in out] == [(4, 1)] * 2
        else:
            torch._foreach_mul([t.detach().requires_grad_() for t in a], 2.0)
    assert counted == []  # no list unwrapped: each passed on to DTensor as given


def test_a_shard_order_other_than_the_default_goes_to_dtensor(counted):
    # Shard(0) twice on a 2 x 2 mesh, the second mesh dimension sharding first: DTensor redistributes the
    # operands (to Replicate, Shard(0)), which the local op alone would not.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        grid = init_device_mesh("cpu", (2, 2))
        order = (ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)
        spec = DTensorSpec(grid, (Shard(0), Shard(0)), tensor_meta=TensorMeta(torch.Size([8, 6]), (6, 1),
                                                                              torch.float32), shard_order=order)
        a, b = ([DTensor(torch.rand(2, 6), spec, requires_grad=False) for _ in range(2)] for _ in range(2))
        with DTensorForeach():
            out = torch._foreach_add(a, b)
        assert counted == [] and [t.to_local().shape for t in out] == [torch.Size([4, 6])] * 2
    finally:
        dist.destroy_process_group()
