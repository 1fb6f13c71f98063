"""Public API: errors that name the fix, hook hygiene, light mode, the record."""

import gc
import json
import weakref

import pytest
import torch
import torch.nn.functional as F

import memprof
from memprof import Category as C
from memprof.errors import (
    InvalidArgumentError,
    MemprofError,
    NotMeasuredError,
    ProfilerStateError,
    SizeParseError,
    TraceFormatError,
    UnknownNameError,
)

from helpers import hooks_left, weight_bytes
from models import MLP


def run_step(model, opt=None):
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    F.cross_entropy(model(x), y).backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()


# -- errors -------------------------------------------------------------------


def test_not_a_module():
    with pytest.raises(InvalidArgumentError, match="torch.nn.Module"):
        memprof.profile("model")


def test_not_an_optimizer():
    with pytest.raises(InvalidArgumentError, match="torch.optim.Optimizer"):
        memprof.profile(MLP(), optimizer=object())


def test_optimizer_of_another_model():
    other = MLP()
    with pytest.raises(InvalidArgumentError, match="not the model's"):
        memprof.profile(MLP(), torch.optim.SGD(other.parameters(), lr=0.1))


def test_unknown_mode():
    with pytest.raises(UnknownNameError, match="exact, light, auto"):
        memprof.profile(MLP(), mode="precise")


def test_the_former_word_full_is_refused_with_its_new_name():
    with pytest.raises(UnknownNameError, match=r"mode 'full' is now called 'exact'.*mode='exact'"):
        memprof.profile(MLP(), mode="full")


def test_meta_model_refused():
    with torch.device("meta"):
        model = MLP()
    with pytest.raises(InvalidArgumentError, match="meta device"):
        memprof.profile(model)


def test_nesting_on_the_same_model_is_refused():
    model = MLP()
    with memprof.profile(model):
        with pytest.raises(ProfilerStateError, match="already active on this model"):
            with memprof.profile(model):
                pass
    assert hooks_left(model) == []


def test_profiler_is_single_use_and_report_waits_for_the_end():
    model = MLP()
    prof = memprof.profile(model)
    with pytest.raises(ProfilerStateError, match="nothing was profiled yet"):
        prof.report()
    with prof:
        with pytest.raises(ProfilerStateError, match="still running"):
            prof.report()
        run_step(model)
    with pytest.raises(ProfilerStateError, match="single-use"):
        with prof:
            pass


def test_every_error_is_a_memprof_error():
    for cls in (InvalidArgumentError, ProfilerStateError, UnknownNameError, SizeParseError,
                NotMeasuredError, TraceFormatError):
        assert issubclass(cls, MemprofError)


def test_report_at_refuses_unknown_names_and_steps():
    model = MLP()
    with memprof.profile(model) as prof:
        run_step(model)
    rep = prof.report()
    with pytest.raises(UnknownNameError, match="unknown phase 'fwd'"):
        rep.breakdown(0, "fwd")
    with pytest.raises(InvalidArgumentError, match="out of range"):
        rep.breakdown(5, "forward")
    with pytest.raises(NotMeasuredError, match="no optimizer phase"):
        rep.breakdown(0, "optimizer")
    with pytest.raises(UnknownNameError, match="unknown category"):
        rep.peak["weight"]
    assert rep.breakdown(-1, memprof.Phase.FORWARD) == rep.breakdown(0, "forward")


# -- hooks --------------------------------------------------------------------


def test_no_hook_left_after_exit():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.profile(model, opt):
        run_step(model, opt)
    assert hooks_left(model) == []


def test_exception_propagates_unchanged_and_partial_trace_survives():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Boom(RuntimeError):
        pass

    err = Boom("CUDA out of memory (simulated)")
    with pytest.raises(Boom) as info:
        with memprof.profile(model, opt) as prof:
            run_step(model, opt)
            out = model(torch.randn(8, 32))
            raise err
    assert info.value is err
    assert hooks_left(model) == []
    rep = prof.report()
    assert rep.num_steps == 2  # the finished step and the interrupted forward
    assert rep.trace.error == "Boom: CUDA out of memory (simulated)"
    live = rep.trace.live_at_error
    assert live[C.WEIGHTS] == weight_bytes(model)
    assert live[C.ACTIVATIONS] > 0  # the interrupted forward's saved tensors were live
    # An out-of-memory message makes it an OOM: the report leads with what was live then.
    assert str(rep).startswith("OUT OF MEMORY: Boom: CUDA out of memory (simulated)\nWhat was live at the OOM")
    assert rep.trace.oom is not None and rep.trace.oom.requested is None  # the message gives no exact size
    del out


def test_exception_inside_forward_removes_hooks():
    model = MLP()
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        with memprof.profile(model):
            model(torch.randn(8, 31))
    assert hooks_left(model) == []


def test_nothing_user_owned_is_kept_alive():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 32)
    with memprof.profile(model, opt) as prof:
        F.cross_entropy(model(x), torch.randint(0, 10, (8,))).backward()
        opt.step()
    refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(x)] + [weakref.ref(p) for p in model.parameters()]
    rep = prof.report()
    del model, opt, x
    gc.collect()
    assert all(r() is None for r in refs)
    assert rep.peak.total > 0  # the report outlives what it measured


def test_results_identical_with_and_without_memprof():
    def train(profile):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.AdamW(model.parameters())
        g = torch.Generator().manual_seed(5)
        losses = []
        ctx = memprof.profile(model, opt) if profile else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t)
        with ctx:
            for _ in range(3):
                x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()]

    l0, p0 = train(False)
    l1, p1 = train(True)
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))


# -- light mode on CPU ----------------------------------------------------------


def test_light_mode_on_cpu_says_not_measured():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt, mode="light") as prof:
        run_step(model, opt)
        run_step(model, opt)
    rep = prof.report()
    assert rep.trace.mode == "light"
    end = rep.breakdown(1, "optimizer", "end")
    assert end[C.TEMPORARIES] is None and end.total is None
    assert end[C.ALLOCATOR_OVERHEAD] is None
    # What light mode does measure is exact: model states come from the objects.
    assert end[C.WEIGHTS] == weight_bytes(model)
    assert end[C.OPTIMIZER_STATES] == 2 * weight_bytes(model) + 4 * 6  # 6 parameters, 4-byte steps
    assert rep.breakdown(1, "forward", "end")[C.ACTIVATIONS] > 0
    text = str(rep)
    assert "not measured" in text
    assert "temporaries           not measured" in text.replace("  not", " not") or "not measured" in text
    frame = rep.phases()
    assert frame["temporaries"].isna().all()
    assert any("light mode on CPU" in n for n in rep.trace.notes)


# -- the record ---------------------------------------------------------------


def test_trace_is_frozen_and_round_trips_through_json(tmp_path):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with memprof.profile(model, opt) as prof:
        run_step(model, opt)
        run_step(model, opt)
    rep = prof.report()
    with pytest.raises(AttributeError):
        rep.trace.mode = "light"
    path = tmp_path / "t.json"
    rep.save(path)
    loaded = memprof.load(path)
    assert loaded.trace == rep.trace
    assert str(loaded) == str(rep)
    assert json.loads(path.read_text())["schema_version"] == memprof.record.trace.SCHEMA_VERSION


def test_load_refuses_foreign_newer_and_corrupt_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(TraceFormatError, match="not valid JSON"):
        memprof.load(p)
    p.write_text(json.dumps({"hello": 1}))
    with pytest.raises(TraceFormatError, match="not a memprof trace"):
        memprof.load(p)
    p.write_text(json.dumps({"format": "memprof.trace", "schema_version": 999}))
    with pytest.raises(TraceFormatError, match="newer"):
        memprof.load(p)
    p.write_text(json.dumps({"format": "memprof.trace", "schema_version": 1, "mode": "full"}))
    with pytest.raises(TraceFormatError, match="corrupt"):
        memprof.load(p)


def test_tables_have_stable_columns():
    model = MLP()
    with memprof.profile(model) as prof:
        run_step(model)
    rep = prof.report()
    phases = rep.phases()
    assert list(phases.columns[:7]) == ["step", "phase", "occurrence", "start", "peak", "end", "ops"]
    assert [c.value for c in C] == list(phases.columns[7:])
    mods = rep.modules()
    assert mods.index.name == "path"
    assert {"fc1", "fc2", "fc3", "<model>"} <= set(mods.index)
    # fc1: 32*64 + 64 = 2112 params * 4 B
    assert mods.loc["fc1", "parameters"] == 2112 * 4
    assert mods.loc["<model>", "parameters"] == weight_bytes(model)
    # Inside the model: two ReLU results of 8 x 64 fp32 (each also fc2's / fc3's saved input) = 2 * 2048.
    assert mods.loc["<model>", "activations"] == 4096
    # The loss adds its log-softmax 8*10*4 = 320, total_weight 4, and the int64 targets 8*8 = 64
    # (created inside the profile, so saved activations rather than inputs).
    assert rep.breakdown(0, "forward", "end")[C.ACTIVATIONS] == 4096 + 320 + 4 + 64


def test_to_frame_is_the_phase_table():
    model = MLP()
    with memprof.profile(model) as prof:
        run_step(model)
    rep = prof.report()
    assert rep.to_frame().equals(rep.phases())
