"""Light mode's gradient hook is the ledger queue's own ``append`` (a C function, no hook visit of memprof's per
parameter and backward): the parameter waits in the queue, in order among the storages freed and the saved slots
released, and ``Ledger.settle`` hands it to ``ParamTracker.grad_hook`` there. The records it makes must be the
ones the hook made when autograd called it directly, whatever the training does: a model whose gradients arrive
before backward unpacks anything memprof packed (the gradient starts the backward phase from inside settle()),
gradients accumulated over several backwards, no optimizer (each backward a step), a schedule that pauses
(the queue is drained while paused, and a backward that ran while paused still ends its step).

tests/integration/test_overhead_counts.py holds the hook visits and calls this saves.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memprof
from memprof import Category as C
from memprof.collect import params as params_module

from helpers import unique_bytes
from models import make
from training import output_sum, train

_INIT = params_module.ParamTracker.__init__


def _hook_called_by_autograd(self, *args, **kwargs):
    # ParamTracker as exact mode wires it: grad_hook itself is the post-accumulate-grad hook, called by autograd.
    _INIT(self, *args, **kwargs)
    self.hook = self.grad_hook
    self.ledger.grad_arrived = None


class Offset(nn.Module):
    """``x + p``: autograd saves nothing for it, so its gradient is what reaches memprof first in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        return x + self.p


def _offset():
    torch.manual_seed(0)
    return nn.Sequential(Offset(), Offset()), (torch.randn(8, 16), None), output_sum


def _trace(build, *, steps=3, optimizer=True, zero_grad=True, **profile_kwargs):
    model, batch, loss = build()
    opt = torch.optim.AdamW(model.parameters()) if optimizer else None
    with memprof.profile(model, opt, mode="light", **profile_kwargs) as prof:
        train(model, opt, batch, steps=steps, loss=loss, zero_grad=zero_grad)
    return prof.trace, model


CASES = {
    "mlp": (lambda: make("mlp"), {}),
    "transformer": (lambda: make("transformer"), {}),
    "lstm": (lambda: make("lstm"), {}),
    "gradients first": (_offset, {}),
    "gradients first, no optimizer": (_offset, {"optimizer": False}),
    "accumulated gradients": (lambda: make("mlp"), {"zero_grad": False}),
    "no optimizer": (lambda: make("cnn"), {"optimizer": False}),
    "paused schedule": (lambda: make("mlp"), {"steps": 7, "schedule": memprof.schedule(wait=1, active=1)}),
    "paused schedule, gradients first": (_offset, {"steps": 6, "schedule": memprof.schedule(wait=2, active=1)}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_queued_gradients_record_what_the_hook_called_by_autograd_records(case, monkeypatch):
    build, kwargs = CASES[case]
    queued, model = _trace(build, **kwargs)
    monkeypatch.setattr(params_module.ParamTracker, "__init__", _hook_called_by_autograd)
    direct, _ = _trace(build, **kwargs)
    # Every figure of the records (each phase's start, peak and end, the tags at the peaks, the module table,
    # the steps and phases recorded); times are not compared (their fields say compare=False).
    assert queued == direct
    backwards = [p for p in queued.phases if p.phase.value == "backward"]
    assert backwards, "no backward phase recorded"
    if kwargs.get("schedule") is None:
        # Every parameter's gradient is alive at each backward's end: one plain fp32 storage the size of its
        # parameter (the parameters' storages summed, each once: a tied weight has one gradient).
        grads = unique_bytes(list(model.parameters()))
        assert all(rec.end[C.GRADIENTS] == grads for rec in backwards)


def test_gradients_first_start_the_backward_inside_the_engine():
    # Two Offset blocks of 8 x 16 fp32 parameters: 2 x 512 = 1,024 bytes of gradients, made before backward unpacks
    # anything memprof packed (nothing is packed). The backward phase must still start and end inside the engine:
    # one backward per step, closed by memprof's end-of-backward callback, which opens an "other" phase before the
    # optimizer's (the timeline samples each phase's start; the records fold that empty "other" away). Closed
    # only by the optimizer's phase instead, it would take in what ran between the engine's end and opt.step().
    trace, model = _trace(_offset)
    assert unique_bytes(list(model.parameters())) == 2 * 8 * 16 * 4 == 1024  # each gradient its parameter's size
    starts = [s.phase.value for s in trace.timeline if s.event == "phase"]
    assert starts == ["forward", "backward", "other", "optimizer", "other"] * 3
    assert [p.phase.value for p in trace.phases].count("backward") == 3
    for rec in (p for p in trace.phases if p.phase.value == "backward"):
        assert rec.end[C.GRADIENTS] == rec.peak[C.GRADIENTS] == 1024


def test_a_paused_schedule_drains_the_queue(monkeypatch):
    # While paused, memprof's hooks return at once, so nothing settled the queue but the next watched forward:
    # with the gradient hook appending to it, every paused backward would add a parameter per gradient. It is
    # drained at each forward's start while paused: it never holds more than one backward's parameters.
    seen: list[int] = []
    real = params_module.ParamTracker.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen.append(self.ledger)

    monkeypatch.setattr(params_module.ParamTracker, "__init__", spy)
    model, batch, loss = make("mlp")
    opt = torch.optim.AdamW(model.parameters())
    n_params = len(list(model.parameters()))
    most = 0
    with memprof.profile(model, opt, mode="light", schedule=memprof.schedule(wait=1, active=1, repeat=1)):
        for _ in range(12):
            loss(model(batch[0]), batch[1]).backward()
            most = max(most, sum(1 for x in seen[0].released if isinstance(x, torch.Tensor)))
            opt.step()
            opt.zero_grad()
    assert 0 < most <= n_params


def _hooked_in_the_block():
    # An optimizer stepped in backward, registered inside the block (after memprof's hook): each parameter's own
    # post-accumulate-grad hook sets its gradient to None once made.
    model, batch, loss = make("mlp")
    with memprof.profile(model, mode="light") as prof:
        handles = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
                   for p in model.parameters()]
        for _ in range(3):
            loss(model(batch[0]), batch[1]).backward()
        for h in handles:
            h.remove()
    return prof.trace, model


def test_a_hook_registered_after_memprofs_does_not_hide_the_gradient(monkeypatch):
    # The queue's append runs first, but the parameter is settled only later: by then the user's hook, which torch
    # runs after memprof's, set .grad to None. memprof's entry becomes grad_hook itself, at the same place, when
    # the forward ends: the gradient is registered before the user's hook frees it, as with the hook called by
    # autograd. Each gradient is made and freed in turn; the largest the backward holds at once is the largest
    # parameter's gradient (the MLP's biggest weight, counted each storage once by unique_bytes).
    queued, model = _hooked_in_the_block()
    monkeypatch.setattr(params_module.ParamTracker, "__init__", _hook_called_by_autograd)
    direct, _ = _hooked_in_the_block()
    assert queued == direct
    largest = max(unique_bytes([p]) for p in model.parameters())
    for rec in (p for p in queued.phases if p.phase.value == "backward"):
        assert rec.peak[C.GRADIENTS] >= largest > 0
