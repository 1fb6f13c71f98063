"""The allocator-events reducer on hand-made event lists of the shape torch's snapshot gives
(``torch.cuda.memory._snapshot()["device_traces"]``: action, addr, size, stream, time_us, frames,
compile_context, user_metadata)."""

from __future__ import annotations

import pytest

from memprof.collect.allocation_events import Live, from_profiler, reduce_window, split_at
from memprof.errors import MemprofError


def ev(action: str, addr: int, size: int, t: int) -> dict:
    """One trace entry with every key torch 2.13's snapshot writes for it (memory_snapshot.cpp)."""
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": [],
            "compile_context": "", "user_metadata": "memprof phase=forward step=0"}


def weights_live() -> Live:
    return Live({0x1000: [4096, "weights"]})


def test_forward_window_peak_moment_and_composition() -> None:
    live = weights_live()
    events = [ev("alloc", 0x2000, 1000, 10),     # saved for backward (the hooks know its address)
              ev("alloc", 0x3000, 3000, 11),     # a temporary
              ev("free_requested", 0x3000, 3000, 12),
              ev("free_completed", 0x3000, 3000, 12),
              ev("alloc", 0x4000, 500, 13)]      # another temporary, still live at the end
    w = reduce_window(events, live, {0x1000: "weights", 0x2000: "activations"})
    # start: the weights alone, 4096
    assert w.start.total == 4096 and w.start["weights"] == 4096 and w.start["temporaries"] == 0
    # peak after the second alloc: 4096 + 1000 + 3000 = 8096
    assert w.peak.total == 8096
    assert (w.peak["weights"], w.peak["activations"], w.peak["temporaries"]) == (4096, 1000, 3000)
    assert w.peak_event == 1 and w.peak_time_us == 11
    # end: 4096 + 1000 + 500 = 5596
    assert w.end.total == 5596 and w.end["temporaries"] == 500
    # the free_completed after its free_requested ends nothing twice and is no loss
    assert (w.allocations, w.frees, w.unmatched_frees) == (3, 1, 0)
    assert sorted(live.blocks) == [0x1000, 0x2000, 0x4000]


def test_rounding_counts_each_block_as_the_allocator_does() -> None:
    live = Live()
    w = reduce_window([ev("alloc", 1, 1000, 1), ev("alloc", 2, 3000, 2)], live, {}, rounding=512)
    # ceil(1000 / 512) * 512 + ceil(3000 / 512) * 512 = 1024 + 3072
    assert w.peak.total == 4096 and w.peak["temporaries"] == 4096


def test_a_reused_address_takes_the_known_category_only_for_its_last_allocation() -> None:
    live = Live()
    events = [ev("alloc", 7, 100, 1), ev("free_requested", 7, 100, 2), ev("alloc", 7, 200, 3)]
    w = reduce_window(events, live, {7: "gradients"})
    # peak 200 at the third event: the block the hooks know as a gradient; the first one was a temporary
    assert w.peak.total == 200 and w.peak["gradients"] == 200 and w.peak_event == 2
    assert live.blocks[7] == [200, "gradients"]


def test_a_carried_block_moves_to_the_category_known_at_the_window_end() -> None:
    live = Live({5: [64, "temporaries"], 6: [32, "activations"]})
    # Backward: the block at 5 became a gradient; the saved activation at 6 is freed.
    w = reduce_window([ev("free_requested", 6, 32, 1)], live, {5: "gradients"})
    assert (w.start["gradients"], w.start["activations"], w.start.total) == (64, 32, 96)
    assert w.peak_event == -1 and w.peak_time_us is None and w.peak.total == 96
    assert w.end.total == 64 and w.end["activations"] == 0


def test_frees_of_blocks_made_before_recording_are_counted_not_subtracted() -> None:
    live = Live()
    w = reduce_window([ev("free_requested", 99, 128, 1), ev("free_completed", 99, 128, 2),
                       ev("alloc", 1, 8, 3)], live, {})
    assert w.unmatched_frees == 1 and w.end.total == 8


def test_segment_snapshot_and_oom_entries_change_nothing_allocated() -> None:
    live = Live()
    oom = {"action": "oom", "device_free": 10, "size": 1 << 30, "stream": 0, "time_us": 4, "frames": [],
           "compile_context": "", "user_metadata": ""}
    events = [ev("segment_alloc", 0, 2 << 20, 1), ev("alloc", 0, 512, 2), ev("snapshot", 0, 0, 3), oom,
              ev("segment_free", 0, 2 << 20, 5)]
    w = reduce_window(events, live, {})
    assert w.peak.total == w.end.total == 512 and w.allocations == 1


def test_every_tensor_category_is_measured_and_sums_to_the_total() -> None:
    w = reduce_window([ev("alloc", 1, 10, 1)], Live(), {1: "kv_cache"})
    assert w.peak["kv_cache"] == 10 and w.peak["optimizer_states"] == 0
    assert w.peak["allocator_overhead"] is None  # not an event's to know: never shown as 0
    assert w.complete


def test_an_unknown_category_is_refused() -> None:
    with pytest.raises(MemprofError, match="unknown category 'grads'"):
        reduce_window([], Live(), {1: "grads"})


def test_profiler_events_become_trace_entries_and_split_at_markers() -> None:
    entries = from_profiler([(1_000, 10, 40000), (2_500, 11, 40000), (3_000, 10, -40000)])
    assert [e["action"] for e in entries] == ["alloc", "alloc", "free_completed"]
    assert entries[2]["size"] == 40000 and entries[1]["time_us"] == 2
    first, second = split_at(entries, [2_500], key="time_ns")
    assert [e["addr"] for e in first] == [10] and [e["addr"] for e in second] == [11, 10]
    live = Live()
    a = reduce_window(first, live, {})
    b = reduce_window(second, live, {})
    # window 2 starts with the 40000 of window 1, peaks at 80000, ends at 40000
    assert (a.end.total, b.start.total, b.peak.total, b.end.total) == (40000, 40000, 80000, 40000)


def test_a_storage_made_before_recording_counts_from_the_window_it_is_first_known_in() -> None:
    live = weights_live()
    # The batch (256 bytes at 0x9000) was made before the profile; the hooks learn of it at the forward.
    w = reduce_window([ev("alloc", 0x2000, 100, 1)], live, {0x9000: "inputs"}, sizes={0x9000: 256})
    # start: the weights alone (4096); peak and end: 4096 + 256 + 100 = 4452
    assert w.start.total == 4096 and w.start["inputs"] == 0
    assert (w.peak.total, w.peak["inputs"], w.end.total) == (4452, 256, 4452)
    assert live.blocks[0x9000] == [256, "inputs"]
    # without its size, nothing is counted for it
    w2 = reduce_window([], Live(), {0x9000: "inputs"})
    assert w2.end.total == 0


def test_a_carried_block_replaced_unseen_takes_the_known_storages_size() -> None:
    # 0x50 held a 64-byte temporary; events the window lacks freed it and put a 96-byte gradient there.
    live = Live({0x50: [64, "temporaries"]})
    w = reduce_window([ev("alloc", 0x60, 10, 1)], live, {0x50: "gradients"}, sizes={0x50: 96})
    # start: the carried block under the category known now, 64; peak and end: 96 + 10 = 106
    assert (w.start.total, w.start["gradients"]) == (64, 64)
    assert (w.end.total, w.end["gradients"], w.end["temporaries"]) == (106, 96, 10)
    assert live.blocks[0x50] == [96, "gradients"]
