"""What a report shows of the text a trace carries: a module's name, a note, an error or a version
cannot forge a line, reorder what is read or break printing, and no text or run length makes the
standalone HTML page large."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import memprof
from memprof.cli import main
from memprof.render.html import report_html
from memprof.record.trace import as_trace

from factories import cpu, full_trace, module, phase, trace
from training import output_sum, profile_training


def report_page(t) -> str:
    """The standalone page as users get it, the reconciliation the facade computes included."""
    return memprof.Report(as_trace(t)).to_html()


#: A name that would print a line of its own claiming the run used no memory.
FORGED = "a\nPeak 0 B (all clear)"
#: Every bidirectional formatting character (Unicode UAX #9), and the line and paragraph separators.
BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
SEPARATORS = "\u2028\u2029"


def _named(first: str, second: str) -> nn.Module:
    model = nn.Sequential()
    model.add_module(first, nn.Linear(8, 8))  # add_module accepts any name without a dot
    model.add_module(second, nn.ReLU())
    model.add_module("head", nn.Linear(8, 2))
    return model


def _profiled(model: nn.Module) -> memprof.Report:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return profile_training(model, opt, lambda i: (torch.randn(4, 8), None), steps=1, loss=output_sum,
                            zero_grad=False, keep_batch=False)


def _inert(text: str) -> None:
    """No character of ``text`` can move the cursor, reorder the text or start a line of its own."""
    assert not set(text) & set(BIDI + SEPARATORS + "\x1b\r\x0b\x0c\x85")
    assert not any(line.startswith("Peak 0 B") for line in text.splitlines())


def test_module_names_cannot_forge_lines_of_a_real_runs_report(tmp_path, capsys):
    plain = _profiled(_named("a", "b"))
    crafted = _profiled(_named(FORGED, "b" + BIDI + SEPARATORS))
    for render in (str, lambda r: r.to_text(top_modules=8)):
        text, expected = render(crafted), render(plain)
        # The same run under other names: exactly as many lines.
        assert len(text.splitlines()) == len(expected.splitlines())
        _inert(text)
        assert "a\\nPeak 0 B (all clear)" in text
        assert "  b\\u202a\\u202b\\u202c\\u202d" in text  # the module table clips the escaped name at 29
    # Through a file and the command line, and in the HTML page (where a newline is no line, but the
    # bidirectional characters would reorder what is read).
    crafted.save(tmp_path / "crafted.json")
    plain.save(tmp_path / "plain.json")
    assert main(["report", str(tmp_path / "crafted.json")]) == 0
    out = capsys.readouterr().out
    assert main(["report", str(tmp_path / "plain.json")]) == 0
    assert len(out.splitlines()) == len(capsys.readouterr().out.splitlines())
    _inert(out)
    page = report_page(memprof.load(tmp_path / "crafted.json"))
    assert not set(page) & set(BIDI + SEPARATORS)
    assert "b\\u202a\\u202b\\u202c\\u202d\\u202e\\u2066\\u2067\\u2068\\u2069\\u200e\\u200f\\u061c\\u2028\\u2029" in page


def test_notes_errors_and_versions_cannot_forge_lines_of_a_report_or_a_diff(tmp_path, capsys):
    plain = full_trace()
    crafted = dataclasses.replace(
        plain, torch_version="2.13.0\nPeak 0 B (all clear)" + BIDI, notes=(f"a note{SEPARATORS}\nPeak 0 B",),
        error="RuntimeError: boom\rPeak 0 B" + BIDI, peak_module=FORGED,
        modules=plain.modules + (module(FORGED, "Linear", parameters=0, gradients=0, activations=0),),
        device=dataclasses.replace(plain.device, name="cpu\n" + BIDI))
    reference = dataclasses.replace(plain, torch_version="2.13.0x", notes=("a note",), error="RuntimeError: boom",
                                    peak_module="a",
                                    modules=plain.modules + (module("a", "Linear", parameters=0, gradients=0,
                                                                    activations=0),))
    text = memprof.Report(crafted).to_text()
    assert len(text.splitlines()) == len(memprof.Report(reference).to_text().splitlines())
    _inert(text)
    assert "torch 2.13.0\\nPeak 0 B (all clear)\\u202a" in text and "in a\\nPeak 0 B (all clear)" in text
    # memprof diff names both versions and the error in its notes, and the files' names as labels.
    paths = []
    for name, t in (("a\u202e.json", reference), ("b\n.json", crafted)):
        memprof.Report(t).save(tmp_path / name)
        paths.append(str(tmp_path / name))
    assert main(["diff", *paths]) == 0
    out = capsys.readouterr().out
    _inert(out)
    plain_paths = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    memprof.Report(reference).save(plain_paths[0])
    memprof.Report(dataclasses.replace(crafted, torch_version="2.13.0y", error="RuntimeError: boomy")).save(
        plain_paths[1])
    assert main(["diff", *plain_paths]) == 0
    assert len(out.splitlines()) == len(capsys.readouterr().out.splitlines())
    assert "torch versions differ (2.13.0x vs 2.13.0\\nPeak 0 B (all clear)\\u202a" in out


def test_an_oom_block_keeps_its_lines_in_the_html_page():
    # The page shows what was live at an OOM in a <pre> block, where a newline is a line.
    t = dataclasses.replace(full_trace(), oom=memprof.record.trace.OomRecord("CUDA out of memory\nPeak 0 B"),
                            live_at_error=cpu(weights=144), live_modules_at_error=((FORGED, 96),))
    page = report_html(t)
    pre = page[page.index("<pre"):page.index("</pre>")]
    assert "\nPeak 0 B" not in pre and "a\\nPeak 0 B (all clear)" in pre


# -- the standalone page stays under 2 MB ------------------------------------------------------------


def _page_bytes(t) -> int:
    return len(report_page(t).encode("utf-8"))


def test_a_long_exception_message_is_cut_with_a_marker(tmp_path):
    # A 3 MB message (a tensor printed into an exception) as the run's error, in a note and as an OOM.
    message = "RuntimeError: " + "x" * 3_000_000
    t = dataclasses.replace(full_trace(), error=message, notes=(message,), live_at_error=cpu(weights=144),
                            oom=memprof.record.trace.OomRecord(message))
    path = tmp_path / "report.html"
    memprof.Report(t).export_html(path)
    assert path.stat().st_size < 2 * 2**20
    page = path.read_text(encoding="utf-8")
    # 3,000,014 characters, 2,000 shown: the marker says how many more there are.
    assert page.count("RuntimeError: xxx") >= 2 and "… (2,998,014 more characters)" in page
    # The text report too: 1,000 characters of the error and of the note, the rest counted.
    text = str(memprof.Report(t))
    assert len(text) < 10_000 and text.count("… (2,999,014 more characters)") == 2


def test_a_trace_of_20000_kept_steps_makes_a_bounded_page():
    # 20,000 kept steps of three phases, a timeline sample in each, and a note per step: the page draws
    # a bounded timeline, the first and last phases, and the first notes. Breakdowns are frozen: the steps share
    # the nine distinct ones (building 200,000 took most of the test's time).
    w, wg, wa = cpu(weights=144), cpu(weights=144, gradients=144), cpu(weights=144, activations=96)
    forward_peaks = [cpu(weights=144, activations=96 + k) for k in range(7)]
    backward_peak = cpu(weights=144, gradients=144, activations=48)
    optimizer_peak = cpu(weights=144, gradients=144, temporaries=144)
    phases = []
    for s in range(20_000):
        phases += [phase(s, "forward", start=w, peak=forward_peaks[s % 7], end=wa),
                   phase(s, "backward", start=wa, peak=backward_peak, end=wg),
                   phase(s, "optimizer", start=wg, peak=optimizer_peak, end=wg)]
    timed = tuple(dataclasses.replace(p, start_us=3.0 * i, peak_us=3.0 * i + 1, end_us=3.0 * i + 2)
                  for i, p in enumerate(phases))
    samples = tuple(memprof.record.trace.Sample(i, s, memprof.Phase.FORWARD, f"layers.{s}", w, 9.0 * s + 1,
                                         "enter") for i, s in enumerate(range(20_000)))
    t = trace(phases=timed, timeline=samples, notes=tuple(f"step {s}: " + "n" * 100 for s in range(20_000)))
    assert len(t.steps) == 20_000
    page = report_page(t)
    size = len(page.encode("utf-8"))
    assert size < 2 * 2**20, size
    assert "19,950 more in report.trace.notes" in page


def test_a_page_is_bounded_for_a_file_the_loader_accepts(tmp_path):
    # The same bounds hold for what is read back from a file.
    data = full_trace().to_dict()
    data["error"] = "E" * 5_000_000
    data["modules"][1]["path"] = "p" * 5_000_000
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    assert _page_bytes(memprof.load(path).trace) < 2 * 2**20


@pytest.mark.parametrize("bad", ["\ud800", "\udfff tail"])
def test_a_live_trace_with_a_lone_surrogate_prints_and_saves(tmp_path, bad, capsys):
    # A model's own names can hold one (add_module takes any str): the report prints it escaped and
    # saves it (JSON escapes it), the loader reads it back as the replacement character.
    report = _profiled(_named(bad, "b"))
    print(report)
    assert "\\ud" in capsys.readouterr().out
    report.export_html(tmp_path / "r.html")
    report.save(tmp_path / "r.json")
    assert any("\ufffd" in m.path for m in memprof.load(tmp_path / "r.json").trace.modules)
