"""The plan's search (``memprof.simulate.plan_search``) on steps whose every moment is a known line in the batch:
the largest batch found is the true one, it is confirmed by the batch and the one above, a flat optimizer-step
moment that holds the peak at small batches does not mislead it, and a device overhead that jumps past the lines'
prediction is caught by the confirming simulations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from memprof.record.parts import Breakdown
from memprof.simulate.plan_search import (Lines, Probe, largest_batch, moments, per_sample, stream_between,
                                         stream_shape)

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


def test_shared_slopes_start_a_like_layout_from_its_own_batch_one_or_two():
    simulate, _ = _step(20 * GiB, 7 * GiB, 60 * GiB)
    _, _, slopes = largest_batch(Probe(simulate, LIMIT, 4096))
    # A layout with 10 GiB fewer model states: (80 - 10) // 7 = 10 samples, found from batch 1 and the slopes.
    other, calls = _step(10 * GiB, 7 * GiB, 50 * GiB)
    assert largest_batch(Probe(other, LIMIT, 4096), slopes)[:2] == (10, True)
    assert sorted(set(calls)) == [1, 10, 11]
    # From batch 2 (base=2), whose stream pairs with the batches above it where batch 1's may not.
    other, calls = _step(10 * GiB, 7 * GiB, 50 * GiB)
    assert largest_batch(Probe(other, LIMIT, 4096), slopes, base=2)[:2] == (10, True)
    assert sorted(set(calls)) == [2, 10, 11]
    # Where batch 2 is already too much, batch 1 is simulated and confirms the answer: 1 (73 + 7 = 80 GiB fits).
    heavy, calls = _step(73 * GiB, 7 * GiB, 50 * GiB)
    assert largest_batch(Probe(heavy, LIMIT, 4096), slopes, base=2)[:2] == (1, True) and sorted(calls) == [1, 2]
    # And where not even one sample fits, 0 is confirmed by batch 1: a simulation more than from batch 1, which
    # settles it alone.
    none, calls = _step(74 * GiB, 7 * GiB, 50 * GiB)
    assert largest_batch(Probe(none, LIMIT, 4096), slopes, base=2)[:2] == (0, True) and sorted(calls) == [1, 2]
    none, calls = _step(74 * GiB, 7 * GiB, 50 * GiB)
    assert largest_batch(Probe(none, LIMIT, 4096), slopes)[:2] == (0, True) and calls == [1]


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


# -- the device peak predicted from two simulated streams ----------------------------------------------------------

SEGMENT = 8 * GiB


class _Replay:
    """A stand-in for :class:`memprof.simulate.device_memory.Replay`: the device peak of a stream is its live bytes'
    high rounded up to whole 8 GiB segments (a step function of the batch that no line through the tensors' peaks
    follows), out of memory beyond 100 GiB."""

    def __init__(self, stream):
        self._stream = list(stream)

    def stream(self):
        return list(self._stream)

    def figures(self, stream=None):
        live, high = {}, 0
        for _seq, key, nbytes in (self._stream if stream is None else stream):
            if nbytes < 0:
                live.pop(key, None)
            else:
                live[key] = nbytes
            high = max(high, sum(live.values()))
        peak = -(-high // SEGMENT) * SEGMENT
        return peak, ("out of memory" if peak > 100 * GiB else None), peak > 100 * GiB


def _streamed(states: int, per_sample: int, extra_at_one: bool = False, replays: bool = True):
    """A simulate(b) whose stream makes the states, then activations of ``per_sample`` bytes a sample in three
    storages (one freed before the next is made), then frees them; its device peak is :class:`_Replay`'s. With
    ``extra_at_one`` batch 1 makes one storage more (an op that copies at one sample), so its stream's shape
    differs from the others'. Without ``replays`` the estimates keep no stream (as a CPU target's)."""
    calls: list[int] = []

    def simulate(b: int):
        calls.append(b)
        key = 1000 + b  # addresses differ between runs: only the order of storages matters
        stream = [(1, key, states), (2, key + 1, per_sample * b // 2), (3, key + 2, per_sample * b // 4),
                  (4, key + 1, -1), (5, key + 1, per_sample * b // 2 + per_sample * b // 4)]
        if extra_at_one and b == 1:
            stream.append((6, key + 7, 512))
        stream += [(7, key + 1, -1), (8, key + 2, -1)]
        replay = _Replay(stream)
        peak, oom, _pressed = replay.figures()
        tensors = states + per_sample * b
        part = Breakdown.from_mapping({"activations": tensors})
        rec = SimpleNamespace(step=1, phase="forward", occurrence=0, start=part, peak=part, end=part)
        return SimpleNamespace(trace=SimpleNamespace(phases=(rec,)), peak_bytes=tensors,
                               device_memory=SimpleNamespace(oom=oom, device_peak=peak,
                                                             _replay=replay if replays else None))

    return simulate, calls


def test_a_stream_between_two_batches_is_each_events_line():
    simulate, _ = _streamed(GiB, 8 * 2**20)
    s3, s7 = (simulate(b).device_memory._replay.stream() for b in (3, 7))
    shape3, sizes3 = stream_shape(s3)
    shape7, sizes7 = stream_shape(s7)
    # Keys differ between the runs (1003.. against 1007..); the shapes do not: storage 1 is freed and made again
    # under the same address as a new storage (the n-th made), and every free is told from a make.
    # (Frees are written -n - 2: storage 1's free -3.)
    assert shape3 == shape7 and list(shape3) == [0, 1, 2, -3, 3, -5, -4]
    # Batch 5 from 3 and 7: every size on its line (4 MiB a sample for the first activation: 20 MiB at 5), with
    # batch 3's seqs and keys.
    five = stream_between(3, s3, sizes7, 7, 5)
    assert [(seq, key) for seq, key, _n in five] == [(seq, key) for seq, key, _n in s3]
    assert [n for _s, _k, n in five] == [GiB, 20 * 2**20, 10 * 2**20, -1, 30 * 2**20, -1, -1]
    # Bytes that are not a line round up (never a prediction below the truth), and never go below 0.
    assert stream_between(1, [(1, 9, 10)], [13], 3, 2) == [(1, 9, 12)]
    assert stream_between(1, [(1, 9, 10)], [11], 3, 2) == [(1, 9, 11)]  # 10.5 -> 11
    assert stream_between(2, [(1, 9, 10)], [0], 3, 9) == [(1, 9, 0)]


def test_the_streams_predict_a_segment_step_the_lines_miss():
    # 40 GiB of states and 3 GiB a sample: the live bytes' high is 40 + 3 b GiB, the device peak that rounded up to
    # 8 GiB segments. At batches 1 and 2 it is 48 GiB, 5 and 2 GiB above the tensors; with the 2 GiB of the batch
    # nearest, the lines put the answer at 12 (40 + 36 + 2 = 78 GiB), and 13 (79 GiB: one 80 GiB device) fits too.
    simulate, calls = _streamed(40 * GiB, 3 * GiB)
    truth = 0
    while simulate(truth + 1).device_memory.device_peak <= LIMIT:
        truth += 1
    assert truth == 13
    calls.clear()
    probe = Probe(simulate, LIMIT, 4096)
    assert largest_batch(probe)[:2] == (13, True)
    # Batches 1 and 2 (the lines), whose streams have one shape: their replay predicts 13 exactly, and 13 and the
    # batch above are the only other simulations. The lines alone step up from 12 to 13, a simulation more.
    assert calls == [1, 2, 13, 14]
    lines_only, calls = _streamed(40 * GiB, 3 * GiB, replays=False)
    assert largest_batch(Probe(lines_only, LIMIT, 4096))[:2] == (13, True) and calls == [1, 2, 12, 13, 14]
    # A prediction equals what simulating that batch gives, segments included.
    for b in (3, 6, 9, 12, 20):
        assert probe.predicted(b) == Probe(simulate, LIMIT, 4096).judged(b)


def test_the_streams_correct_lines_that_overshoot():
    # 42 GiB of states, 3 GiB a sample, a 79 GiB limit: batch 2's 48 GiB fill their segments exactly, so the lines
    # (with no overhead) put the answer at 12 (78 GiB), but 78 GiB take 80 GiB of segments; the device peak fits
    # the limit up to 72 GiB of segments, 10 samples (72 GiB). From the lines' guess the predictions step down
    # (12, 11, then 9, and 10 between) and the search simulates only the answer and the batch above it.
    limit = 79 * GiB
    simulate, calls = _streamed(42 * GiB, 3 * GiB)
    truth = 0
    while Probe(simulate, limit, 4096).fits(truth + 1):
        truth += 1
    assert truth == 10
    calls.clear()
    assert largest_batch(Probe(simulate, limit, 4096))[:2] == (10, True)
    assert calls == [1, 2, 10, 11]


def test_a_batch_whose_stream_differs_in_shape_predicts_nothing():
    simulate, _ = _streamed(40 * GiB, 3 * GiB, extra_at_one=True)
    probe = Probe(simulate, LIMIT, 4096)
    probe.judged(1)
    probe.judged(4)
    assert probe.predicted(2) is None  # batch 1 made a storage more: no line through its stream and batch 4's
    probe.judged(6)
    assert probe.predicted(2) == Probe(simulate, LIMIT, 4096).judged(2)  # 4 and 6 have one shape
    # Without a replay (a CPU target, or a figure from elsewhere) nothing is predicted either.
    plain, _ = _step(20 * GiB, 7 * GiB, 60 * GiB)
    probe = Probe(plain, LIMIT, 4096)
    probe.judged(1), probe.judged(2)
    assert probe.predicted(5) is None


def test_a_predicted_out_of_memory_counts_as_not_fitting():
    simulate, _ = _streamed(40 * GiB, 3 * GiB)
    probe = Probe(simulate, 200 * GiB, 4096)  # room beyond the replay's 100 GiB: only its error says no
    # 18 samples: 40 + 54 = 94 GiB in 96 GiB of segments; 19: 97 GiB needs 104, beyond the replay's 100: out of memory.
    assert largest_batch(probe)[:2] == (18, True)
    assert probe.predicted(25) > 200 * GiB


def _banded(fits_at, pressed_from: int):
    """A simulate(b) whose stream's one storage holds b GiB, and whose replay says: fits where ``fits_at(b)``
    (else out of memory), memory pressed from ``pressed_from`` samples on."""
    calls: list[int] = []

    class Replay:
        def __init__(self, stream):
            self._stream = stream

        def stream(self):
            return list(self._stream)

        def figures(self, stream=None):
            b = (self._stream if stream is None else stream)[0][2] // GiB
            fits = fits_at(b)
            return (LIMIT if fits else LIMIT + GiB), (None if fits else "out of memory"), b >= pressed_from

    def simulate(b: int):
        calls.append(b)
        replay = Replay([(1, 100 + b, b * GiB), (2, 100 + b, -1)])
        peak, oom, _ = replay.figures()
        part = Breakdown.from_mapping({"activations": b * GiB})
        rec = SimpleNamespace(step=1, phase="forward", occurrence=0, start=part, peak=part, end=part)
        return SimpleNamespace(trace=SimpleNamespace(phases=(rec,)), peak_bytes=b * GiB,
                               device_memory=SimpleNamespace(oom=oom, device_peak=peak, num_alloc_retries=1,
                                                             _replay=replay))

    return simulate, calls


@pytest.mark.parametrize("band", [(11, 12), (11, 11), (5, 6)])
def test_the_answer_is_the_edge_below_which_every_batch_fits(band):
    # Where memory is pressed the allocator frees its cache and retries, and fitting is not monotone: here every
    # batch up to 20 fits but those of ``band`` (out of memory after the retry), and none above 20. The answer is
    # the edge below the first batch that does not fit, however the search came at it: a user taking fewer
    # samples than the answer must not meet an out-of-memory error.
    first, last = band
    simulate, calls = _banded(lambda b: b <= 20 and not first <= b <= last, pressed_from=4)
    best, verified, _ = largest_batch(Probe(simulate, LIMIT, 4096))
    assert (best, verified) == (first - 1, True)
    assert first in calls and first - 1 in calls  # both sides of the answer simulated
    # Without memory pressed below the answer, nothing below it is looked at again.
    simulate, calls = _banded(lambda b: b <= 20, pressed_from=19)
    assert largest_batch(Probe(simulate, LIMIT, 4096))[:2] == (20, True)


def test_a_wrong_prediction_below_the_answer_does_not_hide_a_band_above_it():
    # Every batch up to 20 fits but 14 and 15. Once the search has found 20 (it fits, 21 does not), the streams
    # predict 6 not to fit, wrongly (its simulation fits): the smallest batch predicted not to fit below 20. The
    # search simulates 6, finds the prediction wrong, and asks again: the band at 14 still moves the answer to 13.
    simulate, calls = _banded(lambda b: b <= 20 and b not in (14, 15), pressed_from=4)
    probe = Probe(simulate, LIMIT, 4096)
    right = probe._predict

    def predict(b):
        judged = right(b)
        return LIMIT + 1 if b == 6 and 21 in probe.device and judged is not None else judged

    probe._predict = predict
    assert largest_batch(probe)[:2] == (13, True)
    assert calls.index(20) < calls.index(6) < calls.index(14)  # 20 first, then the wrong gap, then the band


def test_a_batch_out_of_memory_does_not_set_the_overhead_of_the_next_guess():
    # The device holds 5 GiB above the tensors at every batch that fits; a batch that runs out of memory reports
    # the replay without the device's limit, whose allocator never freed its cache: 20 GiB above its tensors. The
    # truth: 20 + 7 x 7 + 5 = 74 GiB fits, 8 samples (20 + 56 + 5 = 81 GiB) do not.
    simulate, calls = _step(20 * GiB, 7 * GiB, 30 * GiB, overhead=lambda b, peak: 20 * GiB if peak + 5 * GiB > LIMIT
                            else 5 * GiB)

    def replayed(b):
        est = simulate(b)
        if est.device_memory.device_peak > LIMIT:
            est.device_memory.oom = "out of memory"
        return est

    slopes = {(1, phase, 0, w): per for phase, per in (("forward", 7 * GiB), ("optimizer", 0))
              for w in ("start", "peak", "end")}
    # A start predicted from a like configuration: 12 GiB forward at batch 1 (its states 15 GiB under this one's),
    # 30 GiB optimizer, the like configuration's 5 GiB above the tensors: 1 + (80 - 5 - 12) // 7 = 10 samples.
    start = {(1, phase, 0, w): at for phase, at in (("forward", 12 * GiB), ("optimizer", 30 * GiB))
             for w in ("start", "peak", "end")}
    probe = Probe(replayed, LIMIT, 4096)
    assert largest_batch(probe, slopes, start, 5 * GiB)[:2] == (7, True)
    # 10 runs out of memory (20 + 70 = 90 GiB of tensors). The guess after it takes the like configuration's 5 GiB
    # above the tensors, not 10's 20 GiB: 20 + 7 b + 5 <= 80 gives 7, confirmed by 8. With 10's 20 GiB the guess
    # would be 5 (20 + 35 + 20 = 75), and the search would climb from there, a simulation more.
    assert calls == [10, 7, 8]
    # The overhead read for a guess is the nearest batch's that fitted, whatever batch is nearer.
    assert probe.overhead(9) == probe.overhead(1) == 5 * GiB
    only_over = Probe(replayed, LIMIT, 4096)
    only_over.judged(10)
    assert only_over.overhead(9, fallback=3 * GiB) == 3 * GiB and only_over.overhead(9) == 20 * GiB


def test_the_replayed_streams_first_guess_is_not_bisected_away():
    # 20 GiB of states and 2 GiB a sample, in 8 GiB segments: 30 samples fit (80 GiB), 31 do not (82 GiB, 88 in
    # segments). A start from a like configuration whose slope is 3 GiB a sample guesses 1 + 78 // 3 = 27 (it
    # fits); its lines, too steep, put the answer at 27, so the search steps up by one to 28 (it fits too): two
    # probes in a row that moved the same end. Batches 27 and 28 now have streams of one shape, whose replay
    # predicts 30: that guess is the replayed streams' first, not a third miss of the lines, so it is simulated
    # as it is (a doubling to 56 here would cost a simulation more), and 31 confirms it.
    simulate, calls = _streamed(20 * GiB, 2 * GiB)
    slopes = {(1, "forward", 0, w): 3 * GiB for w in ("start", "peak", "end")}
    start = {(1, "forward", 0, w): 2 * GiB for w in ("start", "peak", "end")}
    assert largest_batch(Probe(simulate, LIMIT, 4096), slopes, start, 0)[:2] == (30, True)
    assert calls == [27, 28, 30, 31]


def _by_category(weights: int, per_sample: int, flat_activations: int = 0, step_temporaries: int = 0,
                 sample_temporaries: int = 0):
    """A simulate(b) whose records hold their bytes by category: ``weights`` (flat), activations of
    ``flat_activations + per_sample * b`` and forward temporaries of ``sample_temporaries * b`` in the forward, and
    the optimizer step's ``step_temporaries`` (flat) beside the weights."""
    calls: list[int] = []

    def simulate(b: int):
        calls.append(b)
        fwd = Breakdown.from_mapping({"weights": weights, "activations": flat_activations + per_sample * b,
                                      "temporaries": sample_temporaries * b})
        opt = Breakdown.from_mapping({"weights": weights, "temporaries": step_temporaries})
        trace = SimpleNamespace(phases=tuple(SimpleNamespace(step=1, phase=phase, occurrence=0, start=part,
                                                             peak=part, end=part)
                                             for phase, part in (("forward", fwd), ("optimizer", opt))))
        peak = max(fwd.total, opt.total)
        return SimpleNamespace(trace=trace, peak_bytes=peak,
                               device_memory=SimpleNamespace(oom=None, device_peak=peak))

    return simulate, calls


def test_per_sample_counts_what_grows_with_the_batch():
    simulate, _ = _by_category(10 * GiB, 3 * GiB, step_temporaries=5 * GiB, sample_temporaries=GiB)
    slopes = per_sample(simulate(2).trace, 2)
    # The forward: (2 x 3 GiB of activations + 2 x 1 GiB of temporaries) / 2 samples; the weights are flat. The
    # optimizer step: its 5 GiB of temporaries are the parameters', flat.
    assert slopes[(1, "forward", 0, "peak")] == 4 * GiB
    assert slopes[(1, "optimizer", 0, "peak")] == 0


def test_one_batch_guesses_the_lines_and_a_right_guess_costs_three_simulations():
    # 20 GiB of weights, 7 GiB a sample: (80 - 20) // 7 = 8. Batch 1 guesses 7 GiB a sample, which is right: the
    # answer and the one above are simulated next, and nothing else (batches 1 and 2 first cost four).
    simulate, calls = _by_category(20 * GiB, 7 * GiB, step_temporaries=30 * GiB)
    best, verified, slopes = largest_batch(Probe(simulate, LIMIT, 4096))
    assert calls == [1, 8, 9]
    assert (best, verified) == (_truth(simulate, LIMIT), True) == (8, True)
    # What the like configurations are given is measured, through two simulated batches (1 and 8), not guessed.
    assert slopes is not None and slopes[(1, "forward", 0, "peak")] == 7 * GiB


@pytest.mark.parametrize("flat, grows", [(12, 0), (0, 3)], ids=["a flat table among the activations",
                                                                  "temporaries that grow"])
def test_a_wrong_guess_is_corrected_by_the_simulations_that_confirm_it(flat, grows):
    # A position table of 12 GiB counted with the activations (the guess takes 7 + 12 GiB a sample: too few
    # samples), or forward temporaries of 3 GiB a sample on top of the weights' step (the guess is right there):
    # each search ends on the truth, confirmed on both sides, in four simulations at most.
    simulate, calls = _by_category(20 * GiB, 7 * GiB, flat_activations=flat * GiB, sample_temporaries=grows * GiB)
    best, verified, _ = largest_batch(Probe(simulate, LIMIT, 4096))
    assert (best, verified) == (_truth(_by_category(20 * GiB, 7 * GiB, flat_activations=flat * GiB,
                                                    sample_temporaries=grows * GiB)[0], LIMIT), True)
    assert calls[0] == 1 and len(set(calls)) <= 4 and {best, best + 1} <= set(calls)


def test_a_like_row_starts_from_the_reference_rows_lines_where_they_did_not_simulate_its_batch():
    # The reference layout (20 GiB of states) without and with checkpointing (7 and 3 GiB a sample) simulated
    # batch 1 and the batches its guess took (8 and 9; 20 and 21), not batch 2; the like layout without
    # checkpointing (12 GiB of states) started at batch 2. Its checkpointed row's start at batch 2: its own 12 + 14
    # GiB, plus what checkpointing changed in the reference at 2 samples, read off the reference's lines
    # (20 + 2 x 3) - (20 + 2 x 7) = -8 GiB: 18 GiB in the forward.
    from memprof.simulate.plan import _sibling_start

    probes = {}
    for layout, states, ckpt, per in (("ref", 20, False, 7), ("ref", 20, True, 3), ("own", 12, False, 7)):
        simulate, _ = _by_category(states * GiB, per * GiB)
        probe = Probe(simulate, LIMIT, 4096)
        if layout == "own":
            probe.judged(2)
        else:
            largest_batch(probe)
            assert 2 not in probe.runs
        probes[(layout, "bf16", ckpt)] = probe
    start, _overhead, at = _sibling_start(probes, "own", "ref", "bf16", True)
    assert at == 2 and start is not None
    assert start[(1, "forward", 0, "peak")] == (12 + 14 + (20 + 6) - (20 + 14)) * GiB == 18 * GiB
    assert start[(1, "optimizer", 0, "peak")] == 12 * GiB  # the weights alone, flat
