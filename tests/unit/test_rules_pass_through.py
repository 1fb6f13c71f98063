"""The simulation's rules see the model's torch calls, not a tensor's metadata read nor memprof's own bookkeeping:
those go past the chain (``memprof.simulate.modes``), as its end would call them, and were two thirds of the calls
the mode saw."""

from __future__ import annotations

import types

import torch
from torch import nn

from memprof.collect.ledger import plain_storage_keys, storage_of
from memprof.simulate.modes import Rule, Rules

# A user's module named as memprof's collector, its code not in memprof's folders: the model's code still.
_NAMED = types.ModuleType("memprof.collect.user_probe")
exec("def twice(t):\n    return t * 2\n", _NAMED.__dict__)


@torch.library.custom_op("memprof_tests::pass_through_probe", mutates_args=())
def _probe(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_probe.register_fake
def _(x):
    return torch.empty_like(x)


class _Seen(Rule):
    def __init__(self) -> None:
        super().__init__()
        self.funcs: list[object] = []

    def handle(self, func, args, kwargs, next):
        self.funcs.append(func)
        return next(func, args, kwargs)


def test_metadata_and_bookkeeping_go_past_the_rules_and_the_models_calls_do_not():
    lin = nn.Linear(4, 4, device="meta")
    x = torch.empty(2, 4, device="meta")
    seen = _Seen()
    with Rules(seen):
        y = lin(x)
        shape, dtype, grad, size = y.shape, y.dtype, lin.weight.grad, y.size()
        storage_of(y), plain_storage_keys([y])  # the collector's ledger looking up y's storage: not seen
        _NAMED.twice(y)  # seen (Tensor.mul)
        z = y.t()  # an op through a property's cousin (a method that runs one): seen
        torch.ops.aten.mul.Tensor(y, y)  # torch's own op called as an op (as a dispatch mode hands it on): not seen
        torch.ops.memprof_tests.pass_through_probe.default(y)  # a custom op: seen (the custom ops' watcher counts it)
    assert seen.funcs == [torch.nn.functional.linear, torch.Tensor.mul, torch.Tensor.t,
                          torch.ops.memprof_tests.pass_through_probe.default]
    # What went past still ran: the answers are torch's own.
    assert (shape, dtype, grad, size, z.shape) == ((2, 4), torch.float32, None, (2, 4), (4, 2))


def test_a_rule_sees_every_call_of_the_models_own_code_as_before():
    # The input's factory, the linear layer, F.relu and (the composite followed) the torch.relu inside it, the sum:
    # each reaches the rule once.
    model = nn.Sequential(nn.Linear(4, 4, device="meta"), nn.ReLU())
    seen = _Seen()
    with Rules(seen):
        model(torch.empty(2, 4, device="meta")).sum()
    assert seen.funcs == [torch.empty, torch.nn.functional.linear, torch.nn.functional.relu, torch.relu,
                          torch.Tensor.sum]
