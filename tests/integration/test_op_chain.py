"""The simulation's rules beneath the collector run as one dispatch mode (memprof.simulate.op_chain): each op crosses
torch's Python dispatch once for all of them, the rules apply in their order, a rule that answers an op itself ends
it there (a call a rule hands back NotImplemented, a DTensor's, is in test_fake_kernels_estimates.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

import memprof
from memprof.simulate.op_chain import OpChain, OpRule

_ADD = torch.ops.aten.add.Tensor


class _Seen(OpRule):
    """Records each op it is handed, under its name, into a list shared by the chain."""

    def __init__(self, name: str, log: list[tuple[str, str]], answer: object = None) -> None:
        super().__init__()
        self.name, self.log, self.answer = name, log, answer

    def handle(self, func, args, kwargs, next):
        self.log.append((self.name, str(func.overloadpacket)))
        if self.answer is not None and func is _ADD:
            return self.answer(*args)
        return next(func, args, kwargs)


class _Modes(TorchDispatchMode):
    """Counts the Python dispatch handlers an op crosses beneath it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_the_rules_apply_in_order_in_one_crossing_as_the_modes_they_were():
    log: list[tuple[str, str]] = []
    x = torch.arange(6.0).view(2, 3)
    beneath = _Modes()
    with beneath, OpChain(_Seen("outer", log), _Seen("inner", log)):
        y = (x + 1).sum()
    assert y.item() == 21.0  # 0+1 + ... + 5+1
    assert log == [("outer", "aten.add"), ("inner", "aten.add"), ("outer", "aten.sum"), ("inner", "aten.sum")]
    assert beneath.calls == 2  # each op reached the mode beneath the chain once, from the last rule

    # The same rules entered as modes of their own, the outer one last (on top): the same order.
    stacked: list[tuple[str, str]] = []
    with _Seen("inner", stacked), _Seen("outer", stacked):
        z = (x + 1).sum()
    assert z.item() == 21.0
    assert stacked == log


def test_a_rule_that_answers_an_op_ends_it_there():
    log: list[tuple[str, str]] = []
    x = torch.ones(3)
    with OpChain(_Seen("outer", log), _Seen("answers", log, answer=lambda a, b: torch.zeros(7)),
                 _Seen("inner", log)):
        y = x + x
    assert tuple(y.shape) == (7,)
    assert ("inner", "aten.add") not in log and ("answers", "aten.add") in log


def _users_step(model, optimizer, x):
    # A loop of the user's, which reads a value outside the model: answered by the value shadows' rule, in the chain.
    loss = model(x).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


@pytest.mark.parametrize("target", [dict(device="cpu"), dict(gpu="h100-80gb"), dict(device="cpu", train_step=_users_step)],
                         ids=["cpu-target", "h100-target", "users-step"])
def test_a_simulated_op_crosses_the_collector_one_mode_of_rules_and_the_fake_mode(target):
    seen: list[list[str]] = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            seen.append([type(m).__name__ for m in _get_current_dispatch_mode_stack()])
            return self.lin(x)

    memprof.estimate(Probe(), torch.optim.SGD, inputs=torch.zeros(2, 4), **target)
    fake = ["FakeTensorMode"] if "device" in target else []  # a GPU target runs on meta tensors: no fake mode
    assert seen and all(s == [*fake, "OpChain", "SimulatedDispatchMode"] for s in seen), seen


def test_a_dtensors_device_queries_are_answered_and_never_counted_as_ops(monkeypatch):
    # DTensor's handler asks its local fake tensor's device (prim.device) after the collector handed the wrapper's
    # op back: the collector's mode answers it, as a real tensor answers without an op. Before it did, each query
    # reached the collector's handler and counted as an op of the phase (a tensor-parallel forward of 20 ops read
    # 24), which a real run of the same rank never counts.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from memprof.collect import simulated
    from memprof.collect.dispatch import DispatchMode

    asked, counted = [], []
    handler, answered = DispatchMode.__torch_dispatch__, simulated.SimulatedDispatchMode.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        counted.append(func)
        return handler(self, func, types, args, kwargs)

    def answering(self, func, types, args=(), kwargs=None):
        asked.append(func)
        return answered(self, func, types, args, kwargs)

    monkeypatch.setattr(DispatchMode, "__torch_dispatch__", counting)
    monkeypatch.setattr(simulated.SimulatedDispatchMode, "__torch_dispatch__", answering)

    def tp(model, mesh):
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    est = memprof.estimate(model, torch.optim.SGD, inputs=torch.randn(8, 16), targets=torch.randint(0, 4, (8,)),
                           loss_fn=torch.nn.functional.cross_entropy, world_size=2, rank=0, parallelize=tp,
                           device="cpu")
    assert asked.count(simulated.PRIM_DEVICE) > 0  # DTensor did ask: the check below is not vacuous
    assert simulated.PRIM_DEVICE not in counted
    ops = {p.phase.value: p.ops for p in est.trace.steps[0].phases if p.ops}
    assert ops.get("forward", 0) > 0 and ops.get("backward", 0) > 0  # the step's own ops were counted
