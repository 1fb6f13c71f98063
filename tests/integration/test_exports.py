"""Chrome/Perfetto, memory_viz and standalone HTML exports, checked against the trace and against
independent sums of the model's tensors."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess

import pytest
import torch
from torch import nn

import memprof
from memprof.vocabulary import Category
from memprof.errors import NotMeasuredError
from memprof.demo import TinyGPT, synthetic_tokens
from tests.helpers import optimizer_state_bytes, weight_bytes
from training import output_sum, profile_training

DATA = os.path.join(os.path.dirname(__file__), "..", "data")


def _gpt_run(steps=3, mode="exact", **kwargs):
    torch.manual_seed(0)
    model = TinyGPT(vocab=100, hidden=32, layers=2, heads=2, max_seq=16)
    opt = torch.optim.AdamW(model.parameters())
    report = profile_training(model, opt, lambda i: synthetic_tokens(2, 16, 100, seed=i), steps=steps,
                              loss=TinyGPT.loss, mode=mode, **kwargs)
    return report, model, opt


@pytest.fixture(scope="module")
def run():
    return _gpt_run()


# -- Chrome / Perfetto ----------------------------------------------------------------------------


def _chrome(report, tmp_path):
    path = tmp_path / "trace.json"
    report.export_chrome_trace(path)
    return json.loads(path.read_text())


def test_chrome_trace_follows_the_trace_event_format(run, tmp_path):
    report = run[0]
    doc = _chrome(report, tmp_path)
    assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"}
    for e in doc["traceEvents"]:
        assert e["ph"] in {"M", "C", "X", "i"} and e["pid"] == 1
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0 and (e["tid"] in (1, 2, 3, 5) or e["tid"] >= 10)
        if e["ph"] == "C":
            assert set(e["args"]) == {"bytes"} and isinstance(e["args"]["bytes"], int)
        if e["ph"] == "i":
            assert e["s"] in ("t", "g")
    steps = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == 1]
    phases = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == 2]
    assert [e["name"] for e in steps] == [f"step {s.index}" for s in report.trace.steps]
    assert len(phases) == len(report.trace.phases)
    assert doc["otherData"]["time_axis"] == "microseconds since the profile started"


def test_the_docs_name_every_track_and_event_as_the_file_does(tmp_path):
    # An error mid-run, so that every kind of instant event is written; TinyGPT nests two levels deep.
    torch.manual_seed(0)
    model = TinyGPT(vocab=100, hidden=32, layers=2, heads=2, max_seq=16)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(RuntimeError, match="stop"):
        with memprof.profile(model, opt) as prof:
            x, y = synthetic_tokens(2, 16, 100, seed=0)
            TinyGPT.loss(model(x), y).backward()
            opt.step()
            raise RuntimeError("stop")
    report = prof.report()
    doc = _chrome(report, tmp_path)
    meta = {e["name"]: set() for e in doc["traceEvents"] if e["ph"] == "M"}
    for e in doc["traceEvents"]:
        if e["ph"] == "M" and "name" in e["args"]:
            meta[e["name"]].add(e["args"]["name"])
    assert meta["process_name"] == {f"memprof: {report.trace.device.name} (exact mode)"}
    tracks = meta["thread_name"]
    assert {"steps", "phases", "modules (forward)", "modules (backward, depth 0)",
            "modules (backward, depth 1)"} <= tracks
    instants = {e["name"] for e in doc["traceEvents"] if e["ph"] == "i"}
    assert {"peak of the run", "error", "peak of forward (step 0)", "peak of backward (step 0)"} <= instants
    docs = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "viewers.md")).read()
    docs = " ".join(docs.split())  # a name may be written across a line break
    assert "`memprof: <device> (<mode> mode)`" in docs
    # Every track by its name; the backward ones, one per depth, by the first two and the pattern.
    for name in sorted(tracks | {"peak of the run", "error", "total"}):
        if name.startswith("modules (backward, depth ") and name not in ("modules (backward, depth 0)",
                                                                          "modules (backward, depth 1)"):
            continue
        assert f"`{name}`" in docs, name
    assert "`peak of forward (step 1)`" in docs


def test_chrome_counters_hold_the_exact_bytes(run, tmp_path):
    report, model, opt = run
    doc = _chrome(report, tmp_path)
    series: dict[str, list[int]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "C":
            series.setdefault(e["name"], []).append(e["args"]["bytes"])
    assert set(series) == {c.value for c in Category if report.peak[c] is not None} | {"total"}
    # The run's highest total is the trace's peak, to the byte.
    assert max(series["total"]) == report.peak.total
    # Weights: 2 layers of TinyGPT, every parameter's numel * element_size, tied storages once.
    assert series["weights"][-1] == weight_bytes(model)
    assert series["optimizer_states"][-1] == optimizer_state_bytes(opt)
    # Each phase's peak instant carries that phase's composition.
    peaks = [e for e in doc["traceEvents"] if e["ph"] == "i" and e["name"].startswith("peak of ")
             and e["name"] != "peak of the run"]
    assert len(peaks) == len(report.trace.phases)
    for e, p in zip(peaks, report.trace.phases):
        assert e["args"]["total"] == p.peak.total
        assert {k: v for k, v in e["args"].items() if k in {c.value for c in Category}} == \
            {c.value: v for c, v in p.peak.measured().items()}
    top = [e for e in doc["traceEvents"] if e["name"] == "peak of the run"]
    assert len(top) == 1 and top[0]["args"]["total"] == report.peak.total


def test_chrome_module_spans_are_nested_per_track(run, tmp_path):
    doc = _chrome(run[0], tmp_path)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X" and (e["tid"] == 3 or e["tid"] >= 10)]
    names = {e["name"] for e in spans if e["tid"] == 3}
    assert {"blocks.0", "blocks.1", "<model>"} <= names
    backward = {e["tid"] for e in spans if e["tid"] >= 10}
    assert {10, 11, 12} <= backward  # the root, blocks.*, and their children, each depth on its own track
    for tid in {3} | backward:
        stack: list[float] = []
        for e in sorted((e for e in spans if e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1] + 1e-6, e
            stack.append(e["ts"] + e["dur"])
    # The root's backward frame never closes (no gradient flows to the token ids): drawn to the end of
    # backward, and said so.
    root = [e for e in spans if e["tid"] == 10 and e["name"] == "<model>"]
    assert root and all(e["args"]["end"].startswith("not recorded") for e in root)
    # Every forward call is drawn with its recorded exit.
    assert all("end" not in e["args"] for e in spans if e["tid"] == 3)


def test_checkpoint_recompute_draws_no_stray_spans(tmp_path):
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(checkpoint(self.a, x, use_reentrant=False)).sum()

    model = Net()
    with memprof.profile(model) as prof:
        model(torch.randn(4, 8, requires_grad=True)).backward()
    doc = _chrome(prof.report(), tmp_path)
    forward = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == 3]
    # One forward call of each module: the recompute in backward is not drawn as a forward call.
    assert sorted(e["name"] for e in forward) == ["<model>", "a", "b"]


def test_one_run_peak_instant_also_without_a_total(tmp_path):
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    for mode in ("exact", "light"):
        with memprof.profile(model, opt, mode=mode) as prof:
            for _ in range(2):
                for _ in range(3):  # gradient accumulation: equal peaks in each backward
                    model(x).sum().backward()
                opt.step()
                opt.zero_grad()
        doc = _chrome(prof.report(), tmp_path)
        tops = [e for e in doc["traceEvents"] if e["name"] == "peak of the run"]
        assert len(tops) == 1, mode


def test_light_mode_has_no_track_for_what_it_does_not_measure(tmp_path):
    report, _, _ = _gpt_run(steps=2, mode="light")
    doc = _chrome(report, tmp_path)
    names = {e["name"] for e in doc["traceEvents"] if e["ph"] == "C"}
    # Light mode on CPU has no allocator counter: no temporaries and no total, so no track for them.
    assert report.peak[Category.TEMPORARIES] is None and report.peak.total is None
    assert "temporaries" not in names and "total" not in names
    assert "weights" in names and "temporaries" in doc["otherData"]["not_measured"]


def test_a_trace_without_times_exports_with_its_phases_in_order(tmp_path):
    report = memprof.load(os.path.join(DATA, "trace-schema1.json"))
    doc = _chrome(report, tmp_path)
    assert "no clock" in doc["otherData"]["time_axis"]
    phases = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == 2]
    assert len(phases) == len(report.trace.phases)
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(phases, phases[1:]))


def test_exports_of_a_long_run_stay_bounded(tmp_path):
    sizes = {}
    for steps in (20, 400):
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        report = profile_training(model, opt, lambda i: (torch.randn(8, 16), None), steps=steps, loss=output_sum,
                                  keep_batch=False)
        report.export_chrome_trace(tmp_path / f"c{steps}.json")
        report.export_memory_viz(tmp_path / f"m{steps}.pickle")
        sizes[steps] = (os.path.getsize(tmp_path / f"c{steps}.json"), os.path.getsize(tmp_path / f"m{steps}.pickle"))
        assert report.num_steps == steps
    # Only the steps kept in full are drawn: 20x the steps, about the same files.
    assert sizes[400][0] < 2 * sizes[20][0] and sizes[400][1] < 2 * sizes[20][1]


# -- memory_viz ------------------------------------------------------------------------------------


def _snapshot(report, tmp_path):
    path = tmp_path / "snap.pickle"
    report.export_memory_viz(path)
    with open(path, "rb") as fh:
        return pickle.load(fh)


def test_memory_viz_blocks_replay_to_the_categories(run, tmp_path):
    report, model, _ = run
    snap = _snapshot(report, tmp_path)
    events = snap["device_traces"][0]
    live: dict[int, tuple[int, str]] = {}
    by_cat: dict[str, int] = {}
    for e in events:
        cat = e["frames"][0]["name"].removeprefix("category: ")
        if e["action"] == "alloc":
            assert e["addr"] not in live  # synthetic addresses are never reused
            live[e["addr"]] = (e["size"], cat)
            by_cat[cat] = by_cat.get(cat, 0) + e["size"]
        elif e["action"] == "free_completed":
            size, was = live.pop(e["addr"])
            assert size == e["size"] and was == cat
            by_cat[cat] -= size
    # What is live after the last event is the run's end, category by category.
    assert {c: v for c, v in by_cat.items() if v} == {c.value: v for c, v in report.end.measured().items() if v}
    assert by_cat["weights"] == weight_bytes(model)
    # The final segment lists exactly the live blocks, laid out without overlap.
    blocks = snap["segments"][0]["blocks"]
    active = [b for b in blocks if b["state"] == "active_allocated"]
    assert sum(b["size"] for b in active) == sum(size for size, _ in live.values())
    assert sum(b["size"] for b in blocks) == snap["segments"][0]["total_size"]
    # Freed ranges are reused: the segment is a footprint near the peak, not every allocation summed.
    assert snap["segments"][0]["total_size"] < 1.5 * report.peak.total
    names = [f["name"] for e in events for f in e["frames"]]
    assert any(n.startswith("module: blocks.") for n in names)
    assert any(n.startswith("phase: backward (step ") for n in names)


def test_torch_memory_viz_reads_the_snapshot(run, tmp_path):
    from torch.cuda import _memory_viz as viz

    snap = _snapshot(run[0], tmp_path)
    page = viz.trace_plot(snap)
    assert "Active Memory Timeline" in page
    assert "Active Cached Memory Timeline" in viz.segment_plot(snap) or viz.segment_plot(snap)
    assert "segments: 1" in viz.segsum(snap)
    assert "TOTAL MEM" in viz.trace(snap)
    lines = viz.segments(snap, format_flamegraph=lambda text: text)
    assert "category: weights" in lines
    assert "category: weights" in viz.memory(snap, format_flamegraph=lambda text: text)


# -- standalone HTML --------------------------------------------------------------------------------


def test_html_report_is_self_contained(run, tmp_path):
    report = run[0]
    path = tmp_path / "report.html"
    report.export_html(path)
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and " src=" not in page and " href=" not in page and "@import" not in page
    assert "<svg" in page and "memprof reconciliation" in page
    for c in Category:
        assert c.value in page
    # The notebook view is the same body.
    assert report._repr_html_() in page


def test_html_report_of_a_large_model_stays_under_2_mb(tmp_path):
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(500)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report = profile_training(model, opt, lambda i: (torch.randn(2, 4), None), steps=3, loss=output_sum,
                              keep_batch=False)
    path = tmp_path / "big.html"
    report.export_html(path)
    assert len(report.trace.timeline) > 5000  # many more moments than the SVG draws
    assert os.path.getsize(path) < 2 * 1024 * 1024


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(_chromium() is None, reason="no chromium here: install Debian's chromium package "
                    "(apt-get install -y chromium) to run the browser test")
def test_html_report_renders_in_a_real_browser(run, tmp_path):
    path = tmp_path / "report.html"
    run[0].export_html(path)
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
           f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", path.as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    dom = out.stdout
    assert "memprof report" in dom and "<svg" in dom
    for c in Category:
        assert c.value in dom
    console = [line for line in out.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console == []


# -- refusals ---------------------------------------------------------------------------------------


def test_nothing_measured_is_refused_and_no_file_is_written(tmp_path):
    model = nn.Linear(2, 2)
    with memprof.profile(model) as prof:
        pass
    report = prof.report()
    for how, name in (("export_chrome_trace", "c.json"), ("export_memory_viz", "m.pickle"), ("export_html", "r.html")):
        with pytest.raises(NotMeasuredError, match="nothing to export"):
            getattr(report, how)(tmp_path / name)
        assert not (tmp_path / name).exists()


def test_times_survive_a_save_and_load(run, tmp_path):
    report = run[0]
    report.save(tmp_path / "run.json")
    again = memprof.load(tmp_path / "run.json")
    assert again.trace == report.trace
    times = [(p.start_us, p.peak_us, p.end_us) for p in report.trace.phases]
    assert [(p.start_us, p.peak_us, p.end_us) for p in again.trace.phases] == times
    assert [s.time_us for s in again.trace.timeline] == [s.time_us for s in report.trace.timeline]
    phases = again.trace.phases
    assert all(p.start_us <= p.peak_us <= p.end_us for p in phases)
    assert all(a.end_us <= b.start_us for a, b in zip(phases, phases[1:]))
    assert {s.event for s in again.trace.timeline} == {"start", "phase", "enter", "exit"}


def test_a_run_of_many_phases_stays_a_small_page(tmp_path):
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.profile(model, opt, timeline=False) as prof:
        for _ in range(3):
            for _ in range(300):  # 300 micro-batches per step: 1,800 forward and backward phases
                model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    report = prof.report()
    assert len(report.trace.phases) > 1800
    page = (tmp_path / "r.html")
    report.export_html(page)
    text = page.read_text()
    # Phase bands under a pixel are merged or left out: at most about one per pixel column.
    assert text.count('fill-opacity="0.10"') <= 720 and os.path.getsize(page) < 2 * 1024 * 1024


def test_a_capped_timeline_says_so(monkeypatch):
    from memprof.collect import timeline

    monkeypatch.setattr(timeline, "_MAX_SAMPLES", 50)
    report, _, _ = _gpt_run(steps=2)
    assert len(report.trace.timeline) == 50
    assert any("timeline stopped at 50 samples" in n for n in report.trace.notes)
