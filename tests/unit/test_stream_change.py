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


def test_a_resized_storage_whose_bytes_grow_is_missed_at_its_new_bytes():
    # A storage of 1,000 B (growing 300 B a block) resized to 600 B (growing 200 B a block), beside one of 64 B that
    # does not grow; extended by 2 blocks more on a 512-B allocator. The line through the two larger cuts says
    # r(x) + 2 (r(x) - r(x - d)); the storage is r(x + 2 d) at full depth, here read at the tokens' own sizes
    # (the full depth's). Made: r(1,000) - r(400) - 2 (r(400) - r(100)) = 1,024 - 512 - 2 x 0 = 512 B missed.
    # Resized: r(600) - r(200) - 2 (r(200) - r(0)) = 1,024 - 512 - 2 x 512 = -512 B: the line says 512 B more than
    # the storage holds. Freed: nothing. Before, a resize of a storage that grows stopped the decoding.
    from memprof.collect.simulated import RecordedStream
    from memprof.simulate.depth_stream import _decoded
    from memprof.simulate.stream_tokens import FREE, tokens_of

    recorded = RecordedStream(events=((1, 7, 1000), (2, 8, 64), (3, 7, 600), (4, 7, FREE), (5, 8, FREE)),
                              moments=((0, 1, 2, 3), (0, 3, 4, 5)), peak_seq=2, cats=(2, 3))
    tokens, _ways = tokens_of(recorded)
    made, resized = tokens.index(("a", 1000, 2, False)), next(i for i, t in enumerate(tokens) if t[0] == "r")
    grew = {made: (tokens[made], (300, 0, 0)), resized: (tokens[resized], (300, 0, 200))}
    decoded = _decoded(tokens, 2, grew, 2, 512, {})
    assert [e[2] for e in decoded.events] == [1000, 64, 600, FREE, FREE]
    # Each moment's seq is the last event's before it: the first moment's start and peak after the storages are
    # made (seqs 1 and 2), its end and the second's start after the resize (3), its end after the free (4, none).
    assert decoded.missed == {1: {2: 512}, 2: {2: 512}, 3: {2: -512}}

