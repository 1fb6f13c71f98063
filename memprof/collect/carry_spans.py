"""Which steps' optimizer phases were measured and which carried, as spans of steps: the record's
:attr:`memprof.record.trace.Trace.optimizer_steps` and the one note that says what was carried."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..record.trace import OPTIMIZER_STEP_KINDS as KINDS

if TYPE_CHECKING:
    from .aliases import Row

__all__ = ["StepSpans", "MEASURED", "CARRIED", "PARTLY", "UNVERIFIED", "NOT_MEASURED", "KINDS", "MAX_SPANS"]

#: What a step's optimizer phase was: measured op by op, carried from a measured step, carried and found
#: changed afterwards (an upper bound), or cut short by an error while carried (temporaries not measured).
#: "partly carried": a step with several optimizer phases, some measured and some carried.
MEASURED, CARRIED, PARTLY, UNVERIFIED, NOT_MEASURED = KINDS
#: Spans of steps the record keeps at most (the first ones): a run that alternates forever stays bounded.
MAX_SPANS = 10_000


class StepSpans:
    """The steps by what their optimizer phases were, as ``[first step, last step, kind]`` in the order they
    ran; consecutive steps of one kind make one span, and a step of several phases is what they make together."""

    def __init__(self) -> None:
        self.spans: "list[Row]" = []
        self.truncated = False  # MAX_SPANS were kept: later steps are not

    def add(self, step: int, kind: str) -> None:
        """Step ``step``'s optimizer phase (one of several, maybe) was ``kind``."""
        spans = self.spans
        if spans and spans[-1][1] == step:
            # Another optimizer phase of the same step: the step is what the two make together.
            last = spans[-1]
            merged = _mixed(last[2], kind)
            if merged == last[2]:
                return
            if last[0] == step:
                last[2] = merged
            else:
                last[1] = step - 1
                spans.append([step, step, merged])
            if len(spans) >= 2 and spans[-2][2] == merged and spans[-2][1] == step - 1:
                spans[-2][1] = step
                spans.pop()
            return
        if spans and spans[-1][2] == kind and spans[-1][1] == step - 1:
            spans[-1][1] = step
            return
        if len(spans) >= MAX_SPANS:
            self.truncated = True
            return
        spans.append([step, step, kind])

    def record(self) -> tuple[tuple[int, int, str], ...]:
        """The spans of steps by what their optimizer phases were, for the Trace."""
        return tuple((a, b, k) for a, b, k in self.spans)

    def notes(self) -> list[str]:
        """The one note that says which steps' optimizer phases were carried (none when none was)."""
        if not any(k != MEASURED for _, _, k in self.spans):
            return []
        said = []
        for kind in KINDS:
            runs = [f"{a}" if a == b else f"{a}-{b}" for a, b, k in self.spans if k == kind]
            if runs:
                where = " and ".join(runs) if len(runs) == 2 else ", ".join(runs)
                said.append(f"{kind} at step{'s' if len(runs) > 1 or '-' in runs[0] else ''} {where}")
        more = f" (the first {MAX_SPANS:,} stretches)" if self.truncated else ""
        return [f"optimizer step {', '.join(said)}{more}: a carried step ran without memprof's dispatch mode and "
                "its figures are those of the measured step of the same optimizer with the same settings, tensors "
                "and state (carry_optimizer_steps=False measures every step)"]


def _mixed(a: str, b: str) -> str:
    """Two optimizer phases of one step: one measured and one carried make it partly carried; otherwise the
    less certain of the two says what the step was."""
    if a == b:
        return a
    if {a, b} == {CARRIED, MEASURED}:
        return PARTLY
    order = (CARRIED, MEASURED, PARTLY, UNVERIFIED, NOT_MEASURED)
    return max(a, b, key=order.index)
