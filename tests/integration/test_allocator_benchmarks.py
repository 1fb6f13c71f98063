"""The allocator-events benchmarks on CPU: the GPU check's comparison (``benchmarks/allocator_source_check.py``) on
a profile whose allocator history is a stand-in, ``gpu_validate.py --allocator-source`` without CUDA, and the CPU
profiler's memory events against the dispatch source (``benchmarks/profiler_memory_events.py``)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

import memprof
from memprof.collect import allocator_history

from allocator_stand_in import FakeAllocator

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import allocator_source_check  # noqa: E402


def test_the_gpu_check_compares_each_phase_byte_for_byte(monkeypatch) -> None:
    # The same step under the dispatch source, then under the allocator source (a stand-in history, fed by a
    # test-only dispatch mode beneath the profile with every storage's allocation and free)
    from allocator_events import StorageEvents

    fake = FakeAllocator()
    monkeypatch.setattr(allocator_history, "backend_for", lambda device: fake)
    runs = []
    for source, workspace in (("dispatch", False), ("allocator", True)):
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(2, 4)
        with StorageEvents(fake), memprof.profile(model, opt, source=source) as prof:
            model(x).sum().backward()
            if workspace:
                fake.emit("alloc", 16, 1000)  # a block the dispatch mode never sees (as a kernel's workspace)
                fake.emit("free_requested", 16, 1000)
            opt.step()
        runs.append([p for s in prof.trace.steps for p in s.phases])
    result = allocator_source_check.compare_records(*runs)
    rows = {(r["step"], r["phase"]): r for r in result["phases"]}
    assert rows[(0, "optimizer")]["peak"]["equal"] and rows[(0, "backward")]["end"]["equal"]
    # The "other" phase after backward holds the 1000-byte block only the allocator saw, made once the backward's
    # statement had freed its 8 bytes of temporaries (the sum and its gradient, 4 + 4): the allocator's peak is the
    # phase's end plus the block, 992 bytes above the dispatch mode's peak (its start); start and end are equal
    other = next(r for r in result["phases"] if r["phase"] == "other" and r["step"] == 0 and r["peak"]["total_gap"])
    end = other["end"]["dispatch"]
    assert other["peak"]["allocator"] == dict(end, total=end["total"] + 1000, temporaries=1000)
    assert other["peak"]["total_gap"] == 1000 - 8 and other["start"]["equal"] and other["end"]["equal"]
    assert not result["all_equal"] and not result["equal_but_at_the_boundary"]
    text = allocator_source_check.markdown({"workload": "a Linear", "exactness": result, "wall_clock": {
        "rounds": 1, "steps": 1, "median_ratio_to_bare": {"allocator_events": 1.01},
        "allocator_events_meets_target": True}})
    assert "| +992 |" in text
    assert "Byte-equal to the dispatch mode at every phase's start, peak and end: no" in text


def test_a_phase_without_an_allocator_record_is_named_missing() -> None:
    model = nn.Linear(2, 2)
    with memprof.profile(model) as prof:
        model(torch.randn(1, 2)).sum().backward()
    dispatch = [p for s in prof.trace.steps for p in s.phases]
    result = allocator_source_check.compare_records(dispatch, [])
    assert result["phases"] and all(r["missing"] for r in result["phases"]) and not result["all_equal"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_gpu_validate_allocator_source_exits_0_without_cuda(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_validate.py"), "--allocator-source", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA device" in proc.stdout
    assert json.loads((tmp_path / "gpu-validate.json").read_text())["status"].startswith("no CUDA device")


def test_profiler_memory_events_against_the_dispatch_source() -> None:
    import overhead
    import profiler_memory_events as pme

    torch.set_num_threads(1)
    wl = overhead.build_workload("mlp", torch.device("cpu"), True)
    result = pme.compare(wl, steps=1)
    rows = {(r["step"], r["phase"]): r for r in result["phases"]}
    # Every phase of the step has a window, and each window starts where the dispatch mode's phase starts
    assert {"forward", "backward", "optimizer"} <= {p for _, p in rows}
    assert rows[(0, "forward")]["start"]["equal"]
    # The first op of backward (the loss's gradient) runs before the dispatch mode's backward begins: its output
    # is allocated before the boundary, and the dispatch mode counts it in backward. The MLP's output gradient is
    # batch 8 x width 64 float32 = 2048 bytes, the whole of the forward's end gap.
    assert rows[(0, "forward")]["end"]["total_gap"] == 8 * 64 * 4
