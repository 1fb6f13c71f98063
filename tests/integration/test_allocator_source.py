"""source="allocator" and the snapshot labels, on CPU: a stand-in for the CUDA caching allocator's history
(``_allocator_backend``) receives the events a test emits at known moments of a real training step, as torch's
allocator would record them (trace entries with the metadata string current when each is recorded)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import memprof
from memprof.collect import allocator_history
from memprof.collect.allocator_history import AllocatorHistory
from memprof.collect.profiler import Profiler
from memprof.errors import InvalidArgumentError

from allocator_stand_in import FakeAllocator
from helpers import hook_registry, optimizer_state_bytes


class Emit(nn.Module):
    """A layer whose forward makes (and frees) a 1000-byte temporary at address 16, as the allocator records."""

    def __init__(self, fake: FakeAllocator) -> None:
        super().__init__()
        self.fake = fake
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.fake.emit("alloc", 16, 1000)
        self.fake.emit("free_requested", 16, 1000)
        return self.lin(x)


@pytest.fixture
def stand_in(monkeypatch):
    """Every profile's device gets the stand-in ``fake.backend`` as its allocator history."""

    def use(fake: "FakeAllocator | None") -> None:
        monkeypatch.setattr(allocator_history, "backend_for", lambda device: fake)

    return use


def one_step(fake: FakeAllocator, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(Emit(fake))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(2, 4)
    w = model[0].lin.weight

    def in_backward(g):
        fake.emit("alloc", 32, 3000)  # a temporary of backward
        fake.emit("free_requested", 32, 3000)
        return g

    def state_made(o, args, kwargs):  # still inside the optimizer phase (per-optimizer post hooks run first)
        st = o.state[w]["exp_avg"].untyped_storage()
        fake.emit("alloc", st.data_ptr(), st.nbytes())

    opt.register_step_post_hook(state_made)
    prof = Profiler(model, opt, **kw)
    with prof:
        handle = w.register_hook(in_backward)  # the weight's gradient: inside the backward phase
        model(x).sum().backward()
        handle.remove()
        opt.step()
    return prof, model, opt


def test_each_phase_is_reduced_from_the_events_recorded_in_it(stand_in) -> None:
    fake = FakeAllocator()
    stand_in(fake)
    prof, model, opt = one_step(fake, source="allocator")
    recs = {(r.step, r.phase): r.window for r in prof.allocator_phases}
    assert [(r.step, r.phase) for r in prof.allocator_phases][:3] == [(0, "forward"), (0, "backward"),
                                                                      (0, "optimizer")]
    # The weights were live before the first window: Linear(4, 4) holds 16 + 4 floats = 80 bytes.
    weights = (16 + 4) * 4
    fwd, bwd, opt_w = recs[(0, "forward")], recs[(0, "backward")], recs[(0, "optimizer")]
    assert fwd.start.total == weights and fwd.start["weights"] == weights
    # The stand-in records no event for the step's real tensors: each counts from the first window that knows
    # it (as a storage made before recording would), so the forward ends where the dispatch mode's does (later
    # windows keep what the real run freed: the stand-in records no free of it either).
    ends = {(p.step, p.phase.value): p.end for s in prof.trace.steps for p in s.phases}
    assert fwd.end == ends[(0, "forward")]
    # forward: the 1000-byte temporary is live at the peak, freed by the end
    assert fwd.peak.total - fwd.end.total == 1000 and fwd.peak["temporaries"] - fwd.end["temporaries"] == 1000
    assert fwd.peak_time_us == next(e["time_us"] for e in fake.seen if e["addr"] == 16)
    # backward: the 3000-byte temporary
    assert bwd.peak.total - bwd.end.total == 3000 and bwd.peak["temporaries"] - bwd.end["temporaries"] == 3000
    # optimizer: exp_avg of the weight, allocated at the address the optimizer's state has, is optimizer state
    # (the hooks know it), and the optimizer's state at the end is Adam's: exp_avg and exp_avg_sq of the weight
    # (16 floats each) and of the bias (4 floats each), and two 4-byte step counts = 2 * 64 + 2 * 16 + 2 * 4
    exp_avg = opt.state[model[0].lin.weight]["exp_avg"].untyped_storage().data_ptr()
    assert prof.collectors.allocator.live.blocks[exp_avg] == [64, "optimizer_states"]
    assert opt_w.end["optimizer_states"] == optimizer_state_bytes(opt) == 2 * 64 + 2 * 16 + 2 * 4
    # memprof's own recording: started without stacks and bounded, cleared at each drain, stopped at the end
    assert fake.calls[0][0] == "all" and fake.calls[0][1]["context"] is None
    assert fake.calls[0][1]["max_entries"] == AllocatorHistory(fake, 0).max_entries
    assert fake.calls[-1] == (None, {}) and not fake.on
    assert any("source='allocator'" in n for n in prof.trace.notes)


def test_the_labels_follow_phase_step_and_module_and_the_previous_one_comes_back(stand_in) -> None:
    fake = FakeAllocator(enabled=True, metadata="the user's own label")
    stand_in(fake)
    fake.buffer.append({"action": "alloc", "addr": 99, "size": 8, "stream": 0, "time_us": 0, "frames": [],
                        "compile_context": "", "user_metadata": ""})
    one_step(fake)
    by_addr = {e["addr"]: e["user_metadata"] for e in fake.buffer if e["action"] == "alloc"}
    assert by_addr[16] == "memprof phase=forward step=0 module=0"
    assert by_addr[32] == "memprof phase=backward step=0"
    assert next(m for a, m in by_addr.items() if a not in (16, 32, 99)) == "memprof phase=optimizer step=0"
    # set when the phase or the module changes, not per event: each text differs from the one before it
    assert all(a != b for a, b in zip(fake.texts, fake.texts[1:]))
    # (torch runs global forward pre-hooks before the model's own, where the forward phase begins)
    calls = ["<model>", "0", "0.lin", "0", "<model>"]
    assert fake.texts == ["memprof phase=other step=0", "memprof phase=other step=0 module=<model>"] + [
        f"memprof phase=forward step=0 module={m}" for m in calls] + [
        "memprof phase=forward step=0", "memprof phase=backward step=0", "memprof phase=other step=0",
        "memprof phase=optimizer step=0", "memprof phase=other step=0", "the user's own label"]
    # the user's recording is theirs: never restarted, cleared or stopped; their label is back
    assert fake.calls == [] and fake.on and fake.buffer[0]["addr"] == 99
    assert fake.metadata == "the user's own label"


def test_a_users_recording_is_read_from_where_it_was(stand_in) -> None:
    fake = FakeAllocator(enabled=True)
    stand_in(fake)
    fake.emit("alloc", 500, 123)  # before the profile: not a phase's
    prof, _, _ = one_step(fake, source="allocator")
    fwd = next(r.window for r in prof.allocator_phases if r.phase == "forward")
    # the user's earlier block is in no window: the forward replayed its own alloc alone, and 500 is nowhere
    assert fwd.allocations == 1 and fwd.peak_time_us == 2
    assert 500 not in prof.collectors.allocator.live.blocks
    assert fake.calls == [] and fake.on


def test_a_wrapped_users_buffer_marks_the_window_incomplete(stand_in) -> None:
    fake = FakeAllocator(enabled=True)
    stand_in(fake)
    fake.max_entries = 1
    fake.emit("alloc", 500, 8)
    prof, _, _ = one_step(fake, source="allocator")
    fwd = next(r.window for r in prof.allocator_phases if r.phase == "forward")
    assert not fwd.complete
    assert any("incomplete" in n for n in prof.trace.notes)


def test_everything_is_undone_when_the_block_raises(stand_in) -> None:
    fake = FakeAllocator(metadata="before")
    stand_in(fake)
    model = nn.Sequential(Emit(fake))
    before = hook_registry(model)
    with pytest.raises(ZeroDivisionError):
        with Profiler(model, source="allocator"):
            model(torch.randn(2, 4))
            raise ZeroDivisionError("the user's error")
    assert hook_registry(model) == before
    assert fake.metadata == "before" and not fake.on and fake.calls[-1] == (None, {})


def test_no_allocator_events_and_no_labels_on_cpu() -> None:
    # No stand-in: this machine's CPU run has no allocator history, and exact mode is as it always was.
    model = nn.Linear(2, 2)
    with memprof.profile(model) as prof:
        model(torch.randn(1, 2)).sum().backward()
    assert prof.allocator_phases == () and prof.collectors.allocator is None


def test_source_allocator_on_cpu_names_the_fix(stand_in) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError, match="CUDA device, or leave source='dispatch'"):
        memprof.profile(model, source="allocator")
    with pytest.raises(InvalidArgumentError, match="source must be one of 'dispatch', 'allocator'"):
        memprof.profile(model, source="cuda")
    stand_in(FakeAllocator())
    with pytest.raises(InvalidArgumentError, match="use mode='exact'"):
        Profiler(model, mode="light", source="allocator")


def test_torch_has_the_functions_memprof_relies_on() -> None:
    mem = torch.cuda.memory
    assert list(inspect.signature(mem._set_memory_metadata).parameters) == ["metadata"]
    assert list(inspect.signature(mem._get_memory_metadata).parameters) == []
    params = inspect.signature(mem._record_memory_history).parameters
    for name in ("enabled", "context", "stacks", "max_entries", "clear_history"):
        assert name in params
    assert list(inspect.signature(mem._snapshot).parameters)[0] == "device"


def test_a_module_called_in_another_thread_leaves_the_label_alone(stand_in) -> None:
    import threading

    fake = FakeAllocator(enabled=True)
    stand_in(fake)
    model = nn.Sequential(nn.Linear(2, 2))
    with memprof.profile(model):
        before = list(fake.texts)
        worker = threading.Thread(target=lambda: model(torch.randn(1, 2)))
        worker.start()
        worker.join()
        # the label is the process's: only the profiled thread sets it
        assert fake.texts == before
        model(torch.randn(1, 2))
        assert fake.texts[len(before):][:2] == ["memprof phase=other step=0 module=<model>",
                                                "memprof phase=forward step=0 module=<model>"]


def test_memprofs_own_buffer_full_at_a_drain_marks_the_window_incomplete() -> None:
    fake = FakeAllocator()
    history = AllocatorHistory(fake, 0, max_entries=3)
    history.start()
    for addr in (1, 2):
        fake.emit("alloc", addr, 8)
    events, complete = history.drain()
    assert [e["addr"] for e in events] == [1, 2] and complete and fake.buffer == []  # read, then cleared
    for addr in (3, 4, 5, 6):  # one more than the buffer keeps: the first is gone
        fake.emit("alloc", addr, 8)
    events, complete = history.drain()
    assert [e["addr"] for e in events] == [4, 5, 6] and not complete
    history.stop()
    assert not fake.on and fake.calls[-1] == (None, {})
    history.stop()  # twice: nothing more
    assert len(fake.calls) == 4  # start, two drains, one stop
