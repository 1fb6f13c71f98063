"""Two real ranks of FSDP2 (``fully_shard``) on gloo: each rank's shards, gathered parameters, gradients and
collective buffers against sums taken on that rank's own tensors; the two traces merged and reconciled."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memprof
from memprof import Category as C
from gloo_settled import join_gloo, settle_collectives


pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

WORLD = 2


def _model(reshard: bool) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # 33 output rows do not divide by 2: FSDP pads the second Linear's weight and bias to 34 rows.
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 33))
    for m in (model[0], model[2]):
        fully_shard(m, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def _storages_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (DTensors by their local shards)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _padded_full_bytes(model: nn.Module) -> int:
    """What FSDP gathers: each parameter with dim 0 padded to a multiple of the world size, in fp32."""
    total = 0
    for p in model.parameters():
        rows = -(-p.shape[0] // WORLD) * WORLD
        total += rows * (p.numel() // p.shape[0]) * 4
    return total


def _hooks(model: nn.Module) -> list[int]:
    return [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]


def _worker(rank: int, store: str, out: str) -> None:
    settle_collectives()
    join_gloo(rank, WORLD, store)
    try:
        facts = {}
        for reshard in (True, False):
            model = _model(reshard)
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            hooks_before = _hooks(model)
            params = list(model.parameters())
            with memprof.profile(model, opt) as prof:
                for _ in range(2):
                    model(torch.randn(16, 64)).sum().backward()
                    grads = _storages_bytes([p.grad for p in params])  # the sharded gradients FSDP stored
                    opt.step()
                    opt.zero_grad()
            prof.report().save(f"{out}/reshard{int(reshard)}-rank{rank}.json")
            facts[str(int(reshard))] = {
                "sharded": _storages_bytes(params),
                "unpadded": sum(p.to_local().numel() * 4 for p in params),
                "grads": grads,
                "states": _storages_bytes([t for s in opt.state.values() for t in s.values()]),
                "full": _padded_full_bytes(model),
                "hooks": [hooks_before, _hooks(model)],
                "resize_patched": "resize_" in torch.UntypedStorage.__dict__,
            }
        with open(f"{out}/facts-rank{rank}.json", "w") as f:
            json.dump(facts, f)
        dist.barrier()  # no rank tears gloo down before the other is done
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("fsdp2")
    mp.spawn(_worker, args=(str(out / "store"), str(out)), nprocs=WORLD, join=True)
    facts = {r: json.loads((out / f"facts-rank{r}.json").read_text()) for r in range(WORLD)}
    return out, facts


def _profiled(model, opt, make_batch, loss=lambda out, _x: out.sum()):
    """Two training steps of ``model`` under memprof (zero_grad frees the gradients), the loss held through each
    step and released when the loop ends, as the estimate's loop holds it; the report."""
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            x = make_batch()
            value = loss(model(x), x)
            value.backward()
            opt.step()
            opt.zero_grad()
        del value
    return prof.report()


def _phase(rep, step, phase):
    return next(p for p in rep.trace.phases if p.step == step and p.phase.value == phase)


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard_after_forward", "kept_unsharded"])
def test_each_rank_counts_its_shards_and_what_it_gathers(ranks, reshard):
    out, facts = ranks
    for rank in range(WORLD):
        rep = memprof.load(out / f"reshard{int(reshard)}-rank{rank}.json")
        f = facts[rank][str(int(reshard))]
        d = rep.trace.distributed
        assert (d.rank, d.world_size, d.layout) == (rank, WORLD, "fsdp2")
        # Local shards: (32x64 + 32 + 17x64 + 17) fp32 = 12,740 bytes on both ranks; rank 1's second Linear holds
        # 16 real rows of its 17 (256 + 4 bytes of padding).
        assert d.sharded_bytes == f["sharded"] == 12_740
        assert d.padding_bytes == f["sharded"] - f["unpadded"] == (0 if rank == 0 else 260)
        # Gathered: (64 + 34) rows x (64 + 1) fp32 = 25,480 bytes.
        assert d.unsharded_bytes == f["full"] == 25_480
        fwd, bwd, opt = (_phase(rep, 1, p) for p in ("forward", "backward", "optimizer"))
        # After the forward FSDP frees the gathered parameters, or keeps them all (reshard_after_forward=False).
        assert fwd.end[C.WEIGHTS] == f["sharded"] + (0 if reshard else f["full"])
        # While a module runs its gathered parameters are weights: more than the shards, never temporaries.
        assert f["sharded"] < fwd.peak[C.WEIGHTS] <= f["sharded"] + f["full"]
        assert fwd.peak[C.COMMUNICATION] > 0  # the all-gather's staging buffer
        # After backward: the sharded gradients, each rank's padded shard of the reduce-scatter output.
        assert bwd.end[C.GRADIENTS] == f["grads"] == 12_740
        assert bwd.end[C.WEIGHTS] == f["sharded"] and bwd.end[C.COMMUNICATION] == 0
        # AdamW's exp_avg and exp_avg_sq, made like each local shard without its padding (2 x 12,740 on rank 0,
        # 2 x 12,480 on rank 1), and four 4-byte step counters.
        assert opt.end[C.OPTIMIZER_STATES] == f["states"] == 2 * f["unpadded"] + 4 * 4
        assert opt.end[C.TEMPORARIES] == 0
        # DTensor works out each op's output shape on fake tensors of the global shape; they hold no memory and
        # are not counted (AdamW's for-each intermediates over three 25,220-byte global shapes would be).
        assert opt.peak[C.TEMPORARIES] < 2 * f["sharded"]
        assert f"rank {rank} of 2 (gloo, fsdp2): parameters 12.4 KiB as shards" in str(rep)
        assert "24.9 KiB when all gathered" in rep._repr_html_()
        # memprof's hooks are gone (FSDP's own stay) and torch's storage class is as it was.
        assert f["hooks"][0] == f["hooks"][1] and not f["resize_patched"]


@pytest.mark.slow
def test_merged_and_reconciled_per_rank(ranks):
    out, facts = ranks
    merged = memprof.merge([out / f"reshard1-rank{r}.json" for r in range(WORLD)])
    assert sorted(merged.ranks) == [0, 1] and merged.world_size == WORLD
    for rank, rep in merged.ranks.items():
        rec = rep.reconcile(at=(1, "optimizer", "end"))
        # ZeRO-3 (Table I) at N = 2 over the model's 6,305 parameters.
        psi = 64 * 64 + 64 + 33 * 64 + 33
        assert rep.trace.facts.num_params == psi
        weights = rec.row("weights")
        assert weights.formula == (4 * psi + 1) // 2  # 4 bytes each, half per rank: 12,610 bytes
        assert weights.measured == 12_740
        causes = {(c.category.value, c.name): c.bytes for c in rec.explanations}
        # Every rank stores ceil(rows / 2) rows: 12,740 - 12,610 = 130 bytes of padding, named.
        assert causes[("weights", "padding to the world size")] == 130
        assert rec.unexplained("weights") == 0
        assert rec.row("gradients").formula == 12_610 and rec.unexplained("gradients") == 0
        # AdamW: 8 bytes per parameter, + 4 step counters of 4 bytes, shared out: (8 x 6,305 + 16) / 2 = 25,228.
        states = rec.row("optimizer_states")
        assert states.formula == 25_228
        # Rank 0 holds all 33 rows of nothing uneven but 17 of 33 rows of the second Linear (+ 0.5 row x 65 x 8 =
        # +260 bytes), rank 1 16 of them (-260 bytes); each holds its 4 step counters whole (+8 bytes).
        assert causes[("optimizer_states", "uneven shards")] == (260 if rank == 0 else -260)
        assert causes[("optimizer_states", "unsharded step counters")] == 8
        assert rec.unexplained("optimizer_states") == 0
        print(rec)


def _estimate(world: int):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 33))  # the same shapes, not sharded
    return memprof.estimate(model, torch.optim.AdamW(model.parameters(), lr=0.1), inputs=torch.randn(16, 64),
                            world_size=world, parallel="fsdp")


_STATES = (C.WEIGHTS, C.GRADIENTS, C.OPTIMIZER_STATES, C.ACTIVATIONS, C.COMMUNICATION)


def _against(est, rep) -> None:
    """The estimate of rank 0 against a measured rank 0, phase by phase, to the byte: the ends, and the peaks of
    forward and backward (the estimate replays FSDP2's gathers, buffers and reduce-scatters on the simulated run).
    The batch itself is left out: the simulation holds it, the measured loop lets it go."""
    for phase in ("forward", "backward", "optimizer"):
        e, m = _phase(est.report(), 1, phase), _phase(rep, 1, phase)
        for cat in _STATES:
            assert e.end[cat] == m.end[cat], (phase, "end", cat)
            if phase != "optimizer":
                assert e.peak[cat] == m.peak[cat], (phase, "peak", cat)
    d, md = est.trace.distributed, rep.trace.distributed
    assert (d.sharded_bytes, d.padding_bytes, d.unsharded_bytes) == (md.sharded_bytes, md.padding_bytes,
                                                                    md.unsharded_bytes)


@pytest.mark.slow
def test_the_estimate_of_two_ranks_matches_rank_zero_measured(ranks):
    out, _facts = ranks
    _against(_estimate(2), memprof.load(out / "reshard1-rank0.json"))


@pytest.fixture
def fake_world_of_eight():
    # torch's fake process group: collectives return at once without moving data, so one process runs rank 0 of
    # eight with FSDP2's own code, on real (tiny) tensors.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_estimate_of_eight_ranks_matches_fsdp2_on_a_fake_world(fake_world_of_eight):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (8,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 33))
    for m in (model[0], model[2], model):
        fully_shard(m, mesh=mesh)
    rep = _profiled(model, torch.optim.AdamW(model.parameters(), lr=0.1), lambda: torch.randn(16, 64))
    # Rank 0 of 8: 8 of 64 rows and 5 of 33 (ceil), x 65 columns x 4 bytes = 3,380 bytes; gathered 64 + 40 rows.
    d = rep.trace.distributed
    assert (d.world_size, d.layout, d.sharded_bytes, d.unsharded_bytes) == (8, "fsdp2", 3_380, 104 * 65 * 4)
    _against(_estimate(8), rep)


def _stack() -> nn.Module:
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(8)])
    return nn.Sequential(nn.Linear(64, 256), blocks, nn.Linear(256, 10))


def test_a_stack_of_blocks_is_estimated_as_fsdp2_holds_it(fake_world_of_eight):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (8,))
    model = _stack()
    for block in model[1]:
        fully_shard(block, mesh=mesh)  # the usual wrapping: each block, then the root for the rest
    fully_shard(model, mesh=mesh)
    measured = _profiled(model, torch.optim.AdamW(model.parameters()), lambda: torch.randn(512, 64))
    plain = _stack()
    est = memprof.estimate(plain, torch.optim.AdamW(plain.parameters()), inputs=torch.randn(512, 64),
                           world_size=8, parallel="fsdp")
    # The peak, in backward: a block's full gradients, the next block's all-gather prefetched, the last
    # reduce-scatter's buffer kept; 52,186,776 bytes measured and estimated.
    assert est.peak_bytes == measured.peak.total == 52_186_776
    _against(est, measured)


def _reconciled_at_rest(model, opt):
    return _profiled(model, opt, lambda: torch.randn(16, 64)).reconcile(at=(1, "optimizer", "end"))


@pytest.mark.parametrize("how", ["hsdp", "partial", "tensor_parallel"])
def test_a_rank_sharded_any_way_reconciles_by_its_own_share(fake_world_of_eight, how):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    if how == "hsdp":  # replicated over 2, sharded over 4: each rank holds a quarter of each parameter
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=mesh)
    elif how == "partial":  # only the first Linear sharded (eight ways); the rest whole on every rank
        fully_shard(model[0], mesh=init_device_mesh("cpu", (8,)))
    else:  # Megatron-style column then row parallel Linears: weights in eighths, the last bias whole
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (8,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    rec = _reconciled_at_rest(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    # Whatever the placements, the formula is this rank's share of each parameter (64 x 128 + 128 + 128 x 64 + 64
    # elements, each over its shard count) and nothing is left unexplained but Adam's whole step counters.
    # 16,576 parameters: under HSDP a quarter each, 4,144 x 4 bytes.
    expected = {"hsdp": 16_576 // 4 * 4, "partial": (64 * 128 + 128) // 8 * 4 + (128 * 64 + 64) * 4,
                "tensor_parallel": (64 * 128 + 128 + 128 * 64) // 8 * 4 + 64 * 4}[how]
    for cat in ("weights", "gradients"):
        row = rec.row(cat)
        assert row.formula == row.measured == expected and rec.unexplained(cat) == 0, cat
    assert rec.unexplained("optimizer_states") == 0
    causes = {c.name for c in rec.causes if c.category.value == "optimizer_states"}
    assert causes <= {"unsharded step counters"}


def test_a_llama_shape_is_estimated_as_fsdp2_holds_it(fake_world_of_eight, monkeypatch):
    # The Llama-style model of benchmarks/estimate_scale.py (rotary attention with grouped keys and values, SwiGLU,
    # RMSNorm, untied head), tiny, wrapped as its 70B benchmark assumes: each layer, then the root.
    import pathlib

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    from estimate_scale import build_llama

    cfg = dict(hidden=128, layers=4, heads=4, kv_heads=2, ffn=344, vocab=512)

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    mesh = init_device_mesh("cpu", (8,))
    torch.manual_seed(0)
    model = build_llama(cfg, 64, torch.float32).to_empty(device="cpu")  # built on meta; values do not matter here
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = torch.randint(0, 512, (2, 64))
    measured = _profiled(model, torch.optim.AdamW(model.parameters(), foreach=True), lambda: ids, loss_fn)
    est = memprof.estimate(build_llama(cfg, 64, torch.float32), lambda ps: torch.optim.AdamW(ps, foreach=True),
                           inputs=ids, targets=ids, loss_fn=loss_fn, device="cpu", world_size=8, parallel="fsdp")
    for phase in ("forward", "backward", "optimizer"):
        m, e = _phase(measured, 1, phase), _phase(est.report(), 1, phase)
        assert (e.peak, e.end) == (m.peak, m.end), phase  # every category, to the byte


def test_a_frozen_last_block_is_resharded_when_its_backward_ends(fake_world_of_eight):
    # A block without trainable parameters has no gradient to say its backward is over: FSDP2 learns it from its
    # inputs' gradient and reshards it then; the estimate does the same.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def frozen_stack():
        model = _stack()
        model[1][7].requires_grad_(False)
        return model

    mesh = init_device_mesh("cpu", (8,))
    model = frozen_stack()
    for block in model[1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    measured = _profiled(model, torch.optim.AdamW(trainable, foreach=True), lambda: torch.randn(64, 64))
    plain = frozen_stack()
    est = memprof.estimate(plain, torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], foreach=True),
                           inputs=torch.randn(64, 64), world_size=8, parallel="fsdp")
    _against(est, measured)
