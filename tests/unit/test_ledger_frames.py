"""Module frames that end out of order (backward): a frame removed from beneath keeps what the frames above
it saw, since they opened after it and were still open."""

from __future__ import annotations

import gc

import torch

from memprof.collect.ledger import TEMPORARIES, Ledger


def test_a_frame_removed_from_beneath_keeps_the_high_of_the_frames_above_it():
    led = Ledger()
    parent = led.push_frame(1, backward=True)
    child = led.push_frame(2, backward=True)
    t = torch.empty(100)  # 400 bytes while both are open: only the innermost (child) tracks it
    led.add(t.untyped_storage(), TEMPORARIES)
    del t
    gc.collect()
    assert (child.max, parent.max) == (400, 0)
    assert led.remove_frame(parent)  # the parent's backward ends first
    assert parent.max == 400 and child.max == 400 and led.frames == [child] and led.top is child


def test_a_frame_removed_from_the_top_hands_its_high_to_the_one_beneath():
    led = Ledger()
    outer = led.push_frame(1, backward=True)
    inner = led.push_frame(2, backward=True)
    t = torch.empty(50)  # 200 bytes
    led.add(t.untyped_storage(), TEMPORARIES)
    assert led.remove_frame(inner)
    assert (inner.max, outer.max, led.top) == (200, 200, outer)
    del t
