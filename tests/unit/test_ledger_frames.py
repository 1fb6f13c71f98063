"""Module frames that end out of order (backward): a frame removed from beneath keeps what the frames above
it saw, since they opened after it and were still open."""

from __future__ import annotations

import gc

import torch

from memprof.collect.ledger import TEMPORARIES, Ledger
from memprof.collect.frame_stack import push_frame, remove_frame


def test_a_frame_removed_from_beneath_keeps_the_high_of_the_frames_above_it():
    led = Ledger()
    parent = push_frame(led, 1, backward=True)
    child = push_frame(led, 2, backward=True)
    t = torch.empty(100)  # 400 bytes while both are open: only the innermost (child) tracks it
    led.add(t.untyped_storage(), TEMPORARIES)
    del t
    gc.collect()
    assert (child.max, parent.max) == (400, 0)
    assert remove_frame(led, parent)  # the parent's backward ends first
    assert parent.max == 400 and child.max == 400 and led.frames == [child] and led.top is child


def test_a_frame_removed_from_the_top_hands_its_high_to_the_one_beneath():
    led = Ledger()
    outer = push_frame(led, 1, backward=True)
    inner = push_frame(led, 2, backward=True)
    t = torch.empty(50)  # 200 bytes
    led.add(t.untyped_storage(), TEMPORARIES)
    assert remove_frame(led, inner)
    assert (inner.max, outer.max, led.top) == (200, 200, outer)
    del t
