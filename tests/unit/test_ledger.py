"""The ledger on its own: real storages, no model, no hooks. Every figure is numel x element size."""

from __future__ import annotations

import gc

import torch

from memprof import Category as C
from memprof.collect import marks
from memprof.collect.frame_stack import pop_frame, push_frame, push_frame_below, remove_frame
from memprof.collect.moves import move, set_tag
from memprof.collect.ledger import (ACTIVATIONS, GRADIENTS, TAGS, TEMPORARIES, WEIGHTS, Ledger, breakdown,
                                  storage_of, tag_pairs)


def _storage(n: int, dtype=torch.float32):
    t = torch.empty(n, dtype=dtype)
    return t, t.untyped_storage()


def test_a_storage_counts_once_whatever_views_reach_it():
    led = Ledger()
    t, st = _storage(100)  # 100 fp32 = 400 bytes
    led.add(st, TEMPORARIES)
    led.add(t[10:20].untyped_storage(), TEMPORARIES)  # a view: the same StorageImpl
    led.add(t.view(10, 10).untyped_storage(), WEIGHTS)  # already known: keeps its category
    assert led.totals[TEMPORARIES] == led.total == 400
    assert led.totals[WEIGHTS] == 0


def test_a_freed_storage_leaves_the_totals_and_the_peak_stays():
    led = Ledger()
    a, sa = _storage(100)  # 400 bytes
    b, sb = _storage(50, torch.float64)  # 400 bytes
    led.add(sa, ACTIVATIONS)
    led.add(sb, TEMPORARIES)
    del b, sb
    gc.collect()
    led.settle()  # torch's release is queued where it happens and applied by memprof's hooks
    assert (led.total, led.totals[TEMPORARIES], led.totals[ACTIVATIONS]) == (400, 0, 400)
    assert led.peak_total == 800 and led.peak[TEMPORARIES] == 400 and led.peak[ACTIVATIONS] == 400
    assert len(led.entries) == 1


def test_rounding_counts_each_block_as_the_caching_allocator_does():
    led = Ledger(rounding=512)
    assert [led.size_of(n) for n in (0, 1, 512, 513, 4000)] == [0, 512, 512, 1024, 4096]
    t, st = _storage(1000)  # 4,000 bytes -> 8 blocks of 512 = 4,096
    led.add(st, WEIGHTS)
    assert led.total == 4096


def test_moving_a_storage_keeps_the_total_and_retro_moves_fix_the_peaks():
    led = Ledger()
    led.start_phase()
    g, sg = _storage(25)  # 100 bytes, made as a temporary, later found to be a gradient
    entry = led.add(sg, TEMPORARIES)
    move(led, entry, GRADIENTS)
    assert (led.total, led.totals[GRADIENTS], led.totals[TEMPORARIES]) == (100, 100, 0)
    assert led.phase_peak[TEMPORARIES] == 100  # without retro the peak keeps what it was then
    led2 = Ledger()
    led2.start_phase()
    g2, sg2 = _storage(25)
    e2 = led2.add(sg2, TEMPORARIES)
    move(led2, e2, GRADIENTS, retro=True)
    assert led2.phase_peak[GRADIENTS] == led2.peak[GRADIENTS] == 100
    assert led2.phase_peak[TEMPORARIES] == led2.peak[TEMPORARIES] == 0


def test_a_retro_move_leaves_earlier_phases_alone():
    led = Ledger()
    led.start_phase()
    keep, sk = _storage(100)  # 400 bytes: phase 1's peak
    e = led.add(sk, TEMPORARIES)
    led.start_phase()
    move(led, e, GRADIENTS, retro=True)  # created in phase 1: phase 2 may not rewrite phase 1's peak
    assert led.peak[TEMPORARIES] == 400 and led.peak[GRADIENTS] == 0


def test_resize_changes_the_bytes_in_place():
    led = Ledger()
    t, st = _storage(0)
    entry = led.add(st, TEMPORARIES)
    t.resize_(1000)  # 4,000 bytes in the same StorageImpl
    led.resize(entry, storage_of(t).nbytes())
    assert led.total == led.totals[TEMPORARIES] == led.peak_total == 4000
    del t, st
    gc.collect()
    led.settle()
    assert led.total == 0  # the freed entry takes its new size with it


def test_tags_count_while_their_storage_is_an_activation():
    led = Ledger()
    mask, sm = _storage(64, torch.bool)  # 64 bytes
    entry = led.add(sm, TEMPORARIES)
    tag = TAGS.index("dropout_mask")
    set_tag(led, entry, tag)
    assert led.tag_act[tag] == 0  # a temporary's tag counts for nothing yet
    move(led, entry, ACTIVATIONS)
    assert led.tag_act[tag] == 64
    where = TAGS.index("saved_by_two_modules")
    set_tag(led, entry, where, 16)  # the other kind of tag: both count, each its own bytes
    assert (led.tag_act[tag], led.tag_act[where]) == (64, 16)
    assert tag_pairs(led.tag_act) == (("dropout_mask", 64), ("saved_by_two_modules", 16))
    del mask, sm
    gc.collect()
    led.settle()
    assert tag_pairs(led.tag_act) == ()


def test_what_torch_releases_is_queued_by_c_code_and_applied_in_order_by_settle():
    # A finaliser's exception is dropped by Python, including a signal handler's (Ctrl-C): the weak references'
    # callback is the queue's own append, a builtin that runs no bytecode for a signal to land in.
    led = Ledger()
    assert type(led.queue_release).__name__ == "builtin_function_or_method"
    a, sa = _storage(100)  # 400 bytes
    b, sb = _storage(25)  # 100 bytes
    led.add(sa, ACTIVATIONS)
    entry_b = led.add(sb, TEMPORARIES)
    marks.record_stream(led)
    del a, sa
    gc.collect()
    assert led.total == 500 and len(led.released) == 1  # queued, not yet applied
    c, sc = _storage(10)  # 40 bytes: adding settles first, so a freed storage's address is never taken for it
    led.add(sc, TEMPORARIES)
    assert (led.total, led.totals[ACTIVATIONS], led.totals[TEMPORARIES]) == (140, 0, 140)
    # The stream holds the free before the new storage, in the order torch did them.
    assert [(n if n < 0 else "add") for _, _, n in led.stream] == [-1, "add"]
    # A saved slot released: the storage leaves activations when its last slot goes.
    move(led, entry_b, ACTIVATIONS)
    entry_b.saved = 1

    class Holder:
        __slots__ = ("__weakref__",)

    holder = Holder()
    led.watch(holder, (entry_b.key,))
    del holder
    assert led.totals[ACTIVATIONS] == 100
    led.settle()
    assert (led.totals[ACTIVATIONS], led.totals[TEMPORARIES], entry_b.saved) == (0, 140, 0)
    assert not led.released and not led.watched


def test_frames_carry_the_highest_level_to_their_parents():
    led = Ledger()
    outer = push_frame(led, 0, backward=False)
    inner = push_frame(led, 1, backward=False)
    t, st = _storage(100)  # 400 bytes while the inner call runs
    led.add(st, TEMPORARIES)
    assert led.entries[st._cdata].module == 1
    del t, st
    gc.collect()
    popped = pop_frame(led, inner)
    assert popped == [inner] and inner.max == 400 and outer.max == 400 and led.top is outer
    assert pop_frame(led, inner) == []  # popping twice is harmless
    pop_frame(led, outer)
    assert led.top is None and led.module_of_new == -1


def test_frames_entered_out_of_order_in_backward():
    led = Ledger()
    child = push_frame(led, 2, backward=True)
    parent = push_frame_below(led, 1, backward=True, below=child)
    assert led.frames == [parent, child] and led.top is child
    assert remove_frame(led, parent) and led.frames == [child]
    assert not remove_frame(led, parent)


def test_closing_stops_every_callback():
    led = Ledger()
    t, st = _storage(100)
    led.add(st, WEIGHTS)
    led.close()
    del t, st
    gc.collect()  # the weakref callback runs after close and must change nothing
    led.settle()
    assert led.entries == {} and led.total == 400


def test_storage_of_gives_up_on_layouts_without_one():
    assert storage_of(torch.zeros(3).to_sparse()) is None
    assert storage_of(torch.zeros(3)).nbytes() == 12


# -------------------------------------------------------------- from totals to a Breakdown


def test_exact_mode_totals_become_a_breakdown_that_sums():
    totals = [100, 20, 100, 200, 50, 10, 7, 3, 5]  # the nine tensor categories, kv_cache 7, communication 3
    bd = breakdown(totals, light=False, where="end")
    assert [bd[c] for c in list(C)[:9]] == totals
    assert bd.total == 495
    assert bd[C.ALLOCATOR_OVERHEAD] is None and bd[C.OUTSIDE_TORCH] is None  # no device: not measured


class _Device:
    """What the device probe reports, by hand."""

    def __init__(self, allocated=None, peak_allocated=None, reserved=None, nvml_used=None):
        self.allocated, self.peak_allocated = allocated, peak_allocated
        self.reserved, self.nvml_used = reserved, nvml_used


def test_light_mode_temporaries_are_what_the_allocator_holds_beyond_the_known_categories():
    totals = [100, 0, 100, 200, 50, 10, 0, 0, 0]  # known: 460
    device = _Device(allocated=1000, peak_allocated=1500, reserved=2048, nvml_used=3000)
    end = breakdown(totals, light=True, where="end", device=device)
    assert end[C.TEMPORARIES] == 1000 - 460 and end.total == 1000 + (2048 - 1000) + (3000 - 2048)
    assert end[C.ALLOCATOR_OVERHEAD] == 1048 and end[C.OUTSIDE_TORCH] == 952
    peak = breakdown(totals, light=True, where="peak", device=device)
    assert peak[C.TEMPORARIES] == 1500 - 460
    start = breakdown(totals, light=True, where="start", device=device)
    assert start[C.TEMPORARIES] is None and start.total is None  # nothing read at start: not measured
    cpu = breakdown(totals, light=True, where="end")
    assert cpu[C.TEMPORARIES] is None and cpu.total is None
