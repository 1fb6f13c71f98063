"""The memory_viz snapshot (memprof.render.memory_viz) of a hand-built timed step: each category's growth
a block, its shrinking a free, synthetic addresses reused first-fit, the segment left at the end."""

from __future__ import annotations

from memprof.render.memory_viz import memory_viz_snapshot

from factories import timed_trace

BASE = 0x7F0000000000


def _frames(category, module, phase):
    return [{"filename": "memprof", "line": 0, "name": f"category: {category}"},
            {"filename": "memprof", "line": 0, "name": f"module: {module}"},
            {"filename": "memprof", "line": 0, "name": f"phase: {phase} (step 0)"}]


def _event(action, offset, size, frames, time_us):
    return {"action": action, "addr": BASE + offset, "size": size, "stream": 0, "frames": frames, "time_us": time_us}


def test_a_timed_step_is_the_blocks_and_frees_of_its_categories():
    snap = memory_viz_snapshot(timed_trace())
    weights = _frames("weights", "(no module running)", "forward")
    inputs = _frames("inputs", "(no module running)", "forward")
    saved = _frames("activations", "fc", "forward")  # grown at the forward's peak, while fc ran (10-45 us)
    scratch = _frames("temporaries", "fc", "forward")
    grads = _frames("gradients", "(no module running)", "backward")
    assert snap["device_traces"] == [[
        _event("alloc", 0, 144, weights, 0), _event("alloc", 144, 96, inputs, 0),
        _event("alloc", 240, 48, saved, 40), _event("alloc", 288, 32, scratch, 40),
        _event("free_requested", 288, 32, scratch, 45), _event("free_completed", 288, 32, scratch, 45),
        # The 144 gradient bytes reuse the freed 32 at offset 288 and grow the segment's tail: 288 + 144 = 432.
        _event("alloc", 288, 144, grads, 70),
        _event("free_requested", 240, 48, saved, 100), _event("free_completed", 240, 48, saved, 100),
    ]]
    (segment,) = snap["segments"]
    blocks = segment.pop("blocks")
    # 432 B of address space (the run's peak); 144 + 96 + 144 = 384 B allocated at the end.
    assert segment == {"device": 0, "address": BASE, "total_size": 432, "stream": 0, "segment_type": "large",
                       "allocated_size": 384, "active_size": 384, "requested_size": 384}
    assert blocks == [
        {"address": BASE, "size": 144, "requested_size": 144, "state": "active_allocated", "frames": weights},
        {"address": BASE + 144, "size": 96, "requested_size": 96, "state": "active_allocated", "frames": inputs},
        {"address": BASE + 240, "size": 48, "requested_size": 0, "state": "inactive", "frames": []},
        {"address": BASE + 288, "size": 144, "requested_size": 144, "state": "active_allocated", "frames": grads},
    ]
    assert snap["memprof"] == {"what": "blocks are memprof categories' growth between recorded moments, not single "
                                       "tensors", "memprof_version": "0.0.0", "timed": True}
