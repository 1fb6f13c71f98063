"""benchmarks/ledger_event_log.py: its event-log ledger reduces to the running totals' figures, and the
figures docs/benchmarks.md gives (the log costs more per event at the rates exact mode would reduce it)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from memprof.collect.ledger import ACTIVATIONS, TEMPORARIES, Ledger
from memprof.collect.frame_stack import push_frame

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "ledger_event_log.py"


def _load():
    sys.path.insert(0, str(SCRIPT.parent))  # it imports _machine from its folder
    try:
        spec = importlib.util.spec_from_file_location("memprof_ledger_event_log", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_the_event_log_reduces_to_the_running_totals():
    # The comparison is fair only if both ledgers account the same: the same stream into each, reduced at
    # the end, gives the same totals, peak and peak composition.
    log_type = _load().EventLogLedger
    ledgers = [Ledger(), log_type()]
    for led in ledgers:
        led.start_phase()
        push_frame(led, 0, backward=False)
    keep = []
    for i in range(40):
        t = torch.empty(i + 1)  # (i + 1) x 4 bytes
        for led in ledgers:
            led.add(t.untyped_storage(), ACTIVATIONS if i % 3 == 0 else TEMPORARIES)
        if i % 3 == 0:
            keep.append(t)  # every third one stays; the others are freed when t is rebound
        del t  # freed here by reference counting (a tensor in no cycle): no collection needed
    ledgers[1].reduce()
    ref, log = ledgers
    assert (log.totals, log.total, log.peak, log.peak_total) == (ref.totals, ref.total, ref.peak, ref.peak_total)
    # Kept: i = 0, 3, ..., 39, i.e. 14 tensors of (i + 1) x 4 bytes: 4 x (1 + 4 + ... + 40) = 4 x 287 = 1,148.
    assert ref.totals[ACTIVATIONS] == 1148 and ref.total == 1148
    assert ref.frames[0].max == log.frames[0].max == ref.peak_total


@pytest.mark.skipif(sys.gettrace() is not None, reason="another tracer is installed (coverage, a debugger)")
def test_the_script_gives_the_figures_the_docs_read(tmp_path):
    out = tmp_path / "el.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["reduced_every"]: r for r in json.loads(out.read_text())["rows"]}
    # Running totals: one frame per event (Ledger.add per storage made, Ledger.settle applying the free queued
    # since; the peak check is written out in add), but for the one settle that the first frees, queued together
    # while the window filled, share: (2 x 3000 - 4 - 1) / (2 x 3000 - 4) frames per event.
    assert all(r["running_totals_frames"] == (2 * 3000 - 5) / (2 * 3000 - 4) for r in rows.values())
    # Reduced every 2 to 5 storages (what module boundaries would impose), the log costs more frames.
    for every in (2, 3, 5):
        assert rows[every]["event_log_frames"] > rows[every]["running_totals_frames"]
    # The figures docs/benchmarks.md gives, as the script prints them.
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    for every in (2, 3, 5, 10, 30):
        r = rows[every]
        assert (f"| {every} storages | {r['running_totals_opcodes']:.1f} | {r['running_totals_frames']:.2f} | "
                f"{r['event_log_opcodes']:.1f} | {r['event_log_frames']:.2f} |") in docs
