"""Whatever file the trace loader accepts renders (the text report, the HTML views, the command line,
the Chrome export, a diff) and re-saves identically; anything else it refuses with a TraceFormatError. Checked on real saved traces, mutated by hypothesis: keys dropped, values of
other types, huge ints, lone surrogates and control characters in strings, sums nudged off by a few
bytes, list items duplicated, lists reversed and two items swapped."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pathlib

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import memprof
from memprof.cli import main
from memprof.errors import TraceFormatError
from memprof.render.chrome import chrome_trace
from memprof.render.html import report_html
from memprof.render.page import report_page
from memprof.record.trace import OomRecord, Trace

from factories import full_trace
from models import MLP
from training import output_sum, profile_training

DATA = pathlib.Path(__file__).parents[1] / "data"


def _training(mode: str) -> Trace:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters())
    return profile_training(model, opt, lambda i: (torch.randn(4, 32), None), loss=output_sum, keep_batch=False,
                            mode=mode).trace


def _failed() -> Trace:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def boom(module, args):
        raise RuntimeError("out of memory (simulated)\nat the second layer")

    model[2].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError):
        with memprof.profile(model) as prof:
            model(torch.randn(4, 8))
    return prof.report().trace


def _rank() -> Trace:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    return memprof.estimate(model, lambda ps: torch.optim.AdamW(ps), inputs=torch.randn(4, 16, device="meta"),
                            world_size=2, parallel="fsdp").trace


def _scheduled() -> Trace:
    """Six steps under a schedule (one waited, one warmed up, two recorded, twice): recorded stretches, steps
    kept apart, samples of steps not kept, optimizer steps carried; two forward and backward per step
    (gradient accumulation: each step's backward #1)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt, schedule=memprof.schedule(wait=1, warmup=1, active=2, repeat=2)) as prof:
        for _ in range(8):
            for _ in range(2):
                model(torch.randn(4, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    return prof.report().trace


def _generation() -> Trace:
    """A real generate() of a tiny Llama: prefill and decode phases, the generation record."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=32, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).eval()
    with memprof.profile(model) as prof:
        model.generate(torch.zeros(1, 4, dtype=torch.long), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                       pad_token_id=0)
    return prof.report().trace


@pytest.fixture(scope="module")
def bases() -> dict[str, dict]:
    """Traces as their files hold them: real runs (full and light mode, one that raised, one simulated rank
    of FSDP, a schedule's with gradient accumulation, a generation), a file of schema 1, and a hand-built trace
    with one of everything and an OOM record. Every rule of the loader holds for each as memprof wrote it."""
    traces = {"exact": _training("exact"), "light": _training("light"), "failed": _failed(), "rank": _rank(),
              "scheduled": _scheduled(), "generation": _generation(),
              "factory": dataclasses.replace(full_trace(), oom=OomRecord("CUDA out of memory", 512, 0, 1024))}
    out = {name: json.loads(json.dumps(t.to_dict())) for name, t in traces.items()}
    out["schema1"] = json.loads((DATA / "trace-schema1.json").read_text())
    for data in out.values():
        Trace.from_dict(copy.deepcopy(data))  # every base loads as it is
    return out


VALUES = [None, True, False, 0, 1, -1, 7, 2**31, 2**63, 2**64, 2**64 + 1, 10**30, 0.5, 1e300, math.nan, math.inf, "",
          "abc", "forward", "\ud800", "a\nPeak 0 B (all clear)\u202e", [], {}, [0, 1], ["x", 1], {"total": 1}]
SUFFIXES = ["\ud800", "\n", "\u202e", "\x1b[2J", "\udfff\u2066", "x" * 5000]


def _places(node, out):
    """Every (container, key) of a JSON value."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        out.append((node, key))
        _places(value, out)
    return out


@st.composite
def mutated(draw, bases):
    name = draw(st.sampled_from(sorted(bases)))
    data = copy.deepcopy(bases[name])
    for _ in range(draw(st.integers(1, 3))):
        if not data:
            break
        # A part of the trace first (the timeline would otherwise take most draws), then a place in it.
        part = draw(st.sampled_from(sorted(data)))
        node, key = draw(st.sampled_from([(data, part)] + _places(data[part], [])))
        value = node[key]
        kind = draw(st.sampled_from(["drop", "value", "nudge", "text", "repeat", "alike", "reverse", "swap"]))
        if kind == "alike":  # a value of the same type: what a loader that checks types only lets through
            node[key] = (not value if isinstance(value, bool)
                         else draw(st.integers(0, 2**64)) if isinstance(value, int)
                         else draw(st.floats()) if isinstance(value, float)
                         else draw(st.text(max_size=20)) if isinstance(value, str)
                         else value[:-1] if isinstance(value, list)
                         else copy.deepcopy(draw(st.sampled_from(VALUES))))
        elif kind == "drop":
            del node[key]
        elif kind == "nudge" and isinstance(value, int) and not isinstance(value, bool):
            node[key] = value + draw(st.integers(-3, 3))
        elif kind == "text" and isinstance(value, str):
            node[key] = value + draw(st.sampled_from(SUFFIXES))
        elif kind == "repeat" and isinstance(value, list) and value:
            value.append(copy.deepcopy(value[draw(st.integers(0, len(value) - 1))]))
        elif kind == "reverse" and isinstance(value, list):
            value.reverse()
        elif kind == "swap" and isinstance(value, list) and len(value) > 1:
            i, j = draw(st.integers(0, len(value) - 2)), len(value) - 1
            value[i], value[j] = value[j], value[i]
        else:
            node[key] = copy.deepcopy(draw(st.sampled_from(VALUES)))
    return data


def _saved(data) -> str:
    # What a file holds: report.save writes JSON with non-ASCII escaped, NaN and Infinity as Python does.
    return json.dumps(data)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("mutated")


def test_every_base_renders_and_round_trips(bases, folder, capsys):
    for name, data in bases.items():
        trace = Trace.from_dict(copy.deepcopy(data))
        _faithful(data, json.loads(_saved(trace.to_dict())))
        _consistent(trace)
        _renders_and_round_trips(trace, folder / f"{name}.json", capsys)


def _renders_and_round_trips(trace: Trace, path: pathlib.Path, capsys) -> None:
    report = memprof.Report(trace)
    # Encoded as they are written and printed (UTF-8, strict): no text may be unencodable.
    assert str(report).encode("utf-8") and report_html(trace).encode("utf-8") and report_page(trace).encode("utf-8")
    assert json.dumps(chrome_trace(trace)) and str(memprof.diff(trace, trace)).encode("utf-8")
    report.save(path)
    again = memprof.load(path).trace
    assert _saved(again.to_dict()) == _saved(trace.to_dict())  # JSON text: NaN compares equal to itself
    capsys.readouterr()
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(("memprof report:", "OUT OF MEMORY:")) and out.encode("utf-8")


def _faithful(given, held, where="trace"):
    """What a file says is what the loaded trace holds: each value the file gives comes back from
    ``to_dict()`` (lone surrogates as U+FFFD), so no value was silently reinterpreted on the way in
    (a string read as a list of letters, "no" read as true)."""
    if where == "trace.num_steps" and given is None:
        return  # null: a file from before it was recorded, which kept every step (documented)
    if where == "trace.mode" and given == "full":
        given = "exact"  # exact mode's former name, which files written before the rename hold (documented)
    if isinstance(given, dict):
        assert isinstance(held, dict), where
        for key, value in given.items():
            if key in held:  # a key this memprof does not know is left out, as a newer file's extras are
                _faithful(value, held[key], f"{where}.{key}")
    elif isinstance(given, list):
        assert isinstance(held, list) and len(held) == len(given), where
        for i, (a, b) in enumerate(zip(given, held)):
            _faithful(a, b, f"{where}[{i}]")
    elif isinstance(given, str):
        assert held == given.encode("utf-16", "surrogatepass").decode("utf-16", "replace"), where
    elif isinstance(given, float) and math.isnan(given):
        assert isinstance(held, float) and math.isnan(held), where
    else:
        assert held == given and isinstance(held, bool) == isinstance(given, bool), where


def _consistent(t: Trace) -> None:
    """The record's own invariants, checked apart from the loader: each breakdown's categories sum to its
    total (every tensor category measured) or stay within it; each peak is its span's highest total."""
    def sums(bd):
        if bd.total is None:
            return
        known = sum(v for v in bd.counts if v is not None)
        tensor = [bd[c] for c in memprof.vocabulary.TENSOR_CATEGORIES]
        assert known == bd.total if all(v is not None for v in tensor) else known <= bd.total

    def highest(peak, *others):
        assert peak.total is None or all(o.total is None or o.total <= peak.total for o in others)

    for bd in (t.start, t.peak, t.end, *(s.breakdown for s in t.timeline),
               *([t.live_at_error] if t.live_at_error is not None else [])):
        sums(bd)
    highest(t.peak, t.start, t.end)
    for p in t.phases:
        for bd in (p.start, p.peak, p.end):
            sums(bd)
        highest(p.peak, p.start, p.end)
    assert [s.index for s in t.steps] == sorted({s.index for s in t.steps})
    assert all(p.step == s.index for s in t.steps for p in s.phases)
    # Each module once; phases one after another, each starting, peaking and ending in that order.
    assert len({m.path for m in t.modules}) == len(t.modules)
    times = [x for p in t.phases for x in (p.start_us, p.peak_us, p.end_us) if x is not None]
    assert times == sorted(times)
    # Each step's phases of a kind numbered 0, 1, 2 ...; samples in the order they were taken, of steps that ran.
    for s in t.steps:
        for kind in {p.phase for p in s.phases}:
            numbers = sorted(p.occurrence for p in s.phases if p.phase is kind)
            assert numbers == list(range(len(numbers)))
    assert [x.seq for x in t.timeline] == sorted({x.seq for x in t.timeline})
    assert [x.step for x in t.timeline] == sorted(x.step for x in t.timeline)
    assert all(x.step < t.num_steps for x in t.timeline) and all(s.index < t.num_steps for s in t.steps)
    # In exact mode the peak's step and phase name the first kept phase to reach it (the tensor categories).
    tensor = [c for c in memprof.vocabulary.TENSOR_CATEGORIES if t.peak[c] is not None]
    if t.mode == "exact" and tensor and t.peak_step is not None and any(s.index == t.peak_step for s in t.steps):
        first = next((p for p in t.phases if all(p.peak[c] is not None for c in tensor)
                      and sum(p.peak[c] for c in tensor) == sum(t.peak[c] for c in tensor)), None)
        assert first is None or (first.step, first.phase) == (t.peak_step, t.peak_phase)
    if t.distributed is not None:
        assert 0 <= t.distributed.rank < t.distributed.world_size <= 2**20


def test_the_reviews_mutations_of_a_real_run_are_refused_naming_the_value(bases, folder):
    # Review of issue 36, loader item 3: each of these loaded, and a report printed the peak in a phase that did not
    # hold it. A real two-step run (MLP, AdamW) as its file holds it.
    base = bases["exact"]
    assert base["num_steps"] == 2 and base["peak_step"] is not None

    def refused(data=None, text=None):
        path = folder / "review.json"
        path.write_text(text if text is not None else json.dumps(data))
        with pytest.raises(TraceFormatError) as info:
            memprof.load(path)
        return str(info.value)

    def mutant(change):
        data = copy.deepcopy(base)
        change(data)
        return data

    seqs = [x["seq"] for x in base["timeline"]]
    assert f"timeline sample {seqs[-2]} is listed after sample {seqs[-1]}" in refused(
        mutant(lambda d: d["timeline"].reverse()))
    assert f"timeline sample {seqs[-1]} is listed after sample {seqs[-1]}" in refused(
        mutant(lambda d: d["timeline"].append(d["timeline"][-1])))
    assert "the timeline holds a sample of step 99 but the run had 2 steps" in refused(
        mutant(lambda d: d["timeline"][-1].update(step=99)))

    def backward_3(d):
        for p in d["steps"][0]["phases"]:
            if p["phase"] == "backward":
                p["occurrence"] = 3
    assert "step 0 holds backward #3 but no backward #0" in refused(mutant(backward_3))
    # The peak moved to every other (step, phase) of the run: each names a phase that did not first reach it.
    kinds = {(s["index"], p["phase"]) for s in base["steps"] for p in s["phases"]} - {(base["peak_step"],
                                                                                      base["peak_phase"])}
    assert len(kinds) >= 5
    for step, kind in sorted(kinds):
        said = refused(mutant(lambda d, step=step, kind=kind: d.update(peak_step=step, peak_phase=kind)))
        assert f"is said to be in step {step}'s {kind}, but step {base['peak_step']}'s {base['peak_phase']}" in said
    text = json.dumps(base).replace('"num_steps": 2', '"num_steps": 2, "num_steps": 7', 1)
    assert "gives the key 'num_steps' twice in one object" in refused(text=text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_trace_is_refused_or_renders(bases, folder, capsys, data):
    mutant = data.draw(mutated(bases))
    path = folder / "mutant.json"
    path.write_text(_saved(mutant))
    try:
        trace = memprof.load(path).trace
    except TraceFormatError:
        event("refused")
        capsys.readouterr()
        assert main(["report", str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("memprof: error: ") and err.count("\n") == 1
        return
    event("accepted")
    _faithful(mutant, json.loads(_saved(trace.to_dict())))
    _consistent(trace)
    _renders_and_round_trips(trace, folder / "resaved.json", capsys)
