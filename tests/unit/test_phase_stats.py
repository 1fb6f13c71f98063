"""Per-phase statistics (memprof.record.stats, gathered by memprof.collect.retention): one summary per (phase,
occurrence) over every step, with the exact count, min, median and max of each category at the phase's peak
and end, and the figures a run did not measure left as not measured."""

from __future__ import annotations

from memprof import Phase
from memprof.collect.retention import Retention
from memprof.record.trace import StepRecord

from factories import cpu, phase


def _step(index: int, peak: int) -> StepRecord:
    return StepRecord(index, (phase(index, "forward", start=cpu(weights=100), peak=cpu(weights=100, activations=peak),
                                    end=cpu(weights=100, activations=peak // 2)),))


def test_phase_stats_of_two_kinds_of_phase_are_kept_apart():
    r = Retention()
    for i in range(4):
        rec = StepRecord(i, (
            phase(i, "forward", start=cpu(), peak=cpu(activations=100), end=cpu(activations=50)),
            phase(i, "forward", occurrence=1, start=cpu(), peak=cpu(activations=300), end=cpu()),
        ))
        r.add(rec, peak_step=0)
    stats = {(s.phase, s.occurrence): s for s in r.phase_stats()}
    assert stats[(Phase.FORWARD, 0)].at("end", "activations") == (50, 50, 50)
    assert stats[(Phase.FORWARD, 1)].at("peak", "activations") == (300, 300, 300)
