"""The matcher that aligns two cuts' allocation streams (:data:`memprof.simulate.stream_change.Matcher`: cydifflib's
compiled ``SequenceMatcher`` where installed) gives difflib's own opcodes, on which the depth extension's answers
rest: where a block's run is inserted, which tokens grew.

The streams it meets are a few hundred distinct tokens repeated thousands of times (every block, every
micro-batch), the next cut the one before with runs inserted and some tokens changed: the case where a matcher's
tie-breaking between equally long matches shows. The sequences here are built that way."""

from __future__ import annotations

import difflib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memprof.simulate import stream_change

cydifflib = pytest.importorskip("cydifflib")


def test_the_matcher_is_cydifflibs_where_installed():
    assert stream_change.Matcher is cydifflib.SequenceMatcher


def _stream(block, blocks, head, tail):
    return [*head, *[(*t, i % 2) for i in range(blocks) for t in block], *tail]


tokens = st.tuples(st.sampled_from("amfr"), st.integers(0, 5))


@settings(max_examples=200, deadline=None)
@given(block=st.lists(tokens, min_size=1, max_size=12), blocks=st.integers(1, 6),
       head=st.lists(tokens, max_size=4), tail=st.lists(tokens, max_size=4),
       edits=st.lists(st.tuples(st.integers(0, 10**6), tokens), max_size=4), by_shape=st.booleans())
def test_its_opcodes_are_difflibs_on_streams_of_repeated_blocks(block, blocks, head, tail, edits, by_shape):
    a = _stream(block, blocks, head, tail)
    b = _stream(block, blocks + 1, head, tail)  # a block more: a run inserted somewhere among equal copies
    for at, token in edits:  # and some tokens changed, inserted or lost
        at %= len(b) + 1
        b[at:at + (token[1] % 2)] = [(*token, 9)]
    if by_shape:  # aligned by their shapes alone: far more ties
        a, b = [t[:1] for t in a], [t[:1] for t in b]
    want = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    assert [tuple(op) for op in stream_change.Matcher(None, a, b, autojunk=False).get_opcodes()] == want


def test_its_opcodes_are_difflibs_on_long_streams_with_popular_tokens():
    # 40 blocks of 60 tokens from an alphabet of 12 (each token about 200 times: difflib's autojunk would call
    # them popular, and memprof turns it off), the next cut one block longer with a token changed in every fifth.
    block = [("m" if i % 3 else "f", i % 12) for i in range(60)]
    a = [(*t, k % 4) for k in range(40) for t in block]
    b = [(*t, k % 4) if k % 5 or i != 7 else ("r", 0, 0) for k in range(41) for i, t in enumerate(block)]
    want = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    assert [tuple(op) for op in stream_change.Matcher(None, a, b, autojunk=False).get_opcodes()] == want
    assert any(op[0] == "insert" for op in want) and any(op[0] == "replace" for op in want), want
