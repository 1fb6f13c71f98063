"""Inputs that are views of a larger storage (a batch sliced from a dataset held as one tensor).

The real run holds the whole storage, which memprof counts as inputs; the estimate made a twin of the view's
extent only and was under by the rest (5,952 B for 2 rows of a 64 x 12 int64 tensor: a new user's sweep). On the
CPU target the twin is now the same view of a twin of the whole storage, one per storage; on a CUDA target the
batch reaches the device as a copy of the view, as a real run copies it."""

from __future__ import annotations

import pytest
import torch

import memprof
from memprof import Category as C
from test_parallelize import build, loss_fn
from test_train_step import assert_same_run, measured, plain

DATA = torch.randint(0, 96, (64, 8), generator=torch.Generator().manual_seed(0))  # 64 x 8 int64: 4,096 B


def test_a_batch_sliced_from_a_dataset_holds_the_whole_storage_as_the_real_run():
    ids, targets = DATA[:2], DATA[2:4]  # two views of one storage
    real = measured(plain, model=build(), batch=(ids, targets))
    est = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps, foreach=True), inputs=ids, targets=targets,
                           train_step=plain)
    assert_same_run(est, real)
    # The dataset's storage once (64 x 8 x 8 B), not the two views' 2 x 128 B.
    assert est.trace.phases[0].peak[C.INPUTS] == real.trace.phases[0].peak[C.INPUTS] == 64 * 8 * 8


def test_a_strided_view_keeps_its_layout_on_its_storage():
    # Every other row from the 10th: an offset and a stride over the same storage.
    ids = DATA[10::2][:2]
    est = memprof.estimate(build(), None, inputs=ids, targets=DATA[:2], loss_fn=loss_fn)
    assert est.trace.phases[0].peak[C.INPUTS] == 64 * 8 * 8


def test_on_a_cuda_target_the_batch_is_a_copy_of_the_view():
    ids = DATA[:2]
    est = memprof.estimate(build(), None, inputs=ids, targets=ids, loss_fn=loss_fn, gpu="h100-80gb")
    # 2 x 8 int64 (128 B) in one 512-byte block of the caching allocator.
    assert est.trace.phases[0].peak[C.INPUTS] == 512


class _Lin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(x)


def square_step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("kind", ["requires_grad", "bytes"])
def test_an_input_that_asks_its_gradient_or_views_a_byte_buffer_is_the_real_runs(kind):
    # An input with requires_grad holds its gradient after backward (its twin held none: 1,024 B under); a float view
    # of a 1,027-byte buffer holds the whole buffer (the view alone was made, 3 B under). Both a review's findings.
    if kind == "requires_grad":
        x = torch.randn(8, 32).requires_grad_()
    else:
        x = torch.zeros(8 * 32 * 4 + 3, dtype=torch.uint8)[:-3].view(torch.float32).view(8, 32)
    make = torch.optim.Adam
    torch.manual_seed(0)
    real = measured(square_step, model=_Lin(), make=make, batch=(x,))
    x.grad = None
    torch.manual_seed(0)
    est = memprof.estimate(_Lin(), make, inputs=x, train_step=square_step)
    assert_same_run(est, real)


def test_an_inputs_gradient_from_before_the_run_is_counted_from_its_start_and_simulated_so():
    # A warm-up step outside the profile left x.grad: backward accumulates into it in place, so the profile never saw
    # it made and left its bytes out; the estimate made a fresh one in its first backward, 20,480 B over.
    from phases import assert_equal_everywhere

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    x, y = torch.randn(8, 20, 32, requires_grad=True), torch.randint(0, 10, (8, 20))

    def loss(out, target):
        return torch.nn.functional.cross_entropy(out.reshape(-1, 10), target.reshape(-1))

    def run(batch):
        opt = torch.optim.AdamW(model.parameters())
        with memprof.profile(model, opt) as prof:
            for _ in range(2):
                step_loss = loss(model(batch), y)
                step_loss.backward()
                opt.step()
                opt.zero_grad()
            del step_loss
        return prof.report()

    fresh = run(x.detach().clone().requires_grad_())  # no gradient before the run
    loss(model(x), y).backward()
    model.zero_grad()  # the parameters' gradients gone; the input's stays
    real = run(x)
    # x.grad, 8 x 20 x 32 fp32 = 20,480 B, a temporary from the first forward on: one more than the fresh run holds.
    assert real.trace.phases[0].end[C.TEMPORARIES] == fresh.trace.phases[0].end[C.TEMPORARIES] + 8 * 20 * 32 * 4
    est = memprof.estimate(model, torch.optim.AdamW, inputs=x, targets=y, loss_fn=loss, steps=2)
    assert_equal_everywhere(est, real)
