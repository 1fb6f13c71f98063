"""The record of a generation's cache around each prefill and decode phase: what the cache formulas need to
say what the cache held at the phase's peak and end (part of :class:`memprof.record.parts.GenerationFacts`).

The formulas count bytes from the model's config; from the run they need only token counts and, for a
moment inside a call, how far the call had got: how many of the storages it put in the cache existed at
its peak (a count, never their bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .checks import corrupt, count, text
from .aliases import JSON, Setting

__all__ = ["CacheMoment", "MOMENTS", "spec_data", "frozen_spec"]

#: The moments of a phase a :class:`CacheMoment` describes.
MOMENTS = ("peak", "end")


@dataclass(frozen=True)
class CacheMoment:
    """The cache at the peak or the end of one prefill or decode phase (or of the loop's phase after one).

    ``earlier``, ``before`` and ``after``: the tokens in the cache when the call before this one began,
    when this one began, and when it ended (the call is the phase's last for ``"end"``, the one that
    reached the phase's peak for ``"peak"``: phases of more than one call are folded decode calls).
    ``written`` (peaks only): the storages that call had put in the cache by its peak, and ``overlap``:
    whether the peak was the making of the last of them, while the storage it replaces still lived.
    ``written`` is None where memprof could not see storages being made (light mode).

    For a phase between or after the calls (``"other"``) the tokens are the last call's, and ``written`` says
    whether that call's cache object was still held at the moment (1) or had been let go (0).
    """

    step: int
    phase: str
    occurrence: int
    moment: str
    earlier: int
    before: int
    after: int
    written: "int | None" = None
    overlap: bool = False

    def key(self) -> tuple[int, str, int, str]:
        return (self.step, self.phase, self.occurrence, self.moment)

    # Written by hand, not from its fields (record/fields.py): a positional list of 9 values in the file, its
    # moment one of MOMENTS.
    def to_list(self) -> list[JSON]:
        return [self.step, self.phase, self.occurrence, self.moment, self.earlier, self.before, self.after,
                self.written, self.overlap]

    @classmethod
    def from_list(cls, data: object) -> "CacheMoment":
        if not isinstance(data, (list, tuple)) or len(data) != 9:
            raise corrupt(f"a cache moment must be a list of 9 values, got {str(data)[:40]}")
        step, phase, occurrence, moment, earlier, before, after, written, overlap = data
        if text(moment, "a cache moment") not in MOMENTS:
            raise corrupt(f"a cache moment must be one of {MOMENTS}, got {moment!r}")
        if not isinstance(overlap, bool):
            raise corrupt(f"a cache moment's overlap must be true or false, got {overlap!r}")
        earlier, before, after = (count(v, "a token count") for v in (earlier, before, after))
        return cls(count(step, "a step"), text(phase, "a phase"), count(occurrence, "an occurrence"), moment,
                   earlier, before, after, written=None if written is None else count(written, "a written count"),
                   overlap=overlap)


def spec_data(data: object) -> "dict[str, Setting] | None":
    """A cache spec read from a file (``memprof.anatomy.CacheSpec.to_dict()``): a mapping of names to ints,
    strings, booleans, None or lists of strings, checked here; the formulas check the values' sense."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise corrupt(f"a generation's cache must be a mapping, got {type(data).__name__}")
    out: dict[str, Setting] = {}
    for k, v in data.items():
        name = text(k, "a cache field")
        if isinstance(v, list):
            v = [text(x, f"a value of {name}") for x in v]
        elif isinstance(v, str):
            v = text(v, name)  # a lone surrogate replaced, as in every string a file gives
        elif isinstance(v, int) and not isinstance(v, bool):
            v = count(v, name)
        elif not (v is None or isinstance(v, (str, bool))):
            raise corrupt(f"the cache field {name} must be a number, string, boolean or list, got {str(v)[:40]}")
        out[name] = v
    return out


def frozen_spec(data: "Mapping[str, Setting] | None") -> "tuple[tuple[str, Setting], ...] | None":
    """A cache spec as the frozen record keeps it: (name, value) pairs, lists as tuples."""
    if data is None:
        return None
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in data.items())
