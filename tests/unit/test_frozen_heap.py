"""A simulation freezes the heap it found for its garbage collections, and gives it back however it ends."""

from __future__ import annotations

import gc

import pytest

from memprof.simulate.frozen_heap import frozen


def test_the_objects_there_before_are_frozen_inside_and_given_back_after_an_error():
    assert gc.get_freeze_count() == 0
    with pytest.raises(KeyboardInterrupt):
        with frozen():
            inside = gc.get_freeze_count()
            assert inside > 0
            raise KeyboardInterrupt
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_by_the_user_or_a_collector_turned_off_is_left_as_it_is():
    gc.freeze()
    try:
        theirs = gc.get_freeze_count()
        with frozen():
            assert gc.get_freeze_count() == theirs
        assert gc.get_freeze_count() == theirs  # not unfrozen for them
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with frozen():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
