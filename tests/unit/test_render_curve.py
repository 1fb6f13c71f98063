"""The memory curve (memprof.render.curve) every time-axis renderer draws: each recorded moment of a
hand-built trace in time order, with the clock or, for a file without one, a millisecond per phase."""

from __future__ import annotations

from memprof import Phase
from memprof.render.curve import curve, level, phase_times

from factories import bd, full_trace, timed_trace

F, B = Phase.FORWARD, Phase.BACKWARD


def test_a_timed_trace_is_its_phase_moments_and_module_boundaries_in_time_order():
    cv = curve(timed_trace())
    assert cv.timed
    # (time in us, step, phase, kind, module, total): the forward starts at 144 + 96 = 240 B, fc enters at
    # 10 us, the forward peaks at 40 us (320 B), fc exits at 45 us (288 B); at 50 us the backward's start is
    # drawn before the forward's end (same time: a start sorts first); the backward peaks at 70 us (432 B).
    assert [(p.time_us, p.step, p.phase, p.kind, p.module, p.breakdown.total) for p in cv.points] == [
        (0.0, 0, F, "start", None, 240), (10.0, 0, F, "enter", "fc", 240), (40.0, 0, F, "peak", None, 320),
        (45.0, 0, F, "exit", "fc", 288), (50.0, 0, B, "start", None, 288), (50.0, 0, F, "end", None, 288),
        (70.0, 0, B, "peak", None, 432), (100.0, 0, B, "end", None, 384)]


def test_a_trace_without_a_clock_gives_each_phase_a_millisecond_and_leaves_samples_out():
    t = full_trace()
    assert [(p.phase.value, s, k, e) for p, s, k, e in phase_times(t)] == [
        ("forward", 0.0, 500.0, 999.0), ("backward", 1000.0, 1500.0, 1999.0), ("optimizer", 2000.0, 2500.0, 2999.0)]
    cv = curve(t)
    assert not cv.timed
    assert len(cv.points) == 9  # start, peak and end of three phases; the one sample has no time
    assert [p.kind for p in cv.points[:3]] == ["start", "peak", "end"]


def test_a_moments_height_is_what_was_measured_of_it():
    # Light mode on CPU measures no total: the height is the sum of what it did measure, 4096 + 2048.
    assert level(bd(None, weights=4096, activations=2048)) == 6144
    assert level(bd(weights=4096, activations=2048, temporaries=8)) == 6152
