"""What a reconciliation's parts share: a named :class:`Cause` of a gap, and the :class:`Context` every cause
function reads (one moment of one run, both sides of the comparison).

Its own module so that the formula, the causes and the sharding rules import it and not each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ...record.aliases import UserObject
from ...record.trace import Breakdown, PhaseRecord, Trace
from ...units import format_bytes
from ...vocabulary import Category, Phase

if TYPE_CHECKING:
    from ...anatomy.predict import ActivationPrediction

__all__ = ["Cause", "Context", "forward_before"]


@dataclass(frozen=True)
class Cause:
    """One named reason for part of a gap: bytes (signed, as they add to measured − formula) and a sentence."""

    category: Category
    name: str
    bytes: int
    sentence: str

    def __str__(self) -> str:
        sign = "+" if self.bytes >= 0 else "-"
        return f"{self.category.value}: {self.name} {sign}{format_bytes(abs(self.bytes))}: {self.sentence}"


@dataclass(frozen=True)
class Context:
    """What every cause function reads: one moment of one run, both sides of the comparison."""

    trace: Trace
    measured: Breakdown
    rec: "PhaseRecord | None"
    tags: dict[str, int]
    formula: Breakdown
    precision: str
    optimizer: "str | None"
    transformer: "Mapping[str, UserObject] | None"
    activations: "ActivationPrediction"

    @property
    def phase(self) -> "Phase | None":
        return self.rec.phase if self.rec is not None else None

    @property
    def forward(self) -> "PhaseRecord | None":
        """In backward, the forward this backward follows (its end is what backward releases from)."""
        if self.phase is Phase.BACKWARD and self.rec is not None:
            return forward_before(self.trace, self.rec)
        return None

    @property
    def activation_tags(self) -> dict[str, int]:
        """The tags' bytes the activation causes read: in backward, at the end of the forward it
        follows (a tensor backward already released is "released by backward", not theirs)."""
        fwd = self.forward
        return dict(fwd.tags_end) if fwd is not None else self.tags

    def both(self, cat: Category) -> bool:
        return self.measured[cat] is not None and self.formula[cat] is not None

    def pair(self, cat: Category) -> "tuple[int, int] | None":
        """``cat``'s measured and formula bytes, or None where either is not known (where :meth:`both` is
        False): what a cause compares, typed as known."""
        m, f = self.measured[cat], self.formula[cat]
        return None if m is None or f is None else (m, f)


def forward_before(trace: Trace, rec: PhaseRecord) -> "PhaseRecord | None":
    """The forward that a backward record follows: the last forward of its step before it
    (a forward after it, such as a no_grad evaluation before optimizer.step(), is not it)."""
    phases = trace.phases
    at = next((i for i, p in enumerate(phases) if p is rec), len(phases))
    return next((p for p in reversed(phases[:at]) if p.phase is Phase.FORWARD and p.step == rec.step), None)
