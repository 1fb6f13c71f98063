"""Comparing a simulation with the measured run it predicts, phase by phase (the parallel layouts' tests)."""

from __future__ import annotations

from memprof import Category


def phase_records(trace):
    """A trace's phase records by (step, phase, occurrence)."""
    return {(p.step, p.phase.value, p.occurrence): p for p in trace.phases}


def assert_same_phases(simulated, measured, *where) -> None:
    """The same phases in both traces, and every category equal at each one's peak and end; ``where`` labels a
    failure (a rank, say)."""
    e, m = phase_records(simulated), phase_records(measured)
    assert sorted(e) == sorted(m)
    for key, rec in m.items():
        for moment in ("peak", "end"):
            for cat in Category:
                assert getattr(e[key], moment)[cat] == getattr(rec, moment)[cat], (*where, key, moment, cat.value)


def assert_equal_everywhere(est, rep) -> None:
    """:func:`assert_same_phases`, and the same peak, at the same step and phase."""
    assert_same_phases(est.trace, rep.trace)
    assert (est.peak_bytes, est.trace.peak_step, est.trace.peak_phase) == (rep.peak.total, rep.trace.peak_step,
                                                                          rep.trace.peak_phase)
