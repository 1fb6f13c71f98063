import math

import pytest

from memprof import format_bytes, parse_size
from memprof.errors import SizeParseError


@pytest.mark.parametrize("text,expected", [
    ("2 GiB", 2 * 2**30),
    ("512MB", 512 * 10**6),
    ("1.5 KiB", 1536),
    ("4096", 4096),
    ("1e9 B", 10**9),
    ("3 gb", 3 * 10**9),
    (" 7mib ", 7 * 2**20),
    (1024, 1024),
    (0, 0),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "2 GiBs", "-1 GiB", "1,5 GiB", "2 gigs", -5, math.nan, math.inf, True, None])
def test_parse_size_refuses_with_the_value_quoted(bad):
    with pytest.raises(SizeParseError) as info:
        parse_size(bad)
    assert repr(bad) in str(info.value) or str(bad) in str(info.value)


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"
    assert format_bytes(-2048) == "-2.0 KiB"
    assert format_bytes(None) == "not measured"
