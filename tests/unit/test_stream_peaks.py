"""memprof.simulate.stream_peaks' walks of an extended stream: each phase's first moment of its largest total, and
the composition there as the ledger keeps a phase's peak (memprof.collect.moves: a storage made in the phase before
the peak and moved later in it with ``retro`` counts in the category it moved to; a move without it does not; one
after the phase has ended does not), and at each moment's marker. The whole path, against whole simulations:
tests/integration/test_depth_pipeline_stream.py."""

from __future__ import annotations

import pytest

from memprof.collect.simulated import RecordedStream
from memprof.simulate.depth_stream import Extension
from memprof.simulate.stream_peaks import _Walk
from memprof.vocabulary import TENSOR_CATEGORIES, Category

FREE = -1
TEMP, ACT, COMM, OPT = (TENSOR_CATEGORIES.index(c) for c in (Category.TEMPORARIES, Category.ACTIVATIONS,
                                                          Category.COMMUNICATION, Category.OPTIMIZER_STATES))
# One phase, seqs (0, 4], its peak marker after event 3 and its end after event 4.
SPAN = (0, 3, 4)
EVENTS = ((1, 1, 100), (2, 2, 50), (3, 3, 30), (4, 1, FREE))  # live: 100, 150, 180 (the peak), 80


def _walk(k3_retro: int) -> _Walk:
    side = [("m", 0, 0, 0, 0),           # the phase's start
            ("v", 2, 2, ACT, 1),         # storage 2 saved for backward before the peak
            ("m", 3, 0, 1, 0),           # the peak's marker, right after event 3
            ("v", 3, 3, COMM, k3_retro),  # storage 3 found to be a collective's buffer after the peak
            ("m", 4, 0, 2, 0),           # the phase's end
            ("v", 4, 2, OPT, 1)]         # after the phase: never the phase's peak's
    return _Walk(RecordedStream(EVENTS, ((0, *SPAN),), 3), Extension({}, [TEMP, TEMP, TEMP], side), 1)


def _counts(**by: int) -> tuple[int, ...]:
    out = [0] * len(TENSOR_CATEGORIES)
    for name, n in by.items():
        out[{"temp": TEMP, "act": ACT, "comm": COMM, "opt": OPT}[name]] = n
    return tuple(out)


def test_the_first_event_of_the_largest_total():
    assert _walk(1).highest([SPAN]) == {SPAN: (3, 180)}
    # A span without events keeps its peak seq, below any total.
    assert _walk(1).highest([(4, 4, 4)]) == {(4, 4, 4): (4, -1)}


@pytest.mark.parametrize("retro, peak", [
    # Storage 3 (30 B) moved to communication after the peak, in the phase: with retro the peak counts it there.
    (1, _counts(temp=100, act=50, comm=30)),
    (0, _counts(temp=130, act=50)),
])
def test_a_retroactive_move_in_the_phase_reaches_its_peak(retro, peak):
    markers, peaks = _walk(retro).compositions({SPAN: {3}})
    assert peaks == {(SPAN, 3): peak}
    assert markers[0] == {_counts()}
    assert markers[3] == {_counts(temp=130, act=50)}  # the marker itself comes before the move
    # 80 B at the end (storage 1 freed); storage 2 moves to optimizer states after it.
    assert markers[4] == {_counts(act=50, comm=30)}  # a move counts at the markers after it, retro or not


def test_a_storage_in_no_known_category_leaves_the_composition_unknown():
    walk = _Walk(RecordedStream(EVENTS, ((0, *SPAN),), 3),
                 Extension({}, [TEMP, -1, TEMP], [("m", 3, 0, 1, 0)]), 1)
    markers, peaks = walk.compositions({SPAN: {3}})
    assert peaks == {} and markers == {}


def test_categories_that_do_not_pair_up_with_the_storages_are_said():
    walk = _Walk(RecordedStream(EVENTS, ((0, *SPAN),), 3), Extension({}, [TEMP], []), 1)
    assert walk.compositions({SPAN: {3}}) == "the extended stream's categories do not pair up with its storages"
