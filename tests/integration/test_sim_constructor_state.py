"""An optimizer whose constructor makes its states (Adagrad: ``torch.tensor(0.0)`` step counters and ``sum``
in its ``__init__``, torch/optim/adagrad.py) simulates on the CPU target as it runs.

The counters were real CPU scalars among the twin's fake states; the fake-tensor mode faked them without their value
at the step's first op, and the for-loop step's ``_get_value(step)`` (``.item()``) failed: ``estimate(model,
torch.optim.Adagrad)`` raised ``DataDependentOutputException`` on the default target, blaming the model. They are
now made as the fake tensor that a counter made in a step is (Adam's, ``memprof.simulate.twin._lifted``), and the
estimate is the real run's to the byte."""

from __future__ import annotations

import pytest
import torch

import memprof
from test_train_step import IDS, assert_same_run, build, loss_fn


def plain(model, opt, x, y):
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("options", [{}, {"foreach": True}, {"weight_decay": 0.1, "lr_decay": 0.01}],
                         ids=["default", "foreach", "decays"])
def test_adagrad_on_the_cpu_is_the_real_run(options):
    def adagrad(params):
        return torch.optim.Adagrad(params, **options)

    model = build()
    opt = adagrad(model.parameters())
    with memprof.profile(model, opt) as prof:
        out = None
        for _ in range(2):
            out = plain(model, opt, IDS, IDS)
        del out
    est = memprof.estimate(build(), adagrad, inputs=IDS, targets=IDS, train_step=plain, steps=2)
    assert_same_run(est, prof.report())
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


@pytest.mark.parametrize("optimizer", [torch.optim.ASGD, torch.optim.Adafactor])
@pytest.mark.parametrize("gpu", [None, "h100-80gb"])
def test_an_optimizer_whose_step_reads_values_is_named_not_the_model(optimizer, gpu):
    # ASGD reads its counters (made on the parameter's device), Adafactor a parameter's norm: on the CPU target the
    # fake tensor's DataDependentOutputException names only the op, and the error blamed the model's code.
    from memprof.errors import SimulationError

    with pytest.raises(SimulationError, match=r"The optimizer's step reads tensor values") as info:
        memprof.estimate(build(), optimizer, inputs=IDS, targets=IDS, loss_fn=loss_fn, gpu=gpu)
    assert "the model reads" not in str(info.value)


def test_an_optimizer_whose_step_needs_a_closure_is_refused_for_memprofs_loop_and_runs_in_the_users():
    # LBFGS.step(closure) evaluates the model itself; memprof's own loop calls step() and torch raised its TypeError
    # ("missing 1 required positional argument: 'closure'") from inside the simulated step.
    from memprof.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"LBFGS.step\(\) takes a closure .* give train_step=fn"):
        memprof.estimate(build(), torch.optim.LBFGS, inputs=IDS, targets=IDS, loss_fn=loss_fn)

    def step(model, opt, x, y):
        def closure():
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        return opt.step(closure)

    est = memprof.estimate(build(), torch.optim.LBFGS, inputs=IDS, targets=IDS, train_step=step)
    assert any(p.phase.value == "optimizer" for p in est.trace.phases)
    # LBFGS reads the loss and the gradients' values; the notes say they were answered 0.
    assert any("answered 0" in n for n in est.notes), est.notes
