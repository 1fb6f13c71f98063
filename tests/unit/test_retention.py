"""What a long run keeps, on hand-built step records: the first steps, the peak's, the last and the
scheduled ones in full; every step in the per-phase statistics; memory bounded whatever the count."""

from __future__ import annotations

import statistics

from memprof.collect.retention import FIRST_STEPS, MAX_SELECTED, Retention, _Series
from memprof.record.trace import StepRecord

from factories import cpu, phase


def _step(index: int, peak: int) -> StepRecord:
    return StepRecord(index, (phase(index, "forward", start=cpu(weights=100), peak=cpu(weights=100, activations=peak),
                                    end=cpu(weights=100, activations=peak // 2)),))


def test_a_series_knows_its_exact_median_while_its_values_are_few():
    s = _Series()
    values = [5, 1, 9, 1, 1, 7]
    for v in values:
        s.add(v)
    assert s.stat() == (1, 1, 9)  # lower median of 1 1 1 5 7 9
    s.add(None)
    assert s.stat() is None  # one phase that did not measure it: not measured, never a number


def test_a_series_of_many_distinct_values_keeps_a_thinned_sample_with_exact_min_and_max():
    s = _Series()
    values = list(range(10_000))
    for v in values:
        s.add(v)
    lo, mid, hi = s.stat()
    assert (lo, hi) == (0, 9_999)
    assert abs(mid - statistics.median(values)) <= 200  # an evenly thinned sample: within 2 % here
    assert s.counts is None and len(s.sample) < 2 * 64


def test_retention_keeps_the_first_steps_the_peak_and_the_last():
    r = Retention()
    peaks = [10, 20, 30, 40, 500, 60, 70, 80]
    for i, p in enumerate(peaks):
        r.add(_step(i, p), peak_step=4 if i >= 4 else i)
    assert [s.index for s in r.records()] == [0, 1, 2, 4, 7]
    assert r.steps_run == 8
    (fwd,) = r.phase_stats()
    assert fwd.count == 8
    # activations at the forward's peak over all 8 steps: min 10, lower median of the sorted eight 40, max 500
    assert fwd.at("peak", "activations") == (10, 40, 500)
    assert fwd.at("peak", "total") == (110, 140, 600)
    assert fwd.at("peak", "allocator_overhead") is None


def test_statistics_read_between_folds_count_every_step_in_order():
    # Steps wait in a buffer of 64 before their figures join the series: read after 150 steps (two folds and
    # 22 waiting) and again after 40 more, the statistics are those of every step so far, as if each had been
    # added at once. Peaks 1 .. 150 are distinct (more than the 64 a series keeps exactly), then 40 repeats.
    r = Retention()
    peaks = list(range(1, 151))
    for i, p in enumerate(peaks):
        r.add(_step(i, p), peak_step=149)
    (fwd,) = r.phase_stats()
    direct = _Series()
    for p in peaks:
        direct.add(p)
    assert fwd.count == 150
    assert fwd.at("peak", "activations") == direct.stat()
    assert fwd.at("peak", "activations")[::2] == (1, 150)  # min and max exact, whatever the thinning
    more = [7] * 40
    for i, p in enumerate(more, start=150):
        r.add(_step(i, p), peak_step=149)
    for p in more:
        direct.add(p)
    (fwd,) = r.phase_stats()
    assert fwd.count == 190
    assert fwd.at("peak", "activations") == direct.stat()
    assert fwd.at("end", "activations")[::2] == (0, 75)  # ends: peak // 2, from 1 // 2 to 150 // 2


def test_scheduled_steps_stay_in_full_up_to_a_bound():
    r = Retention()
    for i in range(MAX_SELECTED + 50):
        r.add(_step(i, 10), peak_step=0, selected=i >= FIRST_STEPS)
    # Steps 3 .. 305 were selected; the most recent MAX_SELECTED (256) of them, 50 .. 305, stay.
    assert [s.index for s in r.records()] == list(range(FIRST_STEPS)) + list(range(50, MAX_SELECTED + 50))


def test_memory_of_a_million_steps_is_that_of_a_few():
    r = Retention()
    for i in range(20_000):
        r.add(_step(i, 10 + i % 1000), peak_step=0)
    assert len(r.kept) == FIRST_STEPS + 1
    (fwd,) = r.phase_stats()
    assert fwd.count == 20_000 and not fwd.median_exact


# ---------------------------------------------------------------------- the schedule


def test_a_thinned_median_keeps_each_values_share():
    # 1,000 steps at 5 bytes and 65 rare outliers: past 64 distinct values the series is thinned,
    # and the median must stay 5 (each outlier keeps its share, not one slot each).
    series = _Series()
    for _ in range(1000):
        series.add(5)
    for v in range(100, 165):
        series.add(v)
    assert series.stat().median == 5
    # 180 at one size, then 70 distinct larger ones: the true median is still the common size.
    series = _Series()
    for _ in range(180):
        series.add(53_536)
    for i in range(70):
        series.add(60_000 + i)
    assert series.stat().median == 53_536
