"""Byte sizes at the edges: formatting for people, parsing what people type.

Inside memprof every size is an ``int`` of bytes. IEC units (KiB, MiB, GiB,
TiB) are powers of 1024; SI units (kB, MB, GB, TB) are powers of 1000, as
their standards say. ``"2 GiB"`` is 2 * 2**30 bytes and ``"512MB"`` is
512 * 10**6 bytes.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from .errors import InvalidArgumentError, SizeParseError, is_interrupt

__all__ = ["format_bytes", "parse_size", "printable", "one_line", "as_count", "round_half_away"]

_IEC = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")

_UNITS: dict[str, int] = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
    "eib": 2**60,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "eb": 10**18,
}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z]*)\s*$")


def format_bytes(n: int | None, *, precision: int = 1) -> str:
    """Format a byte count with IEC units (``1536`` -> ``"1.5 KiB"``).

    ``None`` (a figure that was not measured) is formatted as ``"not measured"``,
    never as 0. Negative counts (gaps, shrinkage) keep their sign.
    """
    if n is None:
        return "not measured"
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        raise InvalidArgumentError(f"format_bytes() needs a number of bytes, got {type(n).__name__}")
    sign = "-" if n < 0 else ""
    magnitude = abs(int(n))
    if magnitude < 1024:
        return f"{sign}{magnitude} B"
    unit = 0
    while magnitude >= 1024 ** (unit + 1) and unit < len(_IEC) - 1:
        unit += 1
    # Integer division first: a count too large for a float (10**400 from a crafted file) still formats.
    whole, rest = divmod(magnitude, 1024 ** unit)
    value = Decimal(whole) + Decimal(rest) / Decimal(1024 ** unit)
    return f"{sign}{value:.{precision}f} {_IEC[unit]}"


def parse_size(value: int | float | str) -> int:
    """Parse a memory size into bytes.

    Accepts ints (bytes), and strings such as ``"1.5 GiB"``, ``"512MB"``,
    ``"2048"``, ``"1e9 B"``. Unit names are case-insensitive. Raises
    :class:`~memprof.errors.SizeParseError` quoting the value for anything
    else: negative, NaN or infinite sizes, unknown units, booleans.
    """
    if isinstance(value, bool):
        raise SizeParseError(f"size {value!r} is a boolean; give bytes as an int or a string like '2 GiB'")
    if isinstance(value, int):
        if value < 0:
            raise SizeParseError(f"size {value!r} is negative; sizes are byte counts >= 0")
        return _bounded(value, value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise SizeParseError(f"size {value!r} is not a finite number of bytes")
        if value < 0:
            raise SizeParseError(f"size {value!r} is negative; sizes are byte counts >= 0")
        return _bounded(int(round(value)), value)
    if not isinstance(value, str):
        raise SizeParseError(
            f"size {value!r} has type {type(value).__name__}; give an int of bytes or a string like '2 GiB'"
        )
    match = _SIZE_RE.match(value)
    if match is None:
        raise SizeParseError(
            f"cannot parse size {value!r}; write a number and a unit such as '1.5 GiB', '512 MB' or '4096'"
        )
    number, exponent, unit = match.groups()
    key = unit.lower() if unit else "b"
    if key not in _UNITS:
        raise SizeParseError(
            f"unknown unit {unit!r} in size {value!r}; use B, KiB, MiB, GiB, TiB, PiB, EiB (powers of 1024) "
            "or kB, MB, GB, TB, PB, EB (powers of 1000)"
        )
    # Decimal arithmetic: exact for "0.1 GB", and no float overflow for "1e400 B".
    try:
        amount = Decimal(number).scaleb(int(exponent) if exponent else 0) * _UNITS[key]
        if amount > MAX_SIZE:
            raise SizeParseError(f"size {value!r} is too large: memprof sizes stop at 16 EiB (2**64 bytes)")
        return int(amount.to_integral_value())
    except (InvalidOperation, OverflowError, ValueError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise SizeParseError(f"size {value!r} is too large: memprof sizes stop at 16 EiB (2**64 bytes)") from None


#: The largest size memprof accepts from people and files (16 EiB): any real device is far below it.
MAX_SIZE = 2**64


def _bounded(n: int, shown: object) -> int:
    if n > MAX_SIZE:
        raise SizeParseError(f"size {shown!r} is too large: memprof sizes stop at 16 EiB (2**64 bytes)")
    return n


def round_half_away(value: "Fraction | int") -> int:
    """The nearest int, halves away from zero: half up for the sizes formulas give (never negative), and
    symmetric for a signed gap."""
    if value < 0:
        return -int(-value + Fraction(1, 2))
    return int(value + Fraction(1, 2))


def as_count(name: str, value: object, minimum: int = 0) -> int:
    """A count people write (parameters, layers, GPUs) as an int: ints, and floats that are whole
    numbers (``7.5e9`` parameters), are accepted; anything else raises InvalidArgumentError."""
    from .errors import InvalidArgumentError

    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    elif not isinstance(value, bool) and hasattr(value, "__index__"):
        value = value.__index__()  # numpy and torch integer scalars
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(
            f"{name} must be a whole number >= {minimum} (an int, or a float such as 7.5e9), got {value!r}")
    return value


# What a string from a trace (a module's name, a note, an error, a version) must not carry into a
# report: C0 and C1 control characters and DEL (they move the cursor, clear the screen, start a line),
# the line and paragraph separators (a new line in editors and browsers), the bidirectional formatting
# characters (U+061C, U+200E-U+200F, U+202A-U+202E, U+2066-U+2069: they reorder the text that follows,
# so a name can read as something else; Unicode's UAX #9 lists them) and lone surrogates (no encoding
# can write them: printing one raises). Newlines are the renderers' own in a whole output.
_UNSAFE = r"\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_CONTROL = re.compile(f"[{_UNSAFE}]")
_CONTROL_OR_NEWLINE = re.compile(rf"[\n{_UNSAFE}]")


def _escape(match: "re.Match[str]") -> str:
    return ascii(match.group())[1:-1]


def printable(text: str) -> str:
    """``text`` with control, bidirectional-formatting and separator characters and lone surrogates shown
    as escapes (``\\x1b``, ``\\u202e``), so a crafted name prints inert; newlines are kept."""
    return _CONTROL.sub(_escape, text)


def one_line(text: str) -> str:
    """``text`` as :func:`printable` shows it, newlines escaped too (``\\n``): one line of a report, which
    a string from a trace cannot break into two."""
    return _CONTROL_OR_NEWLINE.sub(_escape, text)
