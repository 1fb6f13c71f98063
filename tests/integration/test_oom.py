"""OOM forensics: profile(..., oom_dump=...) on CPU, a raised torch.OutOfMemoryError standing in for
the device; the CUDA observer path runs only where a GPU is (tests/integration/test_gpu.py)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import tempfile
import warnings

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import memprof
from memprof.vocabulary import Category as C
from memprof.cli import main
from memprof.errors import InvalidArgumentError
from tests.helpers import assert_sums, hooks_left, json_strings, weight_bytes


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def _oom_run(tmp_path, err):
    return _oom_run_into(tmp_path / "dumps", err)


def _oom_run_into(folder, err=None):
    err = err if err is not None else torch.OutOfMemoryError("CUDA out of memory (simulated)")
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(type(err)) as info:
        with memprof.profile(model, opt, oom_dump=folder) as prof:
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
            out = model(torch.randn(4, 32))  # noqa: F841 - live at the OOM, as a real forward's are
            raise err
    return info.value, prof, model


def test_an_oom_writes_a_dump_and_propagates_unchanged(tmp_path):
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                 "of 79.15 GiB of which 1.23 GiB is free.")
    raised, prof, model = _oom_run(tmp_path, err)
    assert raised is err
    assert hooks_left(model) == []
    files = glob.glob(str(tmp_path / "dumps" / "*"))
    assert len(files) == 1 and files[0] == prof.oom_dump_path
    assert re.fullmatch(rf"memprof-oom-0-{os.getpid()}-\d{{8}}-\d{{6}}-\d{{6}}\.json", os.path.basename(files[0]))
    dumped = memprof.load(files[0]).trace
    assert dumped.oom is not None and dumped.oom.message.startswith("OutOfMemoryError: CUDA out of memory")
    # Rounded sizes in a message are not exact: memprof keeps none of them rather than a wrong figure.
    assert dumped.oom.requested is None and dumped.oom.device_free is None
    live = dumped.live_at_error
    assert live[C.WEIGHTS] == weight_bytes(model)  # (32*64 + 64 + 64*8 + 8) * 4 bytes
    assert live[C.ACTIVATIONS] > 0 and dumped.live_modules_at_error


def test_the_cpu_allocators_request_is_read_to_the_byte(tmp_path):
    model = _model()
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        with memprof.profile(model, oom_dump=tmp_path) as prof:
            model(torch.randn(4, 32)).sum().backward()
            torch.empty(2**60, dtype=torch.uint8)  # more than any machine has
    oom = memprof.load(prof.oom_dump_path).trace.oom
    assert oom.requested == 2**60


def test_memprof_report_leads_with_what_was_live(tmp_path, capsys):
    _, prof, _ = _oom_run(tmp_path, torch.OutOfMemoryError("CUDA out of memory (simulated)"))
    assert main(["report", prof.oom_dump_path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "OUT OF MEMORY: OutOfMemoryError: CUDA out of memory (simulated)"
    assert out[1].startswith("What was live at the OOM: ")
    assert "Largest levers:" in out and any(line.startswith("  - largest category: ") for line in out)


def test_an_error_that_is_not_an_oom_writes_nothing(tmp_path):
    model = _model()
    with pytest.raises(ValueError):
        with memprof.profile(model, oom_dump=tmp_path / "d") as prof:
            model(torch.randn(4, 32))
            raise ValueError("not memory")
    assert os.listdir(tmp_path / "d") == [] and prof.oom_dump_path is None
    assert prof.report().trace.oom is None


def test_an_error_whose_str_raises_propagates_unchanged_and_is_named(tmp_path):
    class Unprintable(ValueError):
        def __str__(self):
            raise RuntimeError("no text")

    model = _model()
    err = Unprintable()
    with pytest.raises(Unprintable) as info:
        with memprof.profile(model, oom_dump=tmp_path / "d") as prof:
            model(torch.randn(4, 32))
            raise err
    assert info.value is err and hooks_left(model) == []
    assert prof.report().trace.error == "Unprintable: <its message could not be read: str() raised RuntimeError>"
    assert os.listdir(tmp_path / "d") == []  # not an out-of-memory error


def test_without_oom_dump_the_report_still_names_the_oom(tmp_path):
    model = _model()
    with pytest.raises(MemoryError):
        with memprof.profile(model) as prof:
            model(torch.randn(4, 32))
            raise MemoryError()
    assert prof.report().trace.oom.message == "MemoryError: MemoryError"
    assert str(prof.report()).startswith("OUT OF MEMORY")


def test_an_unwritable_dump_folder_is_refused_at_block_entry(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    model = _model()
    with pytest.raises(InvalidArgumentError, match="is a file, not a folder"):
        memprof.profile(model, oom_dump=blocker)
    with pytest.raises(InvalidArgumentError, match="cannot write there"):
        memprof.profile(model, oom_dump=blocker / "below")
    with pytest.raises(InvalidArgumentError, match="folder path"):
        memprof.profile(model, oom_dump=3)
    assert hooks_left(model) == []


def test_a_failed_write_is_a_warning_and_the_oom_still_propagates(tmp_path, monkeypatch):
    from memprof.record import files

    def fail(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_text_atomic", fail)
    err = torch.OutOfMemoryError("out of memory")
    with pytest.warns(UserWarning, match="could not write its OOM dump"):
        raised, prof, model = _oom_run(tmp_path, err)
    assert raised is err and prof.oom_dump_path is None
    assert prof.report().trace.oom is not None
    assert hooks_left(model) == []


def test_a_snapshot_taken_at_the_oom_is_attributed_by_address(tmp_path):
    """A CPU stand-in for torch.cuda.memory._snapshot(): blocks at the addresses of the model's
    parameters, of the optimizer's state and of a workspace memprof never saw."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(torch.OutOfMemoryError):
        with memprof.profile(model, opt, oom_dump=tmp_path) as prof:
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    params = [p.untyped_storage() for p in model.parameters()]
    states = [v.untyped_storage() for s in opt.state.values() for v in s.values() if v.dim() > 0]
    workspace = torch.empty(1000, dtype=torch.uint8).untyped_storage()
    blocks = [{"address": s.data_ptr(), "size": s.nbytes(), "requested_size": s.nbytes(),
               "state": "active_allocated", "frames": []} for s in params + states + [workspace]]
    blocks.append({"address": 1, "size": 64, "state": "inactive"})
    snapshot = {"segments": [{"device": 0, "address": 0, "total_size": 0, "blocks": blocks}], "device_traces": [[]]}
    frame = memprof.load(prof.oom_dump_path).attribute_snapshot(snapshot)
    assert len(frame) == len(params) + len(states) + 1  # inactive blocks are not listed
    by_cat = frame.groupby("category")["size"].sum().to_dict()
    # weights: (32*64 + 64 + 64*8 + 8) * 4 = 2,632 * 4 = 10,528 bytes; AdamW's exp_avg and exp_avg_sq:
    # twice that (its scalar step counters are 0-dim tensors, left out of the stand-in)
    assert by_cat == {"weights": 10_528, "optimizer_states": 2 * 10_528, "not seen by memprof": 1000}
    assert frame[frame.category == "weights"].module.isna().all()  # weights existed before any module ran


def test_attributing_needs_a_trace_taken_at_an_error(tmp_path):
    from memprof.errors import NotMeasuredError

    model = _model()
    with memprof.profile(model) as prof:
        model(torch.randn(4, 32))
    with pytest.raises(NotMeasuredError, match="oom_dump="):
        prof.report().attribute_snapshot({"segments": []})


def test_an_oom_raised_from_another_exception_is_an_oom(tmp_path):
    model = _model()
    with pytest.raises(RuntimeError, match="the framework's wrapper"):
        with memprof.profile(model, oom_dump=tmp_path) as prof:
            model(torch.randn(4, 32))
            try:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            except torch.OutOfMemoryError as oom:
                raise RuntimeError("the framework's wrapper") from oom
    assert prof.oom_dump_path is not None and prof.report().trace.oom is not None


def test_an_oom_in_a_step_the_schedule_does_not_watch_is_not_given_false_figures(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(torch.OutOfMemoryError):
        with memprof.profile(model, opt, oom_dump=tmp_path, schedule=memprof.schedule(active=1, repeat=1)) as prof:
            for step in range(3):
                if step == 2:
                    raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
                model(torch.randn(4, 32)).sum().backward()
                opt.step()
                opt.zero_grad()
    trace = memprof.load(prof.oom_dump_path).trace
    assert trace.live_at_error is None and trace.live_storages_at_error == ()
    text = str(memprof.load(prof.oom_dump_path)).splitlines()
    assert text[1] == "What was live at the OOM: not measured (see the notes)"
    assert any("did not watch" in n for n in trace.notes)


def test_an_oom_caught_inside_the_block_leaves_nothing_behind(tmp_path):
    """The CUDA observer's path, driven by hand as torch's allocator would call it (no GPU here)."""
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA snapshot can be taken on this machine
        with memprof.profile(model, oom_dump=tmp_path) as prof:
            model(torch.randn(4, 32))
            prof.oom_dump.on_cuda_oom(0, 123_456, 789)  # an OOM the user catches and recovers from
            model(torch.randn(4, 32))
    assert prof.report().trace.oom is None and prof.report().trace.live_at_error is None
    assert os.listdir(tmp_path) == []
    # A later OOM that leaves the block is reported with its own figures, not the caught one's.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(torch.OutOfMemoryError):
            with memprof.profile(model, oom_dump=tmp_path) as prof:
                prof.oom_dump.on_cuda_oom(0, 111, 1)
                model(torch.randn(4, 32))
                prof.oom_dump.on_cuda_oom(0, 222, 2)
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    oom = memprof.load(prof.oom_dump_path).trace.oom
    assert (oom.requested, oom.device_free) == (222, 2)


def test_bad_snapshots_are_refused_with_the_fix(tmp_path):
    _, prof, _ = _oom_run(tmp_path, torch.OutOfMemoryError("out of memory"))
    report = memprof.load(prof.oom_dump_path)
    for bad in ({"segments": [1]}, {"segments": [{"blocks": [None]}]},
                {"segments": [{"address": "x", "blocks": [{"size": "y", "state": "active_allocated"}]}]}, [1]):
        with pytest.raises(InvalidArgumentError, match="expected a memory snapshot"):
            report.attribute_snapshot(bad)
    with pytest.raises(InvalidArgumentError, match="no snapshot at"):
        report.attribute_snapshot(tmp_path / "missing.pickle")
    (tmp_path / "junk.pickle").write_bytes(b"not a pickle")
    with pytest.raises(InvalidArgumentError, match="not a pickled memory snapshot"):
        report.attribute_snapshot(tmp_path / "junk.pickle")


def test_the_cli_keeps_the_text_and_never_overwrites_its_input(tmp_path, capsys):
    model = _model()
    with pytest.raises(torch.OutOfMemoryError):
        with memprof.profile(model, oom_dump=tmp_path / "d") as prof:
            raise torch.OutOfMemoryError("CUDA out of memory (before any phase)")
    dump = prof.oom_dump_path
    # An OOM before any phase still holds what was live: the text and the HTML page are written.
    assert main(["report", dump, "--html", str(tmp_path / "oom.html")]) == 0
    assert capsys.readouterr().out.startswith("OUT OF MEMORY")
    assert (tmp_path / "oom.html").exists()
    before = open(dump).read()
    assert main(["export", dump, "--chrome", dump]) == 1
    assert "is the trace being read" in capsys.readouterr().err and open(dump).read() == before
    assert main(["export", dump, "--chrome", str(tmp_path / "x"), "--html", str(tmp_path / "x")]) == 1
    assert "same file" in capsys.readouterr().err and not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------- every dump loads


class _StrGives(MemoryError):
    """An OOM whose ``__str__`` returns ``value`` (a non-string, a str subclass), or raises it."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def __str__(self):
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


class _OddStr(str):
    def strip(self, *args):
        raise AssertionError("memprof used the subclass's own methods")


def _framework_wrapper(message):
    try:
        raise torch.OutOfMemoryError(message)
    except torch.OutOfMemoryError as oom:
        try:
            raise RuntimeError(f"the framework's wrapper: {message}") from oom
        except RuntimeError as wrapper:
            return wrapper


# Characters an exception's text can hold that a file or a reader may choke on: lone surrogates (no
# UTF-8 form), NUL and other controls, a terminal escape, bidi overrides, a byte order mark, astral ones.
_ODD = ["\ud800", "\udcff", "\udfff\ud800", "\x00", "\x1b[2J", "\x07", "\r", "\n", "\u202e", "\ufeff",
        "\U0001f600", "\uffff", "\x85"]
_pieces = st.one_of(
    st.text(max_size=12), st.sampled_from(_ODD),
    # The CPU allocator's phrase, with numbers no allocation can have, and past int()'s 4,300 digits.
    st.integers(0, 10**30).map(lambda n: f" you tried to allocate {n} bytes "),
    st.integers(4000, 6000).map(lambda n: f" tried to allocate {'9' * n} bytes"),
    st.sampled_from([5_000, 300_000]).map(lambda n: "x" * n),
)
_messages = st.lists(_pieces, max_size=5).map("".join)
_odd_exceptions = st.one_of(
    _messages.map(torch.OutOfMemoryError),
    _messages.map(MemoryError),
    _messages.map(lambda m: RuntimeError(f"CUDA out of memory. {m}")),
    _messages.map(lambda m: RuntimeError(f"DefaultCPUAllocator: can't allocate memory: {m}")),
    _messages.map(_framework_wrapper),
    st.sampled_from([5, None, b"bytes", 2.5, ["a list"]]).map(_StrGives),
    _messages.map(lambda m: _StrGives(_OddStr(m))),
    st.sampled_from([ValueError("in __str__"), RecursionError(), UnicodeEncodeError("utf-8", "\ud800", 0, 1, "x"),
                     KeyError("k")]).map(_StrGives),
)
_module_names = st.lists(st.one_of(st.sampled_from(_ODD), st.characters()), min_size=1, max_size=8).map(
    "".join).filter(lambda n: "." not in n)


def _breakdowns(value):
    """Every Breakdown inside a record."""
    if isinstance(value, memprof.Breakdown):
        yield value
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _breakdowns(getattr(value, f.name))
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _breakdowns(v)


def _no_constant(name):
    raise AssertionError(f"{name} in a dump: not JSON")


_ALLOCATOR = "DefaultCPUAllocator: can't allocate memory: you tried to allocate {} bytes"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The cases that broke it, each run every time: __str__ raising or returning an int (the profile's exit
# raised that error instead of the OOM), a request over 2**64 bytes, or of 2**63 (written, then refused by load), a
# number int() refuses (raised in the exit), a lone surrogate (escaped, a string no strict reader takes).
@example(exc=_StrGives(ValueError("in __str__")), name="lin", where="forward")
@example(exc=_StrGives(5), name="lin", where="backward")
@example(exc=RuntimeError(_ALLOCATOR.format(10**23)), name="lin", where="step")
@example(exc=RuntimeError(_ALLOCATOR.format("9" * 5000)), name="lin", where="forward")
@example(exc=torch.OutOfMemoryError(" you tried to allocate 9223372036854775808 bytes "), name="lin", where="forward")
@example(exc=torch.OutOfMemoryError("CUDA out of memory \ud800"), name="lin\udcff", where="forward")
@given(exc=_odd_exceptions, name=_module_names, where=st.sampled_from(["forward", "backward", "step"]))
def test_every_oom_dump_loads_whatever_the_exception_says(exc, name, where):
    model = nn.Sequential()
    model.add_module(name, nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with tempfile.TemporaryDirectory() as folder:
        with pytest.raises(BaseException) as info:
            with memprof.profile(model, opt, oom_dump=folder) as prof:
                out = model(torch.randn(2, 4))
                if where != "forward":
                    out.sum().backward()
                if where == "step":
                    opt.step()
                raise exc
        assert info.value is exc and hooks_left(model) == []  # the user's own exception, nothing left behind
        [dump] = os.listdir(folder)
        path = os.path.join(folder, dump)
        assert path == prof.oom_dump_path
        text = open(path, "rb").read().decode("utf-8")  # strict: valid UTF-8
        data = json.loads(text, parse_constant=_no_constant)
        assert not [s for s in json_strings(data) if any("\ud800" <= c <= "\udfff" for c in s)]
        report = memprof.load(path)
    trace = report.trace
    assert trace.oom.message.startswith(f"{type(exc).__name__}: ") and len(trace.oom.message) < 4100
    assert "\n" not in trace.oom.message and len(trace.error) < 4100
    assert trace.oom.requested is None or trace.oom.requested <= 2**63 - 1  # what a trace may hold (record.checks)
    found = list(_breakdowns(trace))
    assert len(found) > 3  # start, peak, end, what was live, and each phase's
    for bd in found:
        assert_sums(bd)
    assert trace.live_at_error[C.WEIGHTS] == weight_bytes(model)  # (4*4 + 4) * 4 = 80 bytes
    str(report)  # and it prints


def test_a_dump_folder_given_as_a_link_is_written_through_it(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "dumps").symlink_to("real")
    _, prof, _ = _oom_run_into(tmp_path / "dumps")
    assert (tmp_path / "dumps").is_symlink()
    [name] = os.listdir(tmp_path / "real")
    assert memprof.load(tmp_path / "real" / name).trace.oom is not None


def test_a_failed_write_under_warnings_as_errors_still_lets_the_oom_through(tmp_path, monkeypatch):
    from memprof.record import files

    def fail(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_text_atomic", fail)
    err = torch.OutOfMemoryError("out of memory")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # -W error: a warning is raised
        raised, prof, model = _oom_run(tmp_path, err)
    assert raised is err and prof.oom_dump_path is None and hooks_left(model) == []
