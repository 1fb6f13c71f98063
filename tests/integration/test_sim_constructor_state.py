"""torch's optimizers whose constructor makes states or whose step reads values simulate as they run.

Adagrad makes its step counters in its constructor (``torch.tensor(0.0)`` in ``__init__``, torch/optim/adagrad.py):
real CPU scalars among the twin's fake states, which the fake-tensor mode faked without their value at the step's
first op, so ``_get_value(step)`` (``.item()``) failed: ``estimate(model, torch.optim.Adagrad)`` raised
``DataDependentOutputException`` on the default target, blaming the model. They are now made as the fake tensor
that a counter made in a step is (Adam's, ``memprof.simulate.twin._lifted``). ASGD, torch's Adafactor and a tensor
learning rate read scalars of their update in the step: answered 0 in memprof's loop as in the user's step, with
a note. LBFGS, whose evaluations follow values, and a step that needs a closure are refused with the fix."""

from __future__ import annotations

import pytest
import torch

import memprof
from test_train_step import IDS, assert_never_under, assert_same_run, build, loss_fn, measured, plain


@pytest.mark.parametrize("options", [{}, {"foreach": True}, {"weight_decay": 0.1, "lr_decay": 0.01}],
                         ids=["default", "foreach", "decays"])
def test_adagrad_on_the_cpu_is_the_real_run(options):
    def adagrad(params):
        return torch.optim.Adagrad(params, **options)

    est = memprof.estimate(build(), adagrad, inputs=IDS, targets=IDS, train_step=plain, steps=2)
    assert_same_run(est, measured(plain, make=adagrad))
    # The states at the first step's start: a sum per parameter and a 4-byte step counter per parameter, made by
    # the constructor (Tiny's parameters, every storage counted once).
    params = list(build().parameters())
    expected = sum(p.numel() * 4 for p in params) + 4 * len(params)
    first = next(p for p in est.trace.phases if p.step == 0)
    assert first.start[memprof.Category.OPTIMIZER_STATES] == expected


def test_adagrad_on_the_cpu_in_memprofs_own_loop_steps():
    # memprof's own loop (no train_step): the case the user met first.
    est = memprof.estimate(build(), torch.optim.Adagrad, inputs=IDS, targets=IDS, loss_fn=loss_fn)
    assert est.peak_bytes > 0 and any(p.phase.value == "optimizer" for p in est.trace.phases)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.ASGD(ps, foreach=True),
    lambda ps: torch.optim.Adafactor(ps),
    lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.01), momentum=0.9),
], ids=["asgd-foreach", "adafactor", "sgd-tensor-lr"])
def test_an_optimizer_step_that_reads_its_scalars_is_the_real_run(make):
    # ASGD reads its step counters, eta and mu (made on the parameter's device), Adafactor its count and each
    # parameter's norm, SGD a tensor learning rate: scalars of the update, answered 0 (the notes say where), the
    # allocations the real run's to the byte. memprof's own loop refused them (DataDependentOutputException,
    # blaming the model on the CPU target); under train_step= they were answered as the loop's own reads are.
    est = memprof.estimate(build(), make, inputs=IDS, targets=IDS, train_step=plain, steps=2)
    assert_same_run(est, measured(plain, make=make))
    own = memprof.estimate(build(), make, inputs=IDS, targets=IDS, loss_fn=loss_fn)
    answered = [n for n in own.notes if n.startswith("the optimizer's step read values that shape-only tensors do "
                                                     "not hold (") and "at torch/optim/" in n]
    # A tensor learning rate is lifted with its value (below): nothing of it is answered.
    assert bool(answered) == (type(make(build().parameters())) is not torch.optim.SGD), own.notes


def test_asgds_loop_step_takes_the_branch_a_zero_count_takes_and_is_never_under():
    # ASGD's for-loop step averages by `if mu.item() != 1` (torch/optim/asgd.py): answered 0, it takes the update
    # whose temporaries the real run's first steps (mu = 1: a copy) do not make. Over, never under.
    make = lambda ps: torch.optim.ASGD(ps, foreach=False)  # noqa: E731
    est = memprof.estimate(build(), make, inputs=IDS, targets=IDS, train_step=plain, steps=2)
    real = measured(plain, make=make)
    assert_never_under(est, real)
    assert est.trace.peak.total >= real.trace.peak.total


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar")
def test_a_plateau_scheduler_reading_the_loss_in_the_users_step_is_the_real_run():
    # ReduceLROnPlateau.step(loss) reads the loss (torch/optim/lr_scheduler.py): the user's loop's read, answered 0.
    def step(model, opt, x, y):
        loss = plain(model, opt, x, y)
        opt.plateau.step(loss)
        return loss

    def make(ps):
        opt = torch.optim.SGD(ps, lr=0.1)
        opt.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        return opt

    est = memprof.estimate(build(), make, inputs=IDS, targets=IDS, train_step=step, steps=2)
    assert_same_run(est, measured(step, make=make))


class _Reads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h * 2 if h.sum().item() > 0 else h  # the model reads a value in its forward


def test_a_value_the_model_reads_inside_a_closure_step_blames_the_model():
    # The model's forward runs inside torch.optim's step (step(closure)): the read is still the model's.
    from memprof.errors import SimulationError

    def step(model, opt, x):
        def closure():
            opt.zero_grad()
            loss = model(x).sum()
            loss.backward()
            return loss

        return opt.step(closure)

    with pytest.raises(SimulationError, match=r"The model reads tensor values"):
        memprof.estimate(_Reads(), lambda ps: torch.optim.SGD(ps, lr=0.1), inputs=torch.randn(4, 8),
                         train_step=step)


def test_lbfgs_is_refused_in_either_loop_and_a_closure_step_is_named():
    # LBFGS.step(closure) evaluates the model as often as its line search decides from values; answered 0 they
    # stopped it after one evaluation, a 2-step estimate 4.9 times under the real run's peak. Before, memprof's own
    # loop raised torch's TypeError ("missing 1 required positional argument: 'closure'") from the simulated step.
    from memprof.errors import InvalidArgumentError

    def step(model, opt, x, y):
        def closure():
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        return opt.step(closure)

    for kw in (dict(loss_fn=loss_fn), dict(train_step=step)):
        with pytest.raises(InvalidArgumentError, match=r"LBFGS cannot be simulated: .* memprof.profile"):
            memprof.estimate(build(), torch.optim.LBFGS, inputs=IDS, targets=IDS, **kw)

    class NeedsFn(torch.optim.SGD):  # a step that cannot be called without an argument, under any name
        def step(self, fn):
            fn()
            return super().step()

    with pytest.raises(InvalidArgumentError, match=r"NeedsFn.step\(\) needs an argument .* give train_step=fn"):
        memprof.estimate(build(), lambda ps: NeedsFn(ps, lr=0.1), inputs=IDS, targets=IDS, loss_fn=loss_fn)


def test_the_users_own_optimizer_handed_back_by_a_factory_is_never_changed():
    # Refused (its parameters are not the twin's), after the lifting ran: its counters were made fake tensors, and
    # torch.save(opt.state_dict()) failed in the user's process afterwards.
    from memprof.errors import MemprofError

    model = build()
    opt = torch.optim.Adagrad(model.parameters())
    before = {id(p): (s["step"], s["sum"]) for p, s in opt.state.items()}
    with pytest.raises(MemprofError):
        memprof.estimate(model, lambda ps: opt, inputs=IDS, targets=IDS, loss_fn=loss_fn)
    assert {id(p): (s["step"], s["sum"]) for p, s in opt.state.items()} == before
    assert all(type(s["step"]) is torch.Tensor for s in opt.state.values())


class _Shared(torch.optim.Optimizer):
    """One counter made by the constructor, shared by every parameter's state."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})
        one = torch.tensor(0.0)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["count"] = one

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def test_a_scalar_states_share_stays_one_tensor():
    est = memprof.estimate(build(), _Shared, inputs=IDS, targets=IDS, train_step=plain, steps=2)
    assert_same_run(est, measured(plain, make=_Shared))
    # One 4-byte counter, whatever the number of parameters sharing it.
    assert est.trace.phases[0].start[memprof.Category.OPTIMIZER_STATES] == 4


_T = torch.tensor


@pytest.mark.parametrize(("tensor", "number"), [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=_T(0.9)), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=_T(0.9), foreach=True),
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True)),
    (lambda ps: torch.optim.Adam(ps, weight_decay=_T(0.01)), lambda ps: torch.optim.Adam(ps, weight_decay=0.01)),
], ids=["sgd-momentum", "sgd-momentum-foreach", "adam-weight-decay"])
def test_a_hyperparameter_given_as_a_tensor_keeps_its_value(tensor, number):
    # torch.optim branches on it (`if momentum != 0` makes the momentum buffer, `if weight_decay != 0` a
    # temporary): faked without its value, the read was answered 0 and the estimate came out under by the whole
    # momentum buffer (a review's finding). Lifted with its value, as a constructor's counters are.
    est = memprof.estimate(build(), tensor, inputs=IDS, targets=IDS, train_step=plain, steps=2)
    assert_same_run(est, measured(plain, make=tensor))
    # memprof's own loop: the states the number makes (the momentum buffer), at every moment. (The tensor's own
    # comparisons make a few bytes of temporaries the number's do not: the real run's too, as above.)
    S = memprof.Category.OPTIMIZER_STATES

    def states(make):
        est = memprof.estimate(build(), make, inputs=IDS, targets=IDS, loss_fn=loss_fn)
        return [(p.start[S], p.peak[S], p.end[S]) for p in est.trace.phases]

    assert states(tensor) == states(number)
