"""A profile and threads: the model trained in another thread, the profile ended in another thread.

Dispatch modes and saved-tensor hooks are per thread, so what another thread runs is not seen: every
figure that depends on it says "not measured" (per module too), and the note names the thread, once.
A profile ended from another thread removes everything it installed, the starting thread's dispatch
mode included, and raises as leaving its block there does, except over an error it records: that it
says in a warning.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C
from memprof.collect.dispatch import DispatchMode
from memprof.errors import InvalidArgumentError, MemprofWarning, ProfilerStateError

from helpers import hook_registry, weight_bytes
from models import MLP


# ------------------------------------------------------------------ the model trained in another thread


@pytest.mark.parametrize("mode", ["exact", "light"])
def test_a_model_trained_in_another_thread_has_no_per_module_figures_and_one_note(mode):
    model, x, y = MLP(), torch.randn(8, 32), torch.randint(0, 10, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with memprof.profile(model, opt, mode=mode) as prof:
        worker = threading.Thread(target=train)
        worker.start()
        worker.join()
    rep = prof.report()
    assert rep.peak[C.ACTIVATIONS] is None
    table = rep.modules()
    # What the modules saved, and their peaks, are not measured (not 0); their calls were seen.
    assert table["activations"].isna().all()
    assert all(m.own_activations is None for m in rep.trace.modules)
    for column in ("peak_forward", "peak_backward", "temporaries_forward", "temporaries_backward"):
        assert table[column].isna().all(), column
    assert table["calls"].to_dict() == {"<model>": 1, "fc1": 1, "act": 2, "fc2": 1, "fc3": 1}  # act runs twice
    assert table.loc["fc1", "parameters"] == 32 * 64 * 4 + 64 * 4
    # The text's module table says so too.
    text = str(rep)
    rows = [r for r in text[text.index("Top modules by saved activations"):text.index("Notes")].splitlines()[2:] if r]
    # Columns: 2 + module 30 + type 20 + params 11, then saved act 14 wide.
    assert len(rows) == 3 and all(row[63:77].strip() == "not measured" for row in rows), rows
    # One note, naming the thread; none blaming torch.compile.
    notes = rep.trace.notes
    assert sum("thread" in n for n in notes) == 1
    assert not any("torch.compile" in n for n in notes), notes


# ------------------------------------------------------------------ a profile ended in another thread


def _started_elsewhere_ended_here(end):
    """Start a profile in this thread, train, and end it with ``end(prof)`` in another thread; what that
    raised, and the profiler."""
    model, x = MLP(), torch.randn(8, 32)
    prof = memprof.profile(model)
    prof.__enter__()
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    raised = []

    def run():
        try:
            end(prof)
        except BaseException as exc:
            raised.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return model, x, prof, raised


def _memprof_modes():
    return [m for m in (torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack()))
            if isinstance(m, DispatchMode)]


def test_after_a_profile_ended_elsewhere_this_threads_ops_no_longer_pass_through_memprof(monkeypatch):
    depth = torch._C._len_torch_dispatch_stack()
    model, x, prof, raised = _started_elsewhere_ended_here(lambda p: p.stop())
    assert len(raised) == 1 and isinstance(raised[0], ProfilerStateError)
    seen = []
    passing = DispatchMode.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return passing(self, func, types, args, kwargs)

    monkeypatch.setattr(DispatchMode, "__torch_dispatch__", counting)
    y = torch.ones(3) + 1  # the first ops still reach the inert mode; it leaves when their outputs go
    del y
    seen.clear()
    z = (torch.ones(3) * 2).sum()
    assert seen == [] and _memprof_modes() == []
    assert torch._C._len_torch_dispatch_stack() == depth
    assert z.item() == 6.0
    assert prof.report().breakdown(0, "forward", "end")[C.WEIGHTS] == weight_bytes(model)


def test_stop_from_another_thread_raises_as_leaving_the_block_there_does_and_never_over_an_error():
    depth = torch._C._len_torch_dispatch_stack()
    # A plain stop() there: ProfilerStateError, as __exit__ without an exception.
    for end in (lambda p: p.stop(), lambda p: p.__exit__(None, None, None)):
        model, x, prof, raised = _started_elsewhere_ended_here(end)
        assert len(raised) == 1 and isinstance(raised[0], ProfilerStateError)
        assert "ended in another thread" in str(raised[0])
        assert any("ended in another thread" in n for n in prof.trace.notes)
    # Recording the user's exception there: nothing raised over it (a warning says it instead), and the record
    # says where it ended.
    err = ValueError("the user's")
    for end in (lambda p: p.stop(err), lambda p: p.__exit__(ValueError, err, None)):
        with pytest.warns(MemprofWarning, match="ended in another thread"):
            model, x, prof, raised = _started_elsewhere_ended_here(end)
        assert raised == []
        assert prof.trace.error == "ValueError: the user's"
        assert any("ended in another thread" in n for n in prof.trace.notes)
    before = hook_registry(model, tensors=[x])
    with memprof.profile(model) as again:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    assert again.report().breakdown(0, "forward", "end")[C.ACTIVATIONS] > 0
    after = hook_registry(model, tensors=[x])
    # The inert modes the ends in other threads left here are gone (the new profile's start pops them).
    assert after.pop(("global", "dispatch modes")) == depth
    before.pop(("global", "dispatch modes"))
    assert after == before


def test_stop_with_an_error_from_another_thread_ends_everything_and_warns_without_raising():
    # Raising in the handler that is about to re-raise the user's error would put memprof's in its place: the
    # thread rule a plain stop() raises is a warning here, and the record holds the error and the note.
    err = ValueError("the user's")
    for end in (lambda p: p.stop(err), lambda p: p.__exit__(ValueError, err, None)):
        with pytest.warns(MemprofWarning) as said:
            model, x, prof, raised = _started_elsewhere_ended_here(end)
        assert raised == [] and not prof.running
        assert {w.filename for w in said} == {__file__}  # the user's line that ended it
        assert [str(w.message) for w in said] == [
            "memprof: the profile was ended in another thread than the one that started it, with ValueError: the "
            "user's: everything it installed is removed and the error is in its record, but ops the starting thread "
            "ran meanwhile may be counted in part; end a profile in the thread that started it (nothing is raised "
            "here, so that your error stays the one raised)"]
        assert prof.trace.error == "ValueError: the user's"
        assert any("ended in another thread" in n for n in prof.trace.notes)
        before = hook_registry(model, tensors=[x])
        with memprof.profile(model) as again:  # its start pops the inert mode the end elsewhere left here
            model(x).sum().backward()
        model.zero_grad(set_to_none=True)
        assert again.report().breakdown(0, "forward", "end")[C.ACTIVATIONS] > 0
        after = hook_registry(model, tensors=[x])
        assert {k: v for k, v in after.items() if k[0] != "global"} == {
            k: v for k, v in before.items() if k[0] != "global"}


def test_stop_with_an_error_in_the_starting_thread_neither_raises_nor_warns(recwarn):
    model, x = MLP(), torch.randn(8, 32)
    prof = memprof.profile(model).start()
    model(x).sum().backward()
    prof.stop(KeyError("k"))
    assert prof.trace.error == "KeyError: 'k'" and not [w for w in recwarn if w.category is MemprofWarning]


def test_stop_given_no_exception_ends_the_profile_then_refuses_it():
    # From an except block: stop(sys.exc_info()) by mistake. The profile must not stay installed behind it.
    model, x = MLP(), torch.randn(8, 32)
    before = hook_registry(model, tensors=[x])
    depth = torch._C._len_torch_dispatch_stack()
    prof = memprof.profile(model).start()
    model(x).sum().backward()
    with pytest.raises(InvalidArgumentError) as info:
        prof.stop(("ValueError", "boom"))
    assert str(info.value) == ("stop(error=...) takes the exception that ended the run, got tuple; the profile was "
                               "stopped without recording it")
    assert not prof.running and prof.trace.error is None
    assert torch._C._len_torch_dispatch_stack() == depth
    model.zero_grad(set_to_none=True)
    assert hook_registry(model, tensors=[x]) == before
    # From another thread: the thread rule comes with it, as its cause.
    model, x, prof, raised = _started_elsewhere_ended_here(lambda p: p.stop("boom"))
    assert len(raised) == 1 and isinstance(raised[0], InvalidArgumentError) and not prof.running
    assert isinstance(raised[0].__cause__, ProfilerStateError)
    # What that end could not take off this thread (its inert dispatch mode, its saved-tensor hooks: both per
    # thread) goes at the next profile's start here, and nothing is left for the code after it.
    with memprof.profile(model):
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    assert hook_registry(model, tensors=[x]) == before


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def test_training_in_another_thread_is_reported_as_not_measured():
    model, x = _mlp(), torch.randn(8, 16)
    before = hook_registry(model, tensors=[x])
    with memprof.profile(model) as prof:
        worker = threading.Thread(target=lambda: model(x).sum().backward())
        worker.start()
        worker.join()
    model.zero_grad(set_to_none=True)
    rep = prof.report()
    for category in (C.ACTIVATIONS, C.INPUTS, C.TEMPORARIES):
        assert rep.peak[category] is None
    assert rep.peak.total is None and rep.peak[C.WEIGHTS] == weight_bytes(model)
    assert any("thread(s) other than the one that started" in n for n in rep.trace.notes)
    assert hook_registry(model, tensors=[x]) == before


def test_a_profile_ended_from_another_thread_cleans_up_and_says_so():
    model, x = _mlp(), torch.randn(8, 16)
    before = hook_registry(model)
    prof = memprof.profile(model)
    prof.__enter__()
    model(x).sum().backward()
    errors = []

    def end():
        try:
            prof.__exit__(None, None, None)
        except ProfilerStateError as exc:
            errors.append(str(exc))

    worker = threading.Thread(target=end)
    worker.start()
    worker.join()
    assert errors and "ended in another thread" in errors[0]
    assert prof.report().breakdown(0, "forward", "end")[C.WEIGHTS] == weight_bytes(model)
    model.zero_grad(set_to_none=True)
    # Global hooks are gone at once; this thread's inert dispatch mode goes with the next profile here.
    after = hook_registry(model)
    assert {k: v for k, v in after.items() if k[0] != "global"} == {
        k: v for k, v in before.items() if k[0] != "global"}
    with memprof.profile(model) as again:
        model(x).sum().backward()
    assert again.report().breakdown(0, "forward", "end")[C.ACTIVATIONS] > 0
    model.zero_grad(set_to_none=True)
    assert hook_registry(model) == before


def _thread_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def _profiled_loop(model, x):
    # Not tests/training.py's loop: no optimizer, and model.zero_grad() between backwards, so each step
    # starts with the gradients freed as an optimizer's zero_grad would.
    with memprof.profile(model) as prof:
        for _ in range(5):
            model(x).sum().backward()
            model.zero_grad()
    return prof.report()


def test_another_thread_is_not_attributed():
    x = torch.randn(32, 64)
    solo = _profiled_loop(_thread_model(), x)

    other = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    other_opt = torch.optim.Adam(other.parameters())
    stop, started = threading.Event(), threading.Event()
    errors = []

    def work():
        try:
            y = torch.randn(256, 64)
            while not stop.is_set():
                big = torch.empty(1000, 1000)  # noqa: F841  4 MB the profile must never see
                other(y).sum().backward()
                other_opt.step()
                other_opt.zero_grad()
                started.set()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            started.set()

    th = threading.Thread(target=work)
    th.start()
    started.wait(30)
    try:
        together = _profiled_loop(_thread_model(), x)
    finally:
        stop.set()
        th.join()
    assert errors == []
    assert together.trace.steps == solo.trace.steps  # every phase's start, peak and end, exactly
    assert together.peak == solo.peak
    assert together.trace.optimizer is None  # the other thread's Adam is not ours
