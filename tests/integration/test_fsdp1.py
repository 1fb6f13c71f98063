"""FSDP1 (``FullyShardedDataParallel``): a rank measured on torch's fake process group with real tensors, its flat
shards and gathered flat parameters against sums of its own tensors; and ``estimate(parallelize=fn)`` of the same
function against that rank, every category at the peak and end of every phase, to the byte."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C
from memprof.errors import SimulationError
from models import MLP, TiedTransformer
from phases import assert_equal_everywhere, phase_records

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

G = torch.Generator().manual_seed(1)
MLP_X, MLP_Y = torch.randn(16, 32, generator=G), torch.randint(0, 10, (16,), generator=G)
TOK_X, TOK_Y = torch.randint(0, 50, (3, 16), generator=G), torch.randint(0, 50, (3, 16), generator=G)


def _mlp_loss(out, y):
    return F.cross_entropy(out, y)


def _tok_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


# name -> (builder, the modules FSDP1 wraps as units, inputs, targets, loss)
MODELS = {
    # Each Linear a unit of its own, the root none: fc1 2,112, fc2 4,160 and fc3 650 parameters.
    "mlp": (MLP, {nn.Linear}, MLP_X, MLP_Y, _mlp_loss),
    # Each encoder layer a unit; the root holds the tied embedding / head and the positions.
    "transformer": (TiedTransformer, {nn.TransformerEncoderLayer}, TOK_X, TOK_Y, _tok_loss),
}


def fsdp1(model_name: str, **options):
    """The user's parallelize function: FSDP1 over the mesh, its units the model's own blocks, as configured."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    units = MODELS[model_name][1]

    options = {"device_id": torch.device("cpu"), **options}

    def parallelize(model, mesh):
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy(units), device_mesh=mesh, **options)
    return parallelize


def _build(model_name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[model_name][0]()


def measured(model_name: str, fn, world: int, rank: int, mesh: "tuple[int, ...] | None" = None):
    """``fn`` on real tensors, rank ``rank`` of ``world`` on the fake process group, the estimate's loop: forward,
    loss, backward, step, zero_grad, twice, on one batch, the loss held through each step. Returns the report, the
    wrapped model and its optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _b, _u, x, y, loss_fn = MODELS[model_name]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        model = fn(_build(model_name), init_device_mesh("cpu", mesh or (world,)))
        opt = torch.optim.AdamW(model.parameters())
        with memprof.profile(model, opt) as prof:
            for _ in range(2):
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            del loss
        loss_fn(model(x), y).backward()  # once more, outside the profile: the gradients to count
        return prof.report(), model, opt
    finally:
        dist.destroy_process_group()


def simulated(model_name: str, fn, world: int, rank: int, mesh: "tuple[int, ...] | None" = None):
    _b, _u, x, y, loss_fn = MODELS[model_name]
    return memprof.estimate(_build(model_name), lambda ps: torch.optim.AdamW(ps), inputs=x, targets=y,
                            loss_fn=loss_fn, world_size=world, rank=rank, mesh=mesh, parallelize=fn)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _hooks(model: nn.Module) -> list[int]:
    return [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]


def test_a_measured_rank_counts_its_flat_shards_and_what_it_gathers():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=3)
    try:
        model = fsdp1("mlp")(_build("mlp"), init_device_mesh("cpu", (3,)))
        opt = torch.optim.AdamW(model.parameters())
        flats = list(model.parameters())  # the three units' FlatParameters (use_orig_params=False)
        hooks = _hooks(model)
        with memprof.profile(model, opt) as prof:
            for _ in range(2):
                _mlp_loss(model(MLP_X), MLP_Y).backward()
                grads = _storage_bytes([p.grad for p in flats])  # the sharded gradients FSDP1 made .grad
                opt.step()
                opt.zero_grad()
        shards = _storage_bytes(flats)
        states = _storage_bytes([t for s in opt.state.values() for t in s.values()])
        assert _hooks(model) == hooks  # memprof's hooks are gone, FSDP1's stay
        with pytest.raises(ValueError, match="the user's own"):  # also when the block raises, which it is told
            with memprof.profile(model, opt):
                model(MLP_X)
                raise ValueError("the user's own")
        assert _hooks(model) == hooks
    finally:
        dist.destroy_process_group()
    rep = prof.report()
    d = rep.trace.distributed
    assert (d.rank, d.world_size, d.layout) == (2, 3, "fsdp1")
    # Each unit's flat parameter padded to a multiple of 3 and cut in 3: fc1 2,112 -> 704, fc2 4,160 -> 1,387,
    # fc3 650 -> 217 elements each; rank 2's last two chunks end in one element of padding each.
    assert d.sharded_bytes == shards == (704 + 1_387 + 217) * 4 == 9_232
    assert d.padding_bytes == 2 * 4
    assert d.unsharded_bytes == 3 * (704 + 1_387 + 217) * 4 == 27_696
    assert d.even_bytes == round((2_112 + 4_160 + 650) * 4 / 3) == 9_229
    fwd, bwd, step = (phase_records(rep.trace)[(1, p, 0)] for p in ("forward", "backward", "optimizer"))
    # While a unit runs its gathered flat parameter is a weight: at most one unit at once here (FSDP1 reshards
    # after each unit's forward), so the peak holds the shards and the largest unit, fc2's 3 x 1,387 elements.
    assert fwd.peak[C.WEIGHTS] == 9_232 + 3 * 1_387 * 4 == 25_876
    assert fwd.end[C.WEIGHTS] == 9_232
    # After backward (FSDP1's final callback included): the sharded gradients, each like the local shard.
    assert bwd.end[C.GRADIENTS] == grads == 9_232
    assert bwd.end[C.WEIGHTS] == 9_232 and bwd.end[C.COMMUNICATION] == 0
    # AdamW's exp_avg and exp_avg_sq like each flat shard (2 x 9,232 B) and three 4-byte step counters.
    assert step.end[C.OPTIMIZER_STATES] == states == 2 * 9_232 + 3 * 4

    # Reconciled against ZeRO-3 (Table I) at N = 3 over the model's 6,922 parameters, counted whole (a flat
    # parameter's numel is the rank's shard).
    rec = rep.reconcile(at=(1, "optimizer", "end"))
    assert rep.trace.facts.num_params == 2_112 + 4_160 + 650 == 6_922
    assert rec.row("weights").formula == round(6_922 * 4 / 3) == 9_229
    causes = {(c.category.value, c.name): c.bytes for c in rec.explanations}
    assert causes[("weights", "padding to the world size")] == 9_232 - 9_229
    # AdamW: 8 B per parameter and 3 step counters of 4 B, a third each: (55,376 + 12) / 3 = 18,462.7 -> 18,463. The
    # state is made like the padded flat shard: (9,232 - 9,229) / 4 x 8 = 6 B above an even share; the counters are
    # whole on every rank (12 B where the formula has 4 B), less the formula's rounding up (1/3 B): 7 B.
    assert rec.row("optimizer_states").formula == 18_463
    assert causes[("optimizer_states", "uneven shards")] == 6
    assert causes[("optimizer_states", "unsharded step counters")] == 18_476 - 18_463 - 6 == 7
    assert [rec.unexplained(c) for c in ("weights", "gradients", "optimizer_states")] == [0, 0, 0]


# Two models x two strategies, each at rank 0 and the last rank for the MLP (the one with padding); the
# transformer's, slower, at one of them each (the other options below run it at the last rank).
CASES = [("mlp", "FULL_SHARD", 0), ("mlp", "FULL_SHARD", 2), ("mlp", "SHARD_GRAD_OP", 0), ("mlp", "SHARD_GRAD_OP", 2),
         ("transformer", "FULL_SHARD", 0), ("transformer", "SHARD_GRAD_OP", 2)]


@pytest.mark.parametrize(("model_name", "strategy", "rank"), CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_simulated_equals_measured_to_the_byte(model_name, strategy, rank):
    from torch.distributed.fsdp import ShardingStrategy

    fn = fsdp1(model_name, sharding_strategy=ShardingStrategy[strategy])
    est = simulated(model_name, fn, 3, rank)
    rep, model, _opt = measured(model_name, fn, 3, rank)
    assert_equal_everywhere(est, rep)
    assert est.trace.distributed == rep.trace.distributed
    # The rank's shards, an independent sum over the measured rank's own flat parameters.
    assert est.trace.distributed.sharded_bytes == _storage_bytes(model.parameters())
    assert any("FSDP1 (FullyShardedDataParallel)" in n for n in est.notes)
    assert not dist.is_initialized()


def _options():
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy

    return {
        "use_orig_params": dict(use_orig_params=True),
        "bf16_params": dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)),
        "bf16_all": dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                                        buffer_dtype=torch.bfloat16)),
        "no_shard": dict(sharding_strategy=ShardingStrategy.NO_SHARD),
        "prefetch_unlimited": dict(forward_prefetch=True, limit_all_gathers=False,
                                   backward_prefetch=BackwardPrefetch.BACKWARD_POST),
    }


@pytest.mark.parametrize("option", ["use_orig_params", "bf16_params", "bf16_all", "no_shard", "prefetch_unlimited"])
def test_fsdp1_options_are_simulated_to_the_byte(option):
    fn = fsdp1("transformer", **_options()[option])
    est = simulated("transformer", fn, 3, 2)
    rep, _model, _opt = measured("transformer", fn, 3, 2)
    assert_equal_everywhere(est, rep)
    assert est.trace.distributed == rep.trace.distributed


def test_hybrid_shard_over_a_two_dimensional_mesh():
    from torch.distributed.fsdp import ShardingStrategy

    fn = fsdp1("transformer", sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    est = simulated("transformer", fn, 4, 3, mesh=(2, 2))  # rank 3: the last shard of the second replica
    rep, _model, _opt = measured("transformer", fn, 4, 3, mesh=(2, 2))
    assert_equal_everywhere(est, rep)
    # Sharded over the mesh's last dimension (2 ranks), replicated over the first: half of every flat parameter.
    # The model's 27,520 parameters (tied embedding / head 50 x 32 + positions 16 x 32 = 2,112 in the root, and
    # 12,704 in each encoder layer: 96 x 32 + 96 + 32 x 32 + 32 + 128 x 32 + 128 + 32 x 128 + 32 + 4 x 32), fp32,
    # every unit of an even size: no padding.
    d = est.trace.distributed
    assert 2_112 + 2 * 12_704 == 27_520
    assert (d.sharded_bytes, d.unsharded_bytes, d.padding_bytes) == (27_520 * 4 // 2, 27_520 * 4, 0)
    assert d == rep.trace.distributed


def test_cpu_offload_is_refused_by_name_and_torch_is_left_as_it_was():
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel

    init = FullyShardedDataParallel.__init__
    with pytest.raises(SimulationError, match=r"CPUOffload\(offload_params=True\) cannot be simulated"):
        simulated("mlp", fsdp1("mlp", cpu_offload=CPUOffload(offload_params=True)), 2, 0)
    assert FullyShardedDataParallel.__init__ is init
    assert not dist.is_initialized()


def test_a_script_naming_its_gpu_is_simulated_on_the_cpu():
    # A training script's device_id (its GPU) is the simulation's CPU: the same rank as with device_id="cpu".
    on_gpu = simulated("mlp", fsdp1("mlp", device_id=torch.device("cuda", 0)), 3, 2)
    on_cpu = simulated("mlp", fsdp1("mlp"), 3, 2)
    assert on_gpu.peak_bytes == on_cpu.peak_bytes and on_gpu.trace.distributed == on_cpu.trace.distributed
    assert any("device_id=device(type='cuda', index=0) was the CPU" in n for n in on_gpu.notes)


def test_parallel_fsdp1_is_fsdp1_itself():
    from memprof.errors import InvalidArgumentError
    from memprof.simulate.fsdp1 import fsdp1_parallelize

    _b, _u, x, y, loss_fn = MODELS["transformer"]
    est = memprof.estimate(_build("transformer"), lambda ps: torch.optim.AdamW(ps), inputs=x, targets=y,
                           loss_fn=loss_fn, world_size=3, parallel="fsdp1")
    # The same function on real tensors: each encoder layer a unit (the blocks the other layouts gather one at a
    # time), the root for the tied embedding / head and the positions; FULL_SHARD, use_orig_params=True.
    rep, model, _opt = measured("transformer", fsdp1_parallelize(), 3, 0)
    assert [type(m._fsdp_wrapped_module).__name__ for m in model.modules() if type(m).__name__ ==
            "FullyShardedDataParallel"] == ["TiedTransformer", "TransformerEncoderLayer", "TransformerEncoderLayer"]
    assert_equal_everywhere(est, rep)
    # 2,112 root and 2 x 12,704 layer parameters (test_hybrid_shard_over_a_two_dimensional_mesh), each unit padded
    # to a multiple of 3 (2,112 and 12,705), fp32: rank 0 holds 704 + 2 x 4,235 elements.
    d = est.trace.distributed
    assert (d.layout, d.sharded_bytes, d.unsharded_bytes) == ("fsdp1", (704 + 2 * 4_235) * 4, (2_112 + 2 * 12_705) * 4)
    with pytest.raises(InvalidArgumentError, match="both say how"):
        memprof.estimate(_build("transformer"), inputs=x, world_size=3, parallel="fsdp1",
                         parallelize=fsdp1("transformer"))


def test_activation_checkpointing_inside_fsdp1_units():
    # The published FSDP1 runs that were under-estimated checkpoint each block inside its FSDP1 unit, as
    # accelerate and Lightning apply it (apply_activation_checkpointing after the wrapping).
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             apply_activation_checkpointing,
                                                                             checkpoint_wrapper)

    wrap = fsdp1("transformer", use_orig_params=True)

    def fn(model, mesh):
        model = wrap(model, mesh)
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                           checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, nn.TransformerEncoderLayer))
        return model

    est = simulated("transformer", fn, 3, 2)
    rep, model, _opt = measured("transformer", fn, 3, 2)
    assert sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules()) == 2  # checkpointing ran
    assert_equal_everywhere(est, rep)


def test_plans_take_fsdp1_by_name():
    from memprof.simulate.layouts import choose_layouts

    model = _build("transformer")
    (lay,) = choose_layouts(model, 4, "fsdp1")
    assert (lay.name, dict(lay.options), lay.family) == ("fsdp1", {"world_size": 4, "parallel": "fsdp1"},
                                                         "data-parallel")
    assert "fsdp1" not in [x.name for x in choose_layouts(model, 4, "dp")]  # the default set is unchanged


def test_a_training_scripts_own_arguments_are_taken():
    # What a script on GPUs passes: its GPU's index as device_id, rank 0's states broadcast as the model is wrapped
    # (which FSDP1 does for GPU tensors only), a param_init_fn for a model built on the meta device. The step is the
    # one measured on the CPU without them.
    fn = fsdp1("transformer", device_id=0, sync_module_states=True,
               param_init_fn=lambda m: m.to_empty(device=torch.device("cpu"), recurse=False))
    est = simulated("transformer", fn, 3, 1)
    rep, _model, _opt = measured("transformer", fsdp1("transformer"), 3, 1)
    assert_equal_everywhere(est, rep)
    assert any(n.startswith("FSDP1's device_id=0 was the CPU") for n in est.notes)
    assert any(n.startswith("FSDP1's sync_module_states=True was left out") for n in est.notes)


def test_the_device_replay_keeps_fsdp1s_side_streams_apart():
    import dataclasses

    from memprof.collect.streams import StreamUse
    from memprof.simulate.device_memory import replay_of

    _b, _u, x, y, loss_fn = MODELS["transformer"]
    native = torch.cpu.stream
    est = memprof.estimate(_build("transformer"), lambda ps: torch.optim.AdamW(ps), inputs=x, targets=y,
                           loss_fn=loss_fn, world_size=3, parallelize=fsdp1("transformer"), gpu="h100")
    assert torch.cpu.stream is native
    replay = replay_of(est.device_memory)
    # FSDP1's unshard, pre-unshard and post-backward streams, entered through its device handle (torch.cpu).
    assert len({stream for _seq, stream in replay.streams.switches if stream}) == 3
    one_pool = dataclasses.replace(replay, streams=StreamUse(held=replay.streams.held))
    assert replay.figures()[0] > one_pool.figures()[0]  # blocks cached per stream: more reserved than one pool
    # Each unit's gathered flat parameter (3 units: two blocks and the root) is held after its free, two in flight
    # (limit_all_gathers=True, FSDP1's default), and holding them reserves no less than freeing them at once.
    assert sorted(limit for _key, limit in replay.streams.held) == [2, 2, 2]
    freed_at_once = dataclasses.replace(replay, streams=StreamUse(switches=replay.streams.switches))
    assert replay.figures()[0] >= freed_at_once.figures()[0]
    assert any("record_stream" in n and "limit_all_gathers" in n for n in est.notes)


def test_gathered_units_wait_for_their_events_on_the_device():
    # Three FSDP1 units of one 2048 x 2048 fp32 Linear each (16 MiB + 8 KiB of bias, gathered whole on each of 2
    # ranks): each gather is a large block of its own segment. Held after their frees (record_stream, two in flight
    # under limit_all_gathers), a forward's second gather cannot reuse the first's block: the replay reserves more
    # than with every gathered block freed at once.
    import dataclasses

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from memprof.collect.streams import StreamUse
    from memprof.simulate.device_memory import replay_of

    def units(model, mesh):
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_mesh=mesh,
                                        device_id=torch.device("cpu"))

    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(3)))
    x = torch.empty(4, 2048, device="meta")
    est = memprof.estimate(model, lambda ps: torch.optim.SGD(ps, lr=0.1), inputs=x, world_size=2,
                           parallelize=units, gpu="h100")
    replay = replay_of(est.device_memory)
    assert len(replay.streams.held) == 3
    freed_at_once = dataclasses.replace(replay, streams=StreamUse(switches=replay.streams.switches))
    held, at_once = replay.figures()[0], freed_at_once.figures()[0]
    assert held - at_once >= 16 * 2**20  # at least one more unit's gathered block
    assert held - replay.outside == est.device_memory.peak_reserved
