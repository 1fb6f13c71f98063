"""The model an estimate copies onto shape-only twins (``memprof.simulate.twin._shadow_copy``): a tensor an
autograd graph made, kept as a plain attribute, gets a data-less twin too.

The deprecated ``nn.utils.weight_norm`` keeps its ``weight`` as such a tensor (recomputed from ``weight_g`` and
``weight_v`` by a pre-hook at every call), which ``copy.deepcopy`` refuses ("Only Tensors created explicitly by the
user support the deepcopy protocol"): the estimate was refused, advising to build the model on the meta device,
which failed the same way (a sweep's finding)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memprof
from test_train_step import assert_same_run, measured


def _built(device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(nn.utils.weight_norm(nn.Linear(8, 16)), nn.ReLU(), nn.Linear(16, 4))


def _step(model, opt, x, y):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")
def test_the_deprecated_weight_norm_is_the_real_run():
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    real = measured(_step, model=_built(), make=torch.optim.AdamW, batch=(x, y))
    est = memprof.estimate(_built(), torch.optim.AdamW, inputs=x, targets=y, train_step=_step, steps=2)
    assert_same_run(est, real)
    # Built on the meta device, as the refusal advised: it simulates too, with the same figures.
    meta = memprof.estimate(_built("meta"), torch.optim.AdamW, inputs=x, targets=y, train_step=_step, steps=2)
    assert meta.trace.phases == est.trace.phases


def test_an_op_whose_output_shape_follows_values_is_named_so():
    # F.ctc_loss in the step: DynamicOutputShapeException, which the error called "the model must run on
    # shape-only tensors", and whose fix (the same call on real tensors) runs.
    from memprof.errors import SimulationError

    def step(model, opt, x, y):
        log_probs = model(x).log_softmax(-1).transpose(0, 1)  # (time, batch, classes)
        loss = nn.functional.ctc_loss(log_probs, y, torch.full((2,), 6), torch.full((2,), 3))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    model = nn.Linear(8, 5)
    with pytest.raises(SimulationError, match=r"output shape depends on tensor values"):
        memprof.estimate(model, torch.optim.SGD, inputs=torch.randn(2, 6, 8), targets=torch.randint(1, 5, (2, 3)),
                         train_step=step)


def test_a_graph_made_attribute_no_hook_makes_again_is_refused():
    # Used by the forward as it is, its copy without a graph would take its parameter's gradient away (a review
    # found the estimate failing with "element 0 of tensors does not require grad ... the same call with real
    # tensors ... is the way to check it", which a real step passes).
    from memprof.errors import InvalidArgumentError

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.randn(8, 4))
            self.w = self.p * 2

        def forward(self, x):
            return x @ self.w

    with pytest.raises(InvalidArgumentError, match=r"Scaled\.w is a tensor an autograd graph made"):
        memprof.estimate(Scaled(), torch.optim.SGD, inputs=torch.randn(2, 8), steps=1)


class _CastsItsRouter(nn.Module):
    """A forward that casts a submodule to its own dtype at every call, as transformers' SwitchTransformers router
    does (``self.classifier = self.classifier.to(self.dtype)``)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        self.router = self.router.to(torch.float32)
        return self.head(self.router(x))


def test_a_forward_that_casts_a_submodule_to_its_own_dtype_is_the_real_run():
    # torch swaps the parameters of a module of fake tensors at every .to(), and the fake mode's weak references to
    # them refuse a swap: the estimate failed ("_apply(): Couldn't swap Linear.weight", a new user's sweep) where the
    # real run's .to() leaves its tensors as they are. The twin's modules now leave them too.
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    torch.manual_seed(0)
    real = measured(_step, model=_CastsItsRouter(), make=torch.optim.AdamW, batch=(x, y))
    torch.manual_seed(0)
    model = _CastsItsRouter()
    est = memprof.estimate(model, torch.optim.AdamW, inputs=x, targets=y, train_step=_step, steps=2)
    assert_same_run(est, real)
    assert "_apply" not in vars(model.router)  # the user's modules are not the twin's


class _MasksByChance(nn.Module):
    """A training-time masking by chance, as wav2vec2's SpecAugment does it: the masked steps replaced by a learned
    embedding through a boolean mask (``hidden[mask] = embedding``)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(8))
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        x = x.clone()
        x[torch.rand(x.shape[:2]) < 0.5] = self.embed
        return self.lin(x)


def test_a_boolean_mask_in_the_model_is_named_with_the_configs_way_out():
    # The gradient of a boolean-mask assignment runs nonzero in backward: the error blamed "CTC's alignment, packed
    # sequences' lengths" and advised a loss_fn (a new user's sweep, wav2vec2 and HuBERT in training mode). It now
    # names boolean-mask indexing and the config's training-time masking as the way out.
    from memprof.errors import SimulationError

    with pytest.raises(SimulationError, match=r"indexing with a boolean mask.*mask_time_prob or layerdrop"):
        memprof.estimate(_MasksByChance(), torch.optim.SGD, inputs=torch.randn(2, 6, 8),
                         targets=torch.randn(2, 6, 4), loss_fn=nn.functional.mse_loss)


class _CastsToBf16(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        self.b.to(torch.bfloat16)  # a conversion that changes the submodule (fp32 the first time)
        return self.b(self.a(x).bfloat16())


def test_a_forward_that_casts_a_submodule_to_another_dtype_is_the_real_run():
    # Its parameters' data set to the converted tensors, as a real module's _apply sets them: the swap torch makes
    # for fake parameters failed ("Couldn't swap", a review's finding).
    def step(model, opt, x):
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x = torch.randn(8, 16)
    make = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    torch.manual_seed(0)
    real = measured(step, model=_CastsToBf16(), make=make, batch=(x,))
    torch.manual_seed(0)
    est = memprof.estimate(_CastsToBf16(), make, inputs=x, train_step=step)
    assert_same_run(est, real)


class _LstmToDouble(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(16, 16, batch_first=True)

    def forward(self, x):
        self.rnn.to(torch.float64)  # RNNBase's own _apply: torch's, then its weights flattened again
        return self.rnn(x.double().unsqueeze(1))[0].squeeze(1)


def test_an_rnn_converted_in_forward_is_the_real_run():
    # RNNBase._apply calls torch's, which swaps fake parameters and failed ("Couldn't swap LSTM.weight_ih_l0", a
    # review's finding): the data is set, then the weights flattened as RNNBase does.
    def step(model, opt, x, y):
        loss = ((model(x).float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x, y = torch.randn(4, 16), torch.randn(4, 16)
    make = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    torch.manual_seed(0)
    real = measured(step, model=_LstmToDouble(), make=make, batch=(x, y))
    torch.manual_seed(0)
    est = memprof.estimate(_LstmToDouble(), make, inputs=x, targets=y, train_step=step)
    assert_same_run(est, real)
