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
    fake = FakeAllocator()
    monkeypatch.setattr(allocator_history, "backend_for", lambda device: fake)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.profile(model, opt, source="allocator") as prof:
        model(torch.randn(2, 4)).sum().backward()
        fake.emit("alloc", 16, 1000)  # a block the dispatch mode never sees (as a kernel's workspace would be)
        opt.step()
    dispatch = [p for s in prof.trace.steps for p in s.phases]
    result = allocator_source_check.compare_records(dispatch, list(prof.allocator_phases))
    rows = {(r["step"], r["phase"]): r for r in result["phases"]}
    # The forward: every storage counted from the window that first knows it, as the dispatch mode's ledger does
    assert rows[(0, "forward")]["end"]["equal"]
    # The "other" phase after backward holds the 1000-byte block only the allocator saw: its peak is 1000 bytes
    # further from the dispatch mode's than its start (where the gap is what the real run freed and the stand-in
    # recorded no free of), and the comparison says so
    other = next(r for r in result["phases"] if r["phase"] == "other" and r["step"] == 0 and r["peak"]["total_gap"])
    assert other["peak"]["total_gap"] - other["start"]["total_gap"] == 1000 and not other["peak"]["equal"]
    assert not result["all_equal"]
    text = allocator_source_check.markdown({"workload": "a Linear", "exactness": result, "wall_clock": {
        "rounds": 1, "steps": 1, "median_ratio_to_bare": {"allocator_events": 1.01},
        "allocator_events_meets_target": True}})
    assert f"| {other['peak']['total_gap']:+,} |" in text and "Byte-equal to the dispatch mode at every phase's start, peak and end: no" in text


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
