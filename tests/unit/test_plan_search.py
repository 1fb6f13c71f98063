"""The plan's search (``memprof.simulate.plan_search``) on steps whose every moment is a known line in the batch:
the largest batch found is the true one, it is confirmed by the batch and the one above, a flat optimizer-step
moment that holds the peak at small batches does not mislead it, and a device overhead that jumps past the lines'
prediction is caught by the confirming simulations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from memprof.record.parts import Breakdown
from memprof.simulate.plan_search import Lines, Probe, largest_batch, moments

GiB = 2**30
LIMIT = 80 * GiB


def _step(forward_fixed: int, per_sample: int, optimizer: int, overhead=lambda b, peak: 0):
    """A simulate(b) whose step has a forward moment ``forward_fixed + per_sample * b`` and a flat optimizer-step
    moment ``optimizer``; the device peak is the tensors' peak plus ``overhead(b, peak)``."""
    calls: list[int] = []

    def simulate(b: int):
        calls.append(b)
        fwd = forward_fixed + per_sample * b

        def rec(phase: str, total: int):
            part = Breakdown.from_mapping({"activations": total})
            return SimpleNamespace(step=1, phase=phase, occurrence=0, start=part, peak=part, end=part)

        trace = SimpleNamespace(phases=(rec("forward", fwd), rec("optimizer", optimizer)))
        peak = max(fwd, optimizer)
        device = peak + overhead(b, peak)
        return SimpleNamespace(trace=trace, peak_bytes=peak,
                               device_memory=SimpleNamespace(oom=None, device_peak=device))

    return simulate, calls


def _truth(simulate, limit: int) -> int:
    """The largest batch whose device peak fits, by trying every batch (the reference the search must equal)."""
    b = 0
    while simulate(b + 1).device_memory.device_peak <= limit:
        b += 1
    return b


def test_lines_predict_the_largest_moment():
    lines = Lines.through(1, {"fwd": 10, "opt": 50}, 2, {"fwd": 20, "opt": 50})
    # fwd: 10 b; opt: 50 flat. Peak at 3 is the optimizer's 50, at 7 the forward's 70.
    assert lines.peak(3) == 50 and lines.peak(7) == 70
    # Within 65 bytes: fwd allows 6 (60 <= 65), opt (50 <= 65) does not bind.
    assert lines.largest(65, 1000) == 6
    assert lines.largest(45, 1000) == 0  # the flat moment alone is over


def test_a_flat_optimizer_peak_at_small_batches_does_not_mislead_the_search():
    # Forward: 20 GiB of states plus 7 GiB per sample; the optimizer step holds 60 GiB whatever the batch. The line
    # through the peaks at batches 1 and 2 (60, 60 GiB) is flat, so it would guess the ceiling; the moments' lines
    # give (80 - 20) // 7 = 8.
    simulate, calls = _step(20 * GiB, 7 * GiB, 60 * GiB)
    best, verified, slopes = largest_batch(Probe(simulate, LIMIT, 4096))
    assert (best, verified) == (8, True)
    assert sorted(set(calls)) == [1, 2, 8, 9]  # the lines' two batches, the answer and the one above
    assert best == _truth(simulate, LIMIT)
    assert slopes is not None and slopes[(1, "forward", 0, "peak")] == 7 * GiB


def test_shared_slopes_start_a_like_layout_from_its_own_batch_one():
    simulate, _ = _step(20 * GiB, 7 * GiB, 60 * GiB)
    _, _, slopes = largest_batch(Probe(simulate, LIMIT, 4096))
    # A layout with 10 GiB fewer model states: (80 - 10) // 7 = 10 samples, found from batch 1 and the slopes.
    other, calls = _step(10 * GiB, 7 * GiB, 50 * GiB)
    assert largest_batch(Probe(other, LIMIT, 4096), slopes)[:2] == (10, True)
    assert sorted(set(calls)) == [1, 10, 11]


@pytest.mark.parametrize("jump_at", [3, 6, 8])
def test_an_overhead_the_lines_do_not_see_is_caught_by_the_confirmation(jump_at):
    # The allocator's overhead jumps by 9 GiB from batch ``jump_at`` on (a new segment size class): the lines,
    # with the overhead seen at small batches, put the answer at 8; the simulations find the true one.
    simulate, _ = _step(20 * GiB, 7 * GiB, 60 * GiB, overhead=lambda b, peak: 9 * GiB if b >= jump_at else 0)
    truth = _truth(simulate, LIMIT)
    best, verified, _ = largest_batch(Probe(simulate, LIMIT, 4096))
    assert (best, verified) == (truth, True)
    probe = Probe(simulate, LIMIT, 4096)
    largest_batch(probe)
    # Confirmed means simulated on both sides: the answer fits, the batch above does not.
    assert probe.device[best] <= LIMIT < probe.device[best + 1]


def test_nothing_fits_and_the_ceiling():
    simulate, calls = _step(90 * GiB, GiB, 0)
    assert largest_batch(Probe(simulate, LIMIT, 4096))[:2] == (0, True) and calls == [1]
    # Everything fits up to the ceiling: the answer is the ceiling, not confirmed (nothing above it was tried).
    tiny, _ = _step(GiB, 1, 0)
    assert largest_batch(Probe(tiny, LIMIT, 64))[:2] == (64, False)


def test_an_out_of_memory_replay_counts_as_not_fitting():
    simulate, _ = _step(20 * GiB, 7 * GiB, 60 * GiB)

    def oom_from_5(b):
        est = simulate(b)
        if b >= 5:
            est.device_memory.oom = "segment of 2 GiB at backward"
        return est

    assert largest_batch(Probe(oom_from_5, LIMIT, 4096))[:2] == (4, True)


def test_moments_key_every_phase_start_peak_and_end():
    simulate, _ = _step(GiB, GiB, 3 * GiB)
    keys = moments(simulate(2).trace)  # the tensor categories only, whatever else a record holds
    assert len(keys) == 6 and keys[(1, "forward", 0, "peak")] == 3 * GiB  # 1 GiB + 2 x 1 GiB


@pytest.mark.parametrize("states", [10, 4, 30])
def test_a_predicted_start_skips_batch_one_and_a_wrong_one_is_corrected(states):
    # The row's moments at batch 1 are predicted as 10 GiB of states + 7 GiB (forward) and 50 GiB (optimizer),
    # so the search starts at (80 - 17) // 7 + 1 = 10. The row's truth has ``states`` GiB of states: as
    # predicted (10), fewer (4: it fits 10 samples and more) or far more (30: only 6 fit); each ends on the truth,
    # confirmed on both sides.
    simulate, _ = _step(20 * GiB, 7 * GiB, 60 * GiB)
    _, _, slopes = largest_batch(Probe(simulate, LIMIT, 4096))
    other, calls = _step(states * GiB, 7 * GiB, 50 * GiB)
    start = {(1, "forward", 0, w): 17 * GiB for w in ("start", "peak", "end")}
    start.update({(1, "optimizer", 0, w): 50 * GiB for w in ("start", "peak", "end")})
    best, verified, _ = largest_batch(Probe(other, LIMIT, 4096), slopes, start, 0)
    assert (best, verified) == (_truth(_step(states * GiB, 7 * GiB, 50 * GiB)[0], LIMIT), True)
    assert 1 not in calls  # batch 1 is never simulated
    if states == 10:
        assert sorted(set(calls)) == [10, 11]  # the answer and the one above


def test_a_device_peak_a_sample_below_the_lines_costs_one_step_up_not_a_leap():
    # The overhead is 7 GiB (a sample's bytes) at batches 1 and 2 and none from 3 on (a segment the replay stops
    # keeping): the lines, with the overhead of the batch nearest, put the answer at 7; 8 fits as well
    # (20 + 7 x 8 = 76 GiB), 9 does not (83 GiB). The search steps up by one from 7 and stops: it does not leap to
    # twice the batch it has confirmed, which would cost a simulation more.
    simulate, calls = _step(20 * GiB, 7 * GiB, 60 * GiB, overhead=lambda b, peak: 7 * GiB if b <= 2 else 0)
    best, verified, _ = largest_batch(Probe(simulate, LIMIT, 4096))
    assert (best, verified) == (_truth(simulate, LIMIT), True) == (8, True)
    assert 16 not in calls and max(calls) == 9
