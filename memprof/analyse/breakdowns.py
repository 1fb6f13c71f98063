"""The breakdown at one moment of one phase of one step: what :meth:`memprof.Report.breakdown` reads."""

from __future__ import annotations

from ..errors import InvalidArgumentError, NotMeasuredError
from ..record.trace import Breakdown, Trace
from ..vocabulary import PHASE_MOMENTS, Phase, parse_moment

__all__ = ["phase_breakdown"]


def phase_breakdown(trace: Trace, step: int, phase: "Phase | str", at: str = "peak", *,
                    occurrence: "int | None" = None) -> Breakdown:
    """Composition at the ``"peak"``, ``"start"`` or ``"end"`` of a phase of a step.

    Steps count from 0 (negative indices count from the last step). With gradient accumulation a step
    holds several phases of one kind: ``occurrence`` picks one (from 0); by default ``"peak"`` is the
    highest of them, ``"start"`` the first one's start and ``"end"`` the last one's end. A step the run
    did not keep in full, or a phase it did not have, is a NotMeasuredError that says what was kept.
    """
    phase = Phase.parse(phase)
    at = parse_moment(at, PHASE_MOMENTS)
    steps = trace.steps
    if not steps:
        raise NotMeasuredError("no step was recorded; run a forward/backward inside the profile")
    if not isinstance(step, int) or isinstance(step, bool):
        raise InvalidArgumentError(f"step must be an int, got {type(step).__name__}")
    total = trace.num_steps
    if not -total <= step < total:
        raise InvalidArgumentError(f"step {step} is out of range: this run had {total} step(s)")
    index = step + total if step < 0 else step
    record = next((s for s in steps if s.index == index), None)
    if record is None:
        kept = ", ".join(str(s.index) for s in steps[:8]) + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")
        every = "every recorded step" if trace.schedule is not None else "every step"
        raise NotMeasuredError(
            f"step {index} is not kept in full (kept: {kept}); report.phase_stats() summarises {every}, "
            "and memprof.schedule() selects steps to keep")
    matches = [p for p in record.phases if p.phase is phase]
    if occurrence is not None and (isinstance(occurrence, bool) or not isinstance(occurrence, int)):
        raise InvalidArgumentError(f"occurrence must be an int (0 for the first {phase.value} of the step), "
                                   f"got {occurrence!r}")
    if occurrence is not None:
        matches = [p for p in matches if p.occurrence == occurrence]
    if not matches:
        present = ", ".join(f"{p.phase.value}#{p.occurrence}" for p in record.phases) or "none"
        raise NotMeasuredError(f"step {record.index} has no {phase.value} phase (phases: {present})")
    if at == "start":
        return matches[0].start
    if at == "end":
        return matches[-1].end
    return max(matches, key=lambda p: -1 if p.peak.total is None else p.peak.total).peak
