"""Leaving memprof on for a whole run: start/stop, a schedule, bounded records, bounded text."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memprof
from memprof import Category as C
from memprof.errors import InvalidArgumentError, NotMeasuredError, ProfilerStateError

from helpers import hook_registry, optimizer_state_bytes, weight_bytes
from training import train


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    return model, opt, torch.randn(16, 32), torch.randn(16, 8)


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _train(model, opt, x, y, steps):
    train(model, opt, (x, y), steps=steps, loss=_mse)


# ---------------------------------------------------------------------- start / stop


def test_start_and_stop_are_the_with_block():
    model, opt, x, y = _setup()
    with memprof.profile(model, opt) as prof:
        _train(model, opt, x, y, 2)
    model2, opt2, x2, y2 = _setup()
    prof2 = memprof.Profiler(model2, opt2)
    prof2.start()
    _train(model2, opt2, x2, y2, 2)
    prof2.stop()
    assert prof2.trace.steps == prof.trace.steps and prof2.trace.peak == prof.trace.peak


def test_start_and_stop_out_of_order_name_the_fix():
    model, opt, x, y = _setup()
    prof = memprof.Profiler(model, opt)
    with pytest.raises(ProfilerStateError, match="never started.*prof.start"):
        prof.stop()
    prof.start()
    with pytest.raises(ProfilerStateError, match="already used"):
        prof.start()
    prof.stop()
    with pytest.raises(ProfilerStateError, match="already stopped"):
        prof.stop()


# ---------------------------------------------------------------------- the schedule


def _scheduled(plan, steps=10, on_ready=None):
    model, opt, x, y = _setup()
    with memprof.profile(model, opt, schedule=plan, on_trace_ready=on_ready) as prof:
        _train(model, opt, x, y, steps)
    return prof.report(), model, opt


def test_recorded_steps_are_exactly_those_of_a_fully_watched_run():
    every, model_a, _ = _scheduled(memprof.schedule(active=1))
    sampled, model_b, opt_b = _scheduled(memprof.schedule(skip_first=1, wait=2, warmup=1, active=2))
    # Training is unchanged by pausing and resuming.
    assert all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))
    assert sampled.num_steps == every.num_steps == 10
    assert sampled.trace.recorded_steps == ((4, 5), (9, 9))
    assert [s.index for s in sampled.trace.steps] == [4, 5, 9]
    for step in sampled.trace.steps:
        for rec in step.phases:
            full = every.breakdown(step.index, rec.phase, "peak", occurrence=rec.occurrence)
            assert rec.peak == full, (step.index, rec.phase)
    # The record counts only recorded steps: 3 of them, each with one forward.
    fwd = next(s for s in sampled.trace.phase_stats if s.phase.value == "forward")
    assert fwd.count == 3
    # The model states at the end are the objects' own (registered again at each resume).
    assert sampled.end[C.WEIGHTS] == weight_bytes(model_b)
    assert sampled.end[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt_b)


def test_between_windows_nothing_of_memprof_is_on_the_dispatch_stack():
    model, opt, x, y = _setup()
    depth = []
    plan = memprof.schedule(wait=1, active=1)  # steps 0, 2, 4 wait; 1, 3, 5 are recorded
    with memprof.profile(model, opt, schedule=plan):
        for _ in range(6):
            ((model(x) - y) ** 2).mean().backward()
            depth.append(torch._C._len_torch_dispatch_stack())  # during the step, after backward
            opt.step()
            opt.zero_grad()
    assert depth == [0, 1, 0, 1, 0, 1]


def test_on_trace_ready_sees_each_window_and_the_run_so_far():
    seen = []

    def ready(prof):
        rep = prof.report()
        seen.append((prof.window, rep.num_steps, [s.index for s in rep.trace.steps]))

    rep, _, _ = _scheduled(memprof.schedule(wait=1, active=2, repeat=2), steps=8, on_ready=ready)
    assert seen == [((1, 2), 3, [1, 2]), ((4, 5), 6, [1, 2, 4, 5])]
    assert rep.trace.recorded_steps == ((1, 2), (4, 5))


def test_a_window_still_open_at_the_end_is_handed_over_once():
    seen = []
    _scheduled(memprof.schedule(wait=1, active=5), steps=4, on_ready=lambda p: seen.append(p.window))
    assert seen == [(1, 3)]


def test_without_an_optimizer_each_backward_is_a_step_of_the_schedule():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    plan = memprof.schedule(wait=2, active=1)
    with memprof.profile(model, schedule=plan) as prof:
        for _ in range(6):
            model(torch.randn(4, 8)).sum().backward()
    assert prof.report().num_steps == 6 and prof.trace.recorded_steps == ((2, 2), (5, 5))


def test_every_hook_is_gone_after_a_scheduled_run_also_when_it_raises():
    model, opt, x, y = _setup()
    _train(model, opt, x, y, 1)  # the optimizer state exists before, so both snapshots list it
    before = hook_registry(model, [opt])
    with pytest.raises(RuntimeError, match="boom"):
        with memprof.profile(model, opt, schedule=memprof.schedule(wait=1, active=1)):
            _train(model, opt, x, y, 3)
            raise RuntimeError("boom")
    assert hook_registry(model, [opt]) == before


def test_bad_schedule_arguments_name_the_fix():
    model = nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError, match="memprof.schedule"):
        memprof.profile(model, schedule={"active": 1})
    with pytest.raises(InvalidArgumentError, match="pass schedule="):
        memprof.profile(model, on_trace_ready=print)
    with pytest.raises(InvalidArgumentError, match="function taking the profiler"):
        memprof.profile(model, schedule=memprof.schedule(), on_trace_ready=3)


# ---------------------------------------------------------------------- bounded records


def test_a_long_run_keeps_a_few_steps_in_full_and_every_step_in_the_statistics(tmp_path):
    model, opt, x, y = _setup()
    with memprof.profile(model, opt) as prof:
        _train(model, opt, x, y, 60)
    rep = prof.report()
    assert rep.num_steps == 60
    kept = [s.index for s in rep.trace.steps]
    assert kept[:3] == [0, 1, 2] and kept[-1] == 59 and len(kept) <= 5
    fwd = next(s for s in rep.trace.phase_stats if s.phase.value == "forward")
    assert fwd.count == 60
    # Steady state: from step 1 on every forward peaks at the same bytes; step 0 has no optimizer state.
    steady = rep.breakdown(59, "forward", "peak").total
    assert fwd.at("peak", "total").median == fwd.at("peak", "total").max == steady
    with pytest.raises(NotMeasuredError, match="not kept in full"):
        rep.breakdown(30, "forward")
    path = tmp_path / "run.json"
    rep.save(path)
    assert memprof.load(path).trace == rep.trace
    frame = rep.phase_stats()
    assert set(frame["moment"]) == {"peak", "end"} and int(frame["count"].max()) == 60


def test_the_text_report_stays_short_for_any_run():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(300)]  # 300 modules, 3 levels deep
    model = nn.Sequential(*[nn.Sequential(*layers[i:i + 10]) for i in range(0, 300, 10)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 8)
    with memprof.profile(model, opt, schedule=memprof.schedule(active=1)) as prof:
        # 15 steps: more phases than the 12 rows the text gives them, and more steps than it names.
        for i in range(15):
            for _ in range(1 + i % 3):  # gradient accumulation: up to 3 forwards per step
                model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    rep = prof.report()
    text = str(rep)
    assert len(rep.trace.steps) == 15  # all kept in full (scheduled), not all printed
    assert len(text.splitlines()) <= 80
    # The title names the steps whose rows fit in the 12 rows (0 and 1, which holds the peak), no more.
    assert "Phases of steps 0, 1 of 15" in text and "All 15 recorded steps per phase" in text


# ---------------------------------------------------------------------- what a hostile review found


def test_a_users_mode_entered_every_step_leaves_no_mode_of_memprofs_behind():
    from torch.utils import _python_dispatch as pd
    from torch.utils.flop_counter import FlopCounterMode

    # An earlier test's profile ended from another thread leaves its inert mode on this thread's stack (and
    # torch's process-wide "a mode is in" flag up) until an op here lets it go: let it go. Then nothing is in.
    torch.ones(1).add(1)
    assert (pd.is_in_torch_dispatch_mode(), torch._C._len_torch_dispatch_stack()) == (False, 0)
    model, opt, x, y = _setup()
    depths = []
    with memprof.profile(model, opt, schedule=memprof.schedule(wait=1, active=1)):
        for _ in range(12):
            with FlopCounterMode(display=False):
                ((model(x) - y) ** 2).mean().backward()
                depths.append(torch._C._len_torch_dispatch_stack())
                opt.step()
                opt.zero_grad()
    # At most the user's mode and one of memprof's, however many windows; nothing left after the block,
    # and torch's "a mode is in" flags are down again.
    assert max(depths) <= 2
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not pd.is_in_torch_dispatch_mode()


def test_a_closure_step_has_its_optimizer_phase_in_every_window():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randn(4, 1)

    def closure():
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    with memprof.profile(model, opt, schedule=memprof.schedule(wait=1, active=1)) as prof:
        for _ in range(6):
            opt.step(closure)
    steps = prof.report().trace.steps
    assert [s.index for s in steps] == [1, 3, 5]
    for s in steps:
        assert [p.phase.value for p in s.phases if p.phase.value != "other"] == ["forward", "backward", "optimizer"]


def test_explicit_steps_follow_the_schedule_without_an_optimizer():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    with memprof.profile(model, schedule=memprof.schedule(wait=2, active=1)) as prof:
        for _ in range(9):
            with prof.step(), torch.no_grad():
                model(torch.randn(4, 8))
    rep = prof.report()
    assert rep.num_steps == 9 and rep.trace.recorded_steps == ((2, 2), (5, 5), (8, 8))


def test_an_optimizer_not_passed_is_measured_from_the_first_window():
    model, opt, x, y = _setup()
    with memprof.profile(model, schedule=memprof.schedule(skip_first=3, active=2)) as prof:
        _train(model, opt, x, y, 5)
    rep = prof.report()
    assert [s.index for s in rep.trace.steps] == [3, 4]
    # At the first recorded forward, AdamW's state from the three unwatched steps is already counted.
    start = rep.breakdown(3, "forward", "start")
    assert start[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt)


def test_on_trace_ready_is_called_once_per_window_also_when_windows_touch():
    seen = []
    _scheduled(memprof.schedule(wait=0, warmup=1, active=2), steps=12, on_ready=lambda p: seen.append(p.window))
    assert seen == [(1, 2), (4, 5), (7, 8), (10, 11)]
    seen.clear()
    _scheduled(memprof.schedule(active=2, repeat=3), steps=8, on_ready=lambda p: seen.append(p.window))
    assert seen == [(0, 1), (2, 3), (4, 5)]


def test_a_warmup_step_right_after_a_recorded_one_keeps_that_steps_peak():
    # warmup=1, active=1: steps 0 W, 1 A, 2 W, 3 A. Step 1 trains on a batch 32 times larger, so its peak is the
    # run's; forgetting warmup step 2 returns to the peak as it stood after step 1, not to before step 0.
    model, opt, x, y = _setup()
    big_x, big_y = torch.randn(512, 32), torch.randn(512, 8)
    with memprof.profile(model, opt, schedule=memprof.schedule(warmup=1, active=1)) as prof:
        for i in range(4):
            _train(model, opt, big_x if i == 1 else x, big_y if i == 1 else y, 1)
    tr = prof.trace
    assert tr.recorded_steps == ((1, 1), (3, 3)) and tr.num_steps == 4
    step1, step3 = (max(p.peak.total for p in s.phases) for s in tr.steps)
    assert tr.peak_step == 1 and tr.peak.total == step1 > step3


def test_end_step_on_a_last_warmup_step_adds_no_step_that_never_ran():
    # skip_first=1, warmup=1, active=1 over 6 steps: 0 skip, 1 W, 2 A, 3 W, 4 A, 5 W (6 would be active).
    # end_step() closes each step before zero_grad, which then runs after the last step, in no step.
    model, opt, x, y = _setup()
    seen = []
    prof = memprof.Profiler(model, opt, schedule=memprof.schedule(skip_first=1, warmup=1, active=1),
                            on_trace_ready=lambda p: seen.append(p.window))
    prof.start()
    for _ in range(6):
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        prof.end_step()
        opt.zero_grad()
    prof.stop()
    tr = prof.trace
    assert tr.num_steps == 6 and tr.recorded_steps == ((2, 2), (4, 4)) and seen == [(2, 2), (4, 4)]
    assert [s.index for s in tr.steps] == [2, 4] and tr.peak_step in (2, 4)


def test_a_failing_on_trace_ready_still_pauses_memprof():
    model, opt, x, y = _setup()

    def ready(prof):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        with memprof.profile(model, opt, schedule=memprof.schedule(wait=1, active=1), on_trace_ready=ready) as prof:
            _train(model, opt, x, y, 3)
            assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._len_torch_dispatch_stack() == 0 and prof.report().trace.error


def test_an_error_in_an_unwatched_step_is_not_given_a_false_breakdown():
    model, opt, x, y = _setup()
    with pytest.raises(ValueError):
        with memprof.profile(model, opt, schedule=memprof.schedule(wait=1, active=1)) as prof:
            _train(model, opt, x, y, 2)
            ((model(x) - y) ** 2).mean().backward()  # step 2: not watched, its gradients unseen
            raise ValueError("in an unwatched step")
    trace = prof.report().trace
    assert trace.live_at_error is None
    assert any("did not watch" in n for n in trace.notes)


def test_stop_with_the_exception_records_it():
    model, opt, x, y = _setup()
    prof = memprof.Profiler(model, opt)
    prof.start()
    try:
        _train(model, opt, x, y, 1)
        raise KeyError("boom")
    except KeyError as exc:
        prof.stop(exc)
    assert prof.report().trace.error == "KeyError: 'boom'"
    assert prof.report().trace.live_at_error[C.WEIGHTS] == weight_bytes(model)


def test_a_schedule_built_directly_is_checked():
    with pytest.raises(InvalidArgumentError, match="active=0"):
        memprof.Schedule(active=0)
    with pytest.raises(InvalidArgumentError, match="negative"):
        memprof.Schedule(wait=-3)
