"""Expert parallelism, simulated: a token-choice MoE whose experts are split over EP ranks, the tokens dispatched and
combined with all-to-alls whose split sizes are data (per-expert counts exchanged by a first all-to-all). The
simulation answers the counts from the routing assumption; the measured run is the same function on real tensors
on torch's fake process group, routed the same way (``ep_models.BalancedTopk``) and handed the counts peers that
route alike would send (``ep_models.PeersLikeThisRank``). Every category, at the peak and the end of every phase of
both steps, to the byte."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import memprof
from memprof import Category as C

from ep_models import DIM, HID, IDS_LEN, BalancedTopk, PeersLikeThisRank, build, expert_parallel, loss_fn, E
from phases import assert_equal_everywhere, phase_records

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

IDS = torch.randint(0, 64, (IDS_LEN,), generator=torch.Generator().manual_seed(0))


def measured(world: int, rank: int, exchange: str):
    """The estimate's loop (forward, loss, backward, step, zero_grad, twice, the loss held through the step) on
    real tensors, rank ``rank`` of ``world`` on the fake process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        model = expert_parallel(build(exchange), init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters())
        with memprof.profile(model, opt) as prof, BalancedTopk(), PeersLikeThisRank():
            for _ in range(2):
                loss = loss_fn(model(IDS), IDS)
                loss.backward()
                opt.step()
                opt.zero_grad()
            del loss
        return prof.report(), model
    finally:
        dist.destroy_process_group()


def simulated(world: int, rank: int, exchange: str, routing="balanced", mesh=None):
    return memprof.estimate(build(exchange), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS,
                            loss_fn=loss_fn, world_size=world, rank=rank, parallelize=expert_parallel, routing=routing,
                            mesh=mesh)


@pytest.mark.parametrize(("world", "rank", "exchange"), [(2, 0, "funcol"), (4, 3, "c10d"), (4, 1, "funcol")])
def test_expert_parallel_is_simulated_to_the_byte(world, rank, exchange):
    est = simulated(world, rank, exchange)
    rep, model = measured(world, rank, exchange)
    assert_equal_everywhere(est, rep)
    # The rank holds E / EP experts of each of the 2 layers: 2 x (E/EP) x (DIM x HID + HID x DIM) x 4 B, beside the
    # embedding, the routers, the norms and the head, whole: (64 x 32 + 2 x (32 x 8 + 32) + 32 x 64) x 4 B.
    experts = 2 * (E // world) * (DIM * HID + HID * DIM) * 4
    dense = (64 * 32 + 2 * (32 * 8 + 32) + 32 * 64) * 4
    held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(held.values()) == experts + dense
    assert phase_records(rep.trace)[(1, "optimizer", 0)].end[C.WEIGHTS] == experts + dense
    assert est.trace.peak[C.WEIGHTS] == experts + dense == {2: 149_760, 4: 84_224}[world]
    # The textbook's term for the experts (Switch Transformers §5.4: E/ep experts per rank) gives the same bytes.
    from memprof.anatomy.parallelism import Experts, Parallelism, Precision, expert_terms

    share = expert_terms(Experts(2 * E * (DIM * HID + HID * DIM)), Parallelism(ep=world), precision=Precision(param_bytes=4))
    assert share[0].bytes == experts
    # Balanced: each rank routes 24 tokens x 2 picks = 48 rows, 48 / EP to every rank, and receives as many.
    note = next(n for n in est.notes if n.startswith("expert parallel"))
    assert f"receives {IDS_LEN * 2:,} token rows per MoE layer ({IDS_LEN * 2 // world:,} from each of {world}" in note


def test_worst_routing_grows_the_receive_side_and_the_experts_activations():
    balanced, worst = simulated(4, 1, "funcol"), simulated(4, 1, "funcol", "worst", mesh={"ep": 4})
    # Worst: every token's 2 picks on experts 0 and 1, both on one rank; rank 1 is simulated as that rank: it
    # receives all 4 ranks' 24 x 2 rows = 192, four times the balanced 48.
    note = next(n for n in worst.notes if n.startswith("expert parallel"))
    assert "receives 192 token rows per MoE layer (48 from each of 4" in note
    assert worst.peak[C.ACTIVATIONS] > 3 * balanced.peak[C.ACTIVATIONS]
    assert worst.peak_bytes > balanced.peak_bytes
    # capacity=1.25: experts filled in turn up to ceil(1.25 x 48 / 8) = 8 tokens (8, 8, 8, 8, 8, 8, 0, 0); the
    # heaviest rank's two experts hold 16 rows, which every rank sends: 4 x 16 = 64 received.
    capacity = simulated(4, 1, "funcol", "capacity=1.25")
    assert any("receives 64 token rows per MoE layer (16 from each of 4" in n for n in capacity.notes)
    assert balanced.peak[C.ACTIVATIONS] < capacity.peak[C.ACTIVATIONS] < worst.peak[C.ACTIVATIONS]
    # A mesh dimension named ep: the notes give the textbook's per-rank terms and their source.
    assert any("Switch Transformers, §5.4" in n and "divided by ep = 4" in n for n in worst.notes)
    assert not any("Switch Transformers" in n for n in balanced.notes)  # an unnamed mesh says no degree


def test_every_rank_s_routing_records_are_checked():
    from memprof.errors import InvalidArgumentError
    from memprof.record.routing import RouterCall, RoutingRecord

    # One record for a world of 2: rank 1 has none of its own.
    one = RoutingRecord(calls=(RouterCall("layers.0.moe", E, 2, (6,) * E),))
    with pytest.raises(InvalidArgumentError, match="holds 1 ranks' records, but rank 1"):
        simulated(2, 1, "funcol", routing=[one])
    # A report profiled without record_routing=True.
    with memprof.profile(torch.nn.Linear(2, 2)) as prof:
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    with pytest.raises(InvalidArgumentError, match="record_routing=True"):
        simulated(2, 0, "funcol", routing=[prof.report(), prof.report()])


@pytest.mark.parametrize(("world", "rank"), [(2, 0), (4, 1)])
def test_the_balanced_assumption_is_within_one_percent_of_a_rank_routing_for_real(world, rank):
    # The rank routes its own batch with its own router (no BalancedTopk), its peers' counts as its own: the
    # experts' inputs vary with the routing, the model states do not. Measured here: +0.67 % (EP 2, rank 0) and
    # -0.23 % (EP 4, rank 1) against the balanced estimate; the notes name the assumption.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        model = expert_parallel(build("funcol"), init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters())
        with memprof.profile(model, opt) as prof, PeersLikeThisRank():
            for _ in range(2):
                loss = loss_fn(model(IDS), IDS)
                loss.backward()
                opt.step()
                opt.zero_grad()
            del loss
        real = prof.report().peak.total
    finally:
        dist.destroy_process_group()
    est = simulated(world, rank, "funcol")
    assert abs(est.peak_bytes - real) <= real // 100
    assert any("balanced" in n for n in est.notes)
