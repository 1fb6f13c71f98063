"""A simulated rank's record, made from the replica's: what :class:`memprof.simulate.ranks.LayoutPlan` plays on the
run (the shards, the gathers, the collective buffers) is in the replica's figures already, but for the optimizer
step, which the replica runs on whole parameters: its peak is taken on the rank's shards here, and the run's peak,
its tags and the per-phase statistics follow the records. DeepSpeed's ZeRO-1/2 buckets are not estimated: their
ranks' communication is not measured (None), never 0.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from ..record.parts import Breakdown
from ..record.stats import series_from
from ..vocabulary import Category, Phase

if TYPE_CHECKING:
    from fractions import Fraction

    from ..record.parts import PhaseRecord, StepRecord
    from ..record.stats import PhaseStats, Stat
    from ..record.trace import Trace

__all__ = ["rank_records"]

O, T = Category.OPTIMIZER_STATES, Category.TEMPORARIES


def rank_records(trace: "Trace", share: "Fraction | None", buckets: bool) -> "Trace":
    """``trace`` (the replica's) with each optimizer step's peak on the rank's ``share`` of the state (None: the
    layout shards no state), communication not measured with ``buckets``, the run's peak again (its record's
    tags; no module where it moved to another phase) and the per-phase statistics of the records."""
    steps = []
    best: "PhaseRecord | None" = None
    for step in trace.steps:
        phases = []
        for rec in step.phases:
            if buckets:  # DeepSpeed's buckets: not estimated, not 0
                start, peak, end = (_without_communication(b) for b in (rec.start, rec.peak, rec.end))
                rec = dataclasses.replace(rec, start=start, peak=peak, end=end)
            if rec.phase is Phase.OPTIMIZER and share is not None:
                rec = dataclasses.replace(rec, peak=_step_peak(rec, share))
            phases.append(rec)
            if best is None or (rec.peak.total or 0) > (best.peak.total or 0):
                best = rec
        steps.append(dataclasses.replace(step, phases=tuple(phases)))
    out = dataclasses.replace(trace, steps=tuple(steps), phase_stats=_rank_stats(trace.phase_stats, steps, buckets))
    if best is None:
        return out
    # The tags live at the run's peak are its record's: the replica's were another moment's where the rank's peak
    # is another phase's (the replica's optimizer step holds every state whole), and said no autocast cast was live
    # at a ZeRO-2 rank's forward peak that holds 3 MiB of them. The module at such a peak is not known.
    moved = (best.step, best.phase) != (trace.peak_step, trace.peak_phase)
    return dataclasses.replace(out, peak=best.peak, peak_step=best.step, peak_phase=best.phase,
                               peak_tags=best.tags_peak, peak_module=None if moved else out.peak_module)


def _step_peak(rec: "PhaseRecord", share: "Fraction") -> Breakdown:
    """An optimizer step's peak on the rank's shards."""
    v = {c: rec.peak[c] for c in Category}
    # The state made inside the step was the whole model's until the step's end resized it.
    if (states := v[O]) is not None and (states_end := rec.end[O]) is not None:
        v[O] = min(states, states_end)
    if (temporaries := v[T]) is not None:
        # The step's own temporaries are the rank's share; what was held when it began (the loop's loss) is held
        # whole.
        held = min(rec.start[T] or 0, temporaries)
        v[T] = held + int((temporaries - held) * share)
    return Breakdown.from_mapping(v)


def _rank_stats(stats: "Sequence[PhaseStats]", steps: "Sequence[StepRecord]", buckets: bool
                ) -> "tuple[PhaseStats, ...]":
    """The per-phase statistics of the rank's records: each phase's made again from its records where the run kept
    every step's, and with ``buckets`` (ZeRO-1/2: DeepSpeed's buckets, not estimated) communication not measured,
    as in the records."""
    out = []
    for st in stats:
        if buckets:
            st = dataclasses.replace(st, peak=_series_without_communication(st.peak),
                                     end=_series_without_communication(st.end))
        records = [rec for step in steps for rec in step.phases if (rec.phase, rec.occurrence) == (st.phase,
                                                                                                    st.occurrence)]
        if len(records) == st.count:
            peak, end = series_from(st.peak, [r.peak for r in records]), series_from(st.end, [r.end for r in records])
            if peak is not None and end is not None:
                st = dataclasses.replace(st, peak=peak, end=end)
        out.append(st)
    return tuple(out)


def _series_without_communication(series: "tuple[tuple[str, Stat | None], ...]"
                                  ) -> "tuple[tuple[str, Stat | None], ...]":
    return tuple((key, None if key == Category.COMMUNICATION.value else stat) for key, stat in series)


def _without_communication(b: Breakdown) -> Breakdown:
    return Breakdown.from_mapping({**{c: b[c] for c in Category}, Category.COMMUNICATION: None})
