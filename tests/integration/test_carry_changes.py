"""When an optimizer step is measured again: whatever decides its allocations changed (a param group added, a layer
frozen), a closure, a step that raised, a step whose state changed under a carried step. And what stays: the
user's own dispatch modes see every op of a carried step, and nothing memprof installs outlives the block.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memprof
from tests.helpers import hook_registry

STEPS = 7


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 3))


def _batch(i: int):
    g = torch.Generator().manual_seed(7 + i)
    return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)


def _kinds(report) -> dict[int, str]:
    return {s: kind for a, b, kind in report.trace.optimizer_steps for s in range(a, b + 1)}


def _run(carry: bool, change=None, make_opt=None):
    """STEPS steps; ``change(i, model, opt)`` runs before step i's forward."""
    model = _model()
    opt = make_opt(model) if make_opt is not None else torch.optim.AdamW(model.parameters(), lr=1e-3)
    records = []
    with memprof.profile(model, opt, mode="exact", carry_optimizer_steps=carry) as prof:
        for i in range(STEPS):
            if change is not None:
                change(i, model, opt)
            x, y = _batch(i)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            prof.end_step()  # every step's record, not only those the report keeps in full
            records.append(prof.latest_step())
    report = prof.report()
    report.every_step = records
    return report, model, opt


def test_a_param_group_added_mid_run_is_measured_again():
    def add_group(i, model, opt):
        if i == 3:
            opt.add_param_group({"params": list(model[4].parameters()), "lr": 1e-2})

    def first_layers(model):
        return torch.optim.AdamW(list(model[0].parameters()) + list(model[2].parameters()), lr=1e-3)

    carried, _, _ = _run(True, add_group, first_layers)
    measured, _, _ = _run(False, add_group, first_layers)
    # Step 3: a new group whose state is made in the step (measured); step 4 its first steady step (measured).
    assert _kinds(carried) == {0: "measured", 1: "measured", 2: "carried", 3: "measured", 4: "measured",
                               5: "carried", 6: "carried"}
    assert carried.every_step == measured.every_step


def test_freezing_a_layer_is_measured_again():
    def freeze(i, model, opt):
        if i == 3:
            for p in model[0].parameters():
                p.requires_grad_(False)
                p.grad = None

    carried, _, _ = _run(True, freeze)
    measured, _, _ = _run(False, freeze)
    # Step 3 has no gradient for the frozen layer: another signature, measured; then carried again.
    assert _kinds(carried) == {0: "measured", 1: "measured", 2: "carried", 3: "measured", 4: "carried",
                               5: "carried", 6: "carried"}
    assert carried.every_step == measured.every_step


def test_a_changed_learning_rate_keeps_the_step_carried():
    # A scheduler changes lr, a number the step only multiplies by: the same allocations.
    def schedule(i, model, opt):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * (i + 1)

    carried, _, _ = _run(True, schedule)
    measured, _, _ = _run(False, schedule)
    assert _kinds(carried) == {0: "measured", 1: "measured", **{i: "carried" for i in range(2, STEPS)}}
    assert carried.every_step == measured.every_step


def test_a_closure_step_is_always_measured():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with memprof.profile(model, opt, mode="exact") as prof:
        for i in range(STEPS):
            x, y = _batch(i)

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)
    trace = prof.report().trace
    assert trace.optimizer_steps == ((0, STEPS - 1, "measured"),)
    assert not any("carried at" in n for n in trace.notes)


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_the_users_dispatch_mode_sees_every_op_of_a_carried_step(where):
    """A mode of the user's, entered before the profile (beneath memprof's) or inside it (above): a carried step
    takes memprof's mode off the stack, never the user's, which sees the same ops as without memprof."""

    def ops_seen(carry):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        counter = _Counter()
        per_step = []
        if where == "outside":
            counter.__enter__()
        try:
            block = memprof.profile(model, opt, mode="exact", carry_optimizer_steps=carry) if carry is not None \
                else None
            if block is not None:
                block.__enter__()
            if where == "inside":
                counter.__enter__()
            for i in range(STEPS):
                x, y = _batch(i)
                F.cross_entropy(model(x), y).backward()
                before = len(counter.ops)
                opt.step()
                per_step.append(counter.ops[before:])
                opt.zero_grad()
            if where == "inside":
                counter.__exit__(None, None, None)
            if block is not None:
                block.__exit__(None, None, None)
                # The comparison is of carried steps (carry on) and of measured ones (carry off: none carried).
                assert _kinds(block.report()).get(STEPS - 1) == ("carried" if carry else None)
        finally:
            if where == "outside":
                counter.__exit__(None, None, None)
        return per_step

    bare = ops_seen(None)
    assert len(bare[-1]) > 10  # AdamW's step dispatches ops: the comparison holds something
    assert ops_seen(True) == bare
    assert ops_seen(False) == bare


def test_nothing_is_left_installed_after_carried_steps():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(99)
    F.cross_entropy(model(x), y).backward()
    opt.step()  # the state exists before the registry is read: the same tensors after the block
    opt.zero_grad()
    before = hook_registry(model, [opt])
    stack = torch._C._len_torch_dispatch_stack()
    with memprof.profile(model, opt, mode="exact") as prof:
        for i in range(STEPS):
            x, y = _batch(i)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert _kinds(prof.report())[STEPS - 1] == "carried"
    assert hook_registry(model, [opt]) == before
    assert torch._C._len_torch_dispatch_stack() == stack


def _raise_at(step: int):
    """An optimizer pre-hook of the user's that raises at ``step``: torch runs the global hooks (memprof's) first,
    so memprof has begun the step, carried, when it raises."""
    calls = []

    def hook(opt, args, kwargs):
        calls.append(1)
        if len(calls) == step + 1:
            raise RuntimeError("boom")

    return hook


def test_a_carried_step_that_raises_out_of_the_block_leaves_nothing_and_says_so():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = hook_registry(model, [opt])
    stack = torch._C._len_torch_dispatch_stack()
    handle = opt.register_step_pre_hook(_raise_at(4))
    prof = memprof.profile(model, opt, mode="exact")
    with pytest.raises(RuntimeError, match="boom"):
        with prof:
            for i in range(STEPS):
                x, y = _batch(i)
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    handle.remove()
    opt.zero_grad()
    opt.state.clear()  # the registry before the block had no state yet
    assert hook_registry(model, [opt]) == before
    assert torch._C._len_torch_dispatch_stack() == stack
    trace = prof.report().trace
    assert _kinds(prof.report()) == {0: "measured", 1: "measured", 2: "carried", 3: "carried", 4: "not measured"}
    last = [p for p in trace.steps[-1].phases if p.phase.value == "optimizer"]
    assert trace.steps[-1].index == 4 and last[0].peak.get("temporaries") is None  # never a replayed figure
    assert any("did not return" in n for n in trace.notes)


def test_a_carried_step_that_raises_and_is_caught_is_not_replayed():
    def run(carry):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.register_step_pre_hook(_raise_at(3))
        records = {}
        with memprof.profile(model, opt, mode="exact", carry_optimizer_steps=carry) as prof:
            for i in range(STEPS):
                x, y = _batch(i)
                F.cross_entropy(model(x), y).backward()
                try:
                    opt.step()
                except RuntimeError:
                    pass
                opt.zero_grad()
                prof.end_step()
                last = prof.latest_step()
                records[last.index] = last
        report = prof.report()
        report.every_step = records
        return report

    carried, measured = run(True), run(False)
    kinds = _kinds(carried)
    # The step that raised never ended: memprof's step 3 runs on through the loop's fourth and fifth iterations,
    # its second optimizer phase measured; memprof's step 4 (the loop's sixth) is carried again.
    assert kinds[3] == "not measured" and kinds[4] == "carried"
    opt3 = [p for p in carried.every_step[3].phases if p.phase.value == "optimizer"][0]
    assert opt3.peak.get("temporaries") is None and opt3.end.get("temporaries") is None
    # memprof's mode comes back at its next hook (step 3's second forward): the target made before it, unseen, is
    # an input from there rather than a temporary, until step 4 lets it go. From step 5 on the records are equal.
    assert 5 in carried.every_step
    assert {i: s for i, s in carried.every_step.items() if i >= 5} == \
        {i: s for i, s in measured.every_step.items() if i >= 5}


class _Replacing(torch.optim.Optimizer):
    """SGD with momentum (for-loop) that, at one step, replaces every momentum buffer with a copy: a change its
    signature cannot see before the step runs. Its own loop, not SGD's step (which would nest in it)."""

    def __init__(self, params, at):
        super().__init__(params, {"lr": 0.1})
        self.at, self.n = at, 0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = p.grad.clone()
                else:
                    state["momentum_buffer"].mul_(0.9).add_(p.grad)
                    if self.n == self.at:
                        state["momentum_buffer"] = state["momentum_buffer"].clone()
                p.add_(state["momentum_buffer"], alpha=-group["lr"])
        self.n += 1


def test_a_carried_step_that_changed_its_state_is_an_upper_bound_and_measured_again():
    carried, _, opt = _run(True, make_opt=lambda m: _Replacing(m.parameters(), at=3))
    measured, _, _ = _run(False, make_opt=lambda m: _Replacing(m.parameters(), at=3))
    kinds = _kinds(carried)
    assert kinds[3] == "unverified" and kinds[4] == "measured" and kinds[5] == "carried"

    def opt_phase(report, step):
        return [p for p in report.every_step[step].phases if p.phase.value == "optimizer"][0]

    # Measured, the copies are made while the old buffers live: that is the true peak. The carried step's is
    # at least as high, never below it.
    assert opt_phase(carried, 3).peak.total >= opt_phase(measured, 3).peak.total
    assert opt_phase(carried, 3).end == opt_phase(measured, 3).end
    assert any("upper bound" in n for n in carried.trace.notes)
    assert carried.every_step[4:] == measured.every_step[4:]


class _Growing(torch.optim.Optimizer):
    """Plain SGD whose step, from one step on, allocates a temporary the size of each gradient: a change that
    depends on a counter its signature cannot see."""

    def __init__(self, params, grow_at):
        super().__init__(params, {"lr": 0.1})
        self.grow_at, self.n = grow_at, 0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    update = p.grad * group["lr"] if self.n >= self.grow_at else p.grad
                    p.sub_(update if self.n >= self.grow_at else update * group["lr"])
        self.n += 1


def test_a_step_measured_again_as_a_check_that_differs_stops_the_carry(monkeypatch):
    from memprof.collect import carry

    monkeypatch.setattr(carry, "RECHECK_EVERY", 3)
    monkeypatch.setitem(globals(), "STEPS", 12)
    report, _, _ = _run(True, make_opt=lambda m: _Growing(m.parameters(), grow_at=6))
    kinds = _kinds(report)
    # 0 measured, 1-3 carried, 4 measured again (the same: carried on), 5-7 carried (6 and 7 grew unseen),
    # 8 measured again: it differs, so it and every later step are measured, and a note says so.
    assert [kinds[i] for i in range(12)] == ["measured"] + ["carried"] * 3 + ["measured"] + ["carried"] * 3 + \
        ["measured"] * 4
    assert any("measured again as a check, differed" in n for n in report.trace.notes)


def test_a_schedules_windows_record_what_measuring_records():
    """Paused steps run unseen; warmup steps are watched but not kept: a step known before a pause is carried in
    the next window when its signature still holds, with the records measuring gives."""

    def run(carry):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        plan = memprof.schedule(wait=1, warmup=1, active=2, repeat=3)
        with memprof.profile(model, opt, mode="exact", schedule=plan, carry_optimizer_steps=carry) as prof:
            for i in range(12):
                x, y = _batch(i)
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        return prof.report()

    carried, measured = run(True), run(False)
    kinds = _kinds(carried)
    assert "carried" in kinds.values()  # the comparison holds carried steps
    assert carried.trace.steps == measured.trace.steps
    assert carried.trace.phase_stats == measured.trace.phase_stats
    assert (carried.trace.peak, carried.trace.recorded_steps) == (measured.trace.peak, measured.trace.recorded_steps)
