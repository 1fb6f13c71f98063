"""Values read from a trace file, checked one by one: a bad value is a TraceFormatError naming it.

Every check ends its message with the fix (re-create the trace), so a corrupt,
crafted or truncated file never reaches arithmetic or display downstream.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Hashable, Iterable, Mapping, Sequence, TypeVar

from ..errors import TraceFormatError

__all__ = ["MAX_COUNT", "count", "optional_count", "text", "optional_text", "corrupt", "pairs", "seq", "mapping",
           "flag", "member", "listed_once"]

# The largest count a trace may hold: an int64 (8 EiB, or as many ops), as torch's sizes and the
# DataFrames' Int64 columns are. A real run is far below it; a crafted 2**64 or 10**400 would otherwise
# load and break arithmetic, frames and display downstream.
MAX_COUNT = 2**63 - 1


def optional_count(value: object, name: str) -> "int | None":
    if value is None:
        return None
    return count(value, name)


def count(value: object, name: str) -> int:
    """A non-negative int from a file (bytes, an index, a count); anything else is a TraceFormatError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise corrupt(f"{name} must be an int, got {_shown(value)}")
    if not 0 <= value <= MAX_COUNT:
        raise corrupt(f"{name} must be between 0 and 2**63 - 1, got {_shown(value)}")
    return value


def optional_time(value: object, name: str) -> "float | None":
    """Microseconds since a profile started (schema 4), or None (older files, or not recorded)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e15:
        raise corrupt(f"{name} must be a number of microseconds between 0 and 1e15, got {_shown(value)}")
    return float(value)


# Half of a UTF-16 surrogate pair on its own: valid in JSON (written "\ud800") and in a Python str, but no
# encoding can write it, so printing or saving it would raise UnicodeEncodeError.
_SURROGATE = re.compile("[\ud800-\udfff]")


def text(value: object, name: str) -> str:
    """A string from a file, with any lone surrogate replaced by U+FFFD (the replacement character)."""
    if not isinstance(value, str):
        raise corrupt(f"{name} must be a string, got {_shown(value)}")
    return value if value.isascii() else _SURROGATE.sub("\ufffd", value)


E = TypeVar("E", bound=Enum)


def member(value: object, kind: "type[E]", name: str) -> E:
    """The member of the enum ``kind`` (Phase, Category) whose value a file gives, exactly as memprof
    writes it: " Forward" is no phase a file holds."""
    for m in kind:
        if m.value == value and isinstance(value, str):
            return m
    raise corrupt(f"{name} must be one of {', '.join(m.value for m in kind)}, got {_shown(value)}")


def seq(value: object, name: str, length: "int | None" = None) -> Sequence[object]:
    """A JSON array from a file (of exactly ``length`` items, if given). A string is refused too:
    iterated or unpacked, ``"abc"`` would pass for three items."""
    if not isinstance(value, (list, tuple)):
        raise corrupt(f"{name} must be a list, got {_shown(value)}")
    if length is not None and len(value) != length:
        raise corrupt(f"{name} must be a list of {length} values, got {_shown(value)}")
    return value


def mapping(value: object, name: str) -> Mapping[str, object]:
    """A JSON object from a file."""
    if not isinstance(value, Mapping):
        raise corrupt(f"{name} must be a mapping, got {_shown(value)}")
    return value


def flag(value: object, name: str) -> bool:
    """A JSON true or false from a file (a string such as "no" would otherwise read as True)."""
    if not isinstance(value, bool):
        raise corrupt(f"{name} must be true or false, got {_shown(value)}")
    return value


def corrupt(problem: str) -> TraceFormatError:
    """The error for a bad value, with the fix."""
    return TraceFormatError(f"corrupt memprof trace: {problem}; re-create it with report.save(path)")


def _shown(value: object) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def optional_text(value: object, name: str) -> "str | None":
    return None if value is None else text(value, name)


def pairs(items: object, name: str = "tags") -> tuple[tuple[str, int], ...]:
    """(name, bytes) pairs, such as the tags' live bytes: each name once."""
    out = tuple((text(a, "a tag name"), count(b, "a tag's bytes"))
                for a, b in (seq(item, f"an entry of {name}", 2) for item in seq(items, name)))
    listed_once((a for a, _ in out), f"a name in {name}")
    return out


def listed_once(keys: Iterable[Hashable], what: str) -> None:
    """Refuse a key that a list from a file gives twice (a module's path, a tag's name): two records of one
    thing, whose figures would be counted twice or one of them silently dropped downstream. ``what`` names
    the key ("a module")."""
    seen: set[Hashable] = set()
    for key in keys:
        if key in seen:
            raise corrupt(f"{what} is listed twice: {_shown(key)}")
        seen.add(key)
