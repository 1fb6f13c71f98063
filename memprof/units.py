"""Byte sizes at the edges: formatting for people, parsing what people type.

Inside memprof every size is an ``int`` of bytes. IEC units (KiB, MiB, GiB,
TiB) are powers of 1024; SI units (kB, MB, GB, TB) are powers of 1000, as
their standards say. ``"2 GiB"`` is 2 * 2**30 bytes and ``"512MB"`` is
512 * 10**6 bytes.
"""

from __future__ import annotations

import math
import re

from .errors import SizeParseError

__all__ = ["format_bytes", "parse_size"]

_IEC = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

_UNITS: dict[str, int] = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z]*)\s*$")


def format_bytes(n: int | None, *, precision: int = 1) -> str:
    """Format a byte count with IEC units (``1536`` -> ``"1.5 KiB"``).

    ``None`` (a figure that was not measured) is formatted as ``"not measured"``,
    never as 0. Negative counts (gaps, shrinkage) keep their sign.
    """
    if n is None:
        return "not measured"
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    unit = 0
    while value >= 1024 and unit < len(_IEC) - 1:
        value /= 1024
        unit += 1
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
        return value
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise SizeParseError(f"size {value!r} is not a finite number of bytes")
        if value < 0:
            raise SizeParseError(f"size {value!r} is negative; sizes are byte counts >= 0")
        return int(round(value))
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
            f"unknown unit {unit!r} in size {value!r}; use B, KiB, MiB, GiB, TiB (powers of 1024) "
            "or kB, MB, GB, TB (powers of 1000)"
        )
    amount = float(number) * (10 ** int(exponent) if exponent else 1)
    if math.isinf(amount):
        raise SizeParseError(f"size {value!r} is too large")
    return int(round(amount * _UNITS[key]))
