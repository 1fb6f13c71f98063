"""An optimizer given to ``estimate`` that already holds state (a warm-up step taken, a checkpoint's
``load_state_dict``), and one that holds another model's parameters.

The twin's optimizer is rebuilt on the twin's parameters, and was rebuilt empty: the estimate was under by the whole
optimizer state until its first step, and with ``steps=1`` and SGD's momentum under at its peak (a new user's sweep
found both). The state is now carried into the simulation as the optimizer holds it; an optimizer over another
model's parameters is refused, as ``profile()`` refuses it (the estimate dropped them, with their state and step)."""

from __future__ import annotations

import pytest
import torch

import memprof
from memprof import Category as C
from memprof.errors import InvalidArgumentError
from test_parallelize import IDS, build, loss_fn
from test_sim_input_storage import square_step
from test_train_step import assert_same_run, measured, plain


def _warm(make):
    """A model and its optimizer after one real step."""
    model = build()
    opt = make(model.parameters())
    plain(model, opt, IDS, IDS)
    return model, opt


def _state_bytes(opt) -> int:
    """The optimizer's state tensors' storages, each counted once."""
    storages = {v.untyped_storage()._cdata: v.untyped_storage().nbytes()
                for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)}
    return sum(storages.values())


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, foreach=True),
                                  lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)], ids=["adamw", "sgd"])
@pytest.mark.parametrize("steps", [1, 2])
def test_a_warm_optimizer_is_the_real_runs_from_the_first_phase(make, steps):
    model, opt = _warm(make)
    # The estimate first: it reads the model and the optimizer, and changes neither.
    est = memprof.estimate(model, opt, inputs=IDS, targets=IDS, train_step=plain, steps=steps)
    real = measured(plain, steps, model=model, make=opt)
    assert_same_run(est, real)
    # The states held from the start: AdamW's two moments per parameter and a step counter each (4 B), SGD's
    # momentum buffer per parameter.
    held = _state_bytes(opt)
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)  # 57,728 B in 9 parameters
    assert held == (2 * weights + len(params) * 4 if isinstance(opt, torch.optim.AdamW) else weights)
    first = est.trace.phases[0]
    assert (first.step, first.phase.value, first.start[C.OPTIMIZER_STATES]) == (0, "forward", held)
    assert any("the optimizer held state before the estimate" in n for n in est.notes), est.notes


def test_an_optimizer_loaded_from_a_checkpoint_is_carried():
    # A fresh optimizer given a checkpoint's state (load_state_dict): the same state, the same estimate.
    model, warm = _warm(lambda ps: torch.optim.AdamW(ps, foreach=True))
    loaded = torch.optim.AdamW(model.parameters(), foreach=True)
    loaded.load_state_dict(warm.state_dict())
    est = memprof.estimate(model, loaded, inputs=IDS, targets=IDS, loss_fn=loss_fn, steps=1)
    assert est.trace.phases[0].start[C.OPTIMIZER_STATES] == _state_bytes(loaded) == _state_bytes(warm)


def test_a_warm_optimizers_state_on_a_cuda_target_is_on_the_device():
    # On a CUDA target the moments are on the device, each in the caching allocator's 512-byte blocks; AdamW's step
    # counters stay CPU tensors (not capturable), as torch keeps them.
    model, opt = _warm(lambda ps: torch.optim.AdamW(ps, foreach=True))
    est = memprof.estimate(model, opt, inputs=IDS, targets=IDS, loss_fn=loss_fn, gpu="h100-80gb", steps=1)
    per_param = sum(-(-p.numel() * 4 // 512) * 512 for p in model.parameters())
    assert est.trace.phases[0].start[C.OPTIMIZER_STATES] == 2 * per_param


def test_an_optimizer_of_another_models_parameters_is_refused():
    model = build()
    stale = torch.optim.AdamW(build().parameters())
    with pytest.raises(InvalidArgumentError, match=r"AdamW holds 9 parameter\(s\) that are not the model's.*"
                                                   r"or estimate the module that owns them"):
        memprof.estimate(model, stale, inputs=IDS, targets=IDS, loss_fn=loss_fn)


class _Scaled(torch.nn.Module):
    """A linear layer and a one-element parameter (a learned temperature, CLIP's logit scale)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.scale = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_one_element_parameters_moments_are_moments_not_counters():
    # A one-element parameter's Adam moments are one-element CPU tensors, as its step counter is: they were kept on
    # the host for a CUDA target (1,024 B under: two 512-byte blocks) and in fp32 beside a bf16 parameter, which the
    # step refused (a review). They are made as moments; the counters keep their values.
    x = torch.randn(8, 32)
    torch.manual_seed(0)
    model = _Scaled()
    opt = torch.optim.Adam(model.parameters())
    cold = memprof.estimate(model, lambda ps: torch.optim.Adam(ps), inputs=x, train_step=square_step, gpu="h100-80gb")
    square_step(model, opt, x)
    warm = memprof.estimate(model, opt, inputs=x, train_step=square_step, gpu="h100-80gb")
    # After the estimate's own steps both hold every state: the moments in blocks on the device, counters on the host.
    assert warm.trace.phases[-1].end[C.OPTIMIZER_STATES] == cold.trace.phases[-1].end[C.OPTIMIZER_STATES] == \
        2 * (-(-32 * 32 * 4 // 512) * 512 + 512 + 512)
    est = memprof.estimate(model, opt, inputs=x, train_step=square_step, precision="bf16")
    assert est.trace.phases[0].start[C.OPTIMIZER_STATES] == 2 * (32 * 32 + 32 + 1) * 2 + 3 * 4  # bf16 moments
    est = memprof.estimate(model, opt, inputs=x, train_step=square_step, steps=2)  # first: the real run steps opt
    assert_same_run(est, measured(square_step, model=model, make=opt, batch=(x,)))
