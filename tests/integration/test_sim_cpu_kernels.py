"""A CPU target's simulation follows the CPU kernels' output storages, not only their shapes.

On a real CPU some kernels return an output whose storage is not its shape's: ``F.mse_loss`` with a
reduction returns a 0-dim loss that keeps the whole elementwise buffer. Fake tensors give it 4 bytes;
:mod:`memprof.simulate.cpu_kernels` gives it what the CPU kernel keeps. Which ops differ was found by
``benchmarks/cpu_kernel_sweep.py`` over torch's own operator samples; benchmarks/cases/test_kernel_sweep.py runs
that sweep on the ops with rules and requires every output to match the real kernel (a minute of two cores: apart
from the suite, whose per-rule cases here hold each rule to the real kernel).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import memprof
from memprof.simulate.cpu_kernels import CpuKernels


# ---------------------------------------------------------------- the issue's model, estimated and measured


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in self.qkv(x).split(h, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class _Block(nn.Module):
    """A pre-LN transformer block."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = _Attention(hidden, heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_Block(128, 4), _Block(128, 4))


def _moments(trace) -> list:
    return [(p.phase, p.start, p.peak, p.end) for p in trace.phases]


@pytest.mark.parametrize("precision", [None, "mixed"])
def test_a_pre_ln_stack_with_mse_loss_equals_a_real_cpu_run_at_every_phase_moment(precision):
    b, s, h = 4, 64, 128
    x, y = torch.randn(b, s, h), torch.randn(b, s, h)
    est = memprof.estimate(_stack(), lambda ps: torch.optim.AdamW(ps), inputs=x, targets=y, loss_fn=F.mse_loss,
                           device="cpu", precision=precision)
    model = _stack()
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "mixed"):
                loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        del loss  # the loop has ended: its last loss is released, as the estimate's loop releases it
    measured = prof.report().trace
    # Start, peak and end of every phase of both steps, every category, to the byte.
    assert _moments(est.trace) == _moments(measured)
    # The loss keeps its elementwise buffer into backward: 4 * 64 * 128 fp32 elements = 131,072 B, also under
    # autocast (CPU autocast runs mse_loss in fp32), where its 0-dim shape alone is 4 B. Two steps, one loss each.
    assert any("aten.mse_loss x2 (+256.0 KiB)" in n for n in est.notes), est.notes  # 2 * (131,072 - 4) B


@pytest.mark.parametrize("precision", [None, "mixed"])
def test_a_layer_norm_of_a_transposed_input_is_laid_out_as_the_cpu_lays_it_out(precision):
    # The CPU's layer norm kernels write the output and the input's gradient contiguously, the meta kernels in the
    # input's layout. Swin's layer norms meet transposed tensors (its patch embedding's flatten(2).transpose(1, 2)):
    # the reshape on the gradient's way back copied in the simulation only, 8,192 B over in temporaries at the
    # backward peak (a new user's sweep). Its window attention (window_size=4 of an 8 x 8 map) is the same on both
    # sides.
    transformers = pytest.importorskip("transformers")
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1], num_heads=[2],
                                     window_size=4, num_labels=10)
    pixels, labels = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])

    def step(model, opt, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "mixed"):
            loss = F.cross_entropy(model(pixel_values=x).logits.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def build():
        torch.manual_seed(0)
        return transformers.SwinForImageClassification(config).train()

    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with memprof.profile(model, opt) as prof:
        out = step(model, opt, pixels, labels)
        del out
    est = memprof.estimate(build(), lambda ps: torch.optim.SGD(ps, lr=0.01), inputs=pixels, targets=labels,
                           train_step=step, steps=1)
    assert _moments(est.trace) == _moments(prof.report().trace)


def test_a_cnn_under_cpu_autocast_equals_a_real_run_at_every_phase_moment():
    # Under CPU autocast a convolution returns bf16, and BatchNorm meets it with fp32 parameters.
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 16, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.Conv2d(16, 32, 3, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    est = memprof.estimate(build(), lambda ps: torch.optim.SGD(ps, lr=0.1), inputs=x, targets=y,
                           loss_fn=F.cross_entropy, device="cpu", precision="mixed")
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        del loss  # the loop has ended: its last loss is released, as the estimate's loop releases it
    assert _moments(est.trace) == _moments(prof.report().trace)
    # Each BatchNorm's mean and inverse deviation in fp32, not bf16: two steps of two BatchNorms, each with
    # two statistics, 2 * 2 * (16 + 32) * (4 - 2) B = 384 B.
    assert any("aten.native_batch_norm x4 (+384 B)" in n for n in est.notes), est.notes


# ---------------------------------------------------------------- each rule against the real kernel


class _Outputs(TorchDispatchMode):
    """Every aten op called beneath it, with the storage bytes of each tensor it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = [t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if made:  # fake tensors answer device queries through dispatch too
            self.seen.append((str(func), made))
        return out


def _run(fn, tensors, backward):
    out = fn(*tensors)
    if backward:
        leaves = [t for t in tensors if t.requires_grad]
        torch.autograd.grad(out, leaves, torch.ones_like(out))


def _real(fn, tensors, backward):
    rec = _Outputs()
    with rec:
        _run(fn, tensors, backward)
    return rec.seen


def _simulated(fn, tensors, backward, rules=True):
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # as the estimate's: indices the cases close over too
    fakes = [mode.from_tensor(t) for t in tensors]
    rec = _Outputs()
    # As an estimate stacks them: the fake tensors beneath, the rules, the profiler (here the recorder) above.
    with mode, (CpuKernels() if rules else _Nothing()), rec:
        _run(fn, fakes, backward)
    return rec.seen


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _leaf(*shape, dtype=torch.float32, grad=True):
    return torch.rand(*shape, dtype=dtype).requires_grad_(grad)


def _cases():
    A = torch.ops.aten
    ids = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    offsets = torch.tensor([0, 3, 5])
    return [
        # The issue's loss: 4 x 64 x 128 elements kept under the 0-dim loss, in fp32 (131,072 B) and bf16 (65,536 B).
        ("mse_loss mean fp32", lambda x, y: F.mse_loss(x, y), [_leaf(4, 64, 128), _leaf(4, 64, 128, grad=False)], True),
        ("mse_loss mean bf16", lambda x, y: F.mse_loss(x, y),
         [_leaf(4, 64, 128, dtype=torch.bfloat16), _leaf(4, 64, 128, dtype=torch.bfloat16, grad=False)], True),
        # Broadcast at the aten level: the buffer has the broadcast shape, 4 x 5 x 8.
        ("mse_loss sum broadcast", lambda x, y: A.mse_loss(x, y, 2), [_leaf(4, 1, 8), _leaf(1, 5, 8, grad=False)],
         True),
        ("smooth_l1_loss", lambda x, y: F.smooth_l1_loss(x, y, beta=0.5), [_leaf(6, 7), _leaf(6, 7, grad=False)],
         True),
        ("soft_margin_loss sum", lambda x, y: F.soft_margin_loss(x, y, reduction="sum"),
         [_leaf(3, 9), _leaf(3, 9, grad=False)], True),
        ("binary_cross_entropy weighted", lambda x, y, w: F.binary_cross_entropy(x, y, w),
         [_leaf(5, 6), _leaf(5, 6, grad=False), _leaf(6, grad=False)], True),
        # im2col keeps its input's size when its output is smaller (stride 3), col2im (unfold's backward) too.
        ("unfold stride 3", lambda x: F.unfold(x, 2, stride=3), [_leaf(2, 3, 8, 8)], True),
        ("unfold kernel 3", lambda x: F.unfold(x, 3), [_leaf(2, 3, 6, 6)], True),
        ("fold", lambda c: F.fold(c, (5, 5), 2, stride=2), [_leaf(2, 12, 4)], True),
        # offset2bag at one element more than it keeps; bag_size at the length of offsets.
        ("embedding_bag mean", lambda w: F.embedding_bag(ids, w, offsets, mode="mean"), [_leaf(10, 4)], True),
        ("embedding_bag sum, last offset", lambda w: F.embedding_bag(ids, w, torch.tensor([0, 3, 8]), mode="sum",
                                                                  include_last_offset=True), [_leaf(10, 4)], True),
        ("embedding_bag max, no grad", lambda w: F.embedding_bag(ids, w, offsets, mode="max", include_last_offset=True),
         [_leaf(10, 4, grad=False)], False),
        # bf16 takes the CPU's fast path (offset2bag left empty), which the meta kernel keeps for fp32 and fp16.
        ("embedding_bag sum bf16", lambda w: F.embedding_bag(ids, w, offsets, mode="sum"),
         [_leaf(10, 4, dtype=torch.bfloat16)], True),
        ("sparse.mm amax", lambda b: torch.sparse.mm(_SPARSE, b, "amax"), [_leaf(5, 3)], True),
        # Channels-last in, channels-last out: the meta kernel's contiguous output makes backward copy.
        ("max_unpool2d channels-last", lambda x, i: F.max_unpool2d(x, i, 2, output_size=(6, 8)),
         [_leaf(2, 3, 3, 4).contiguous(memory_format=torch.channels_last).detach().requires_grad_(),
          torch.zeros(2, 3, 3, 4, dtype=torch.long).contiguous(memory_format=torch.channels_last)], True),
        # A bf16 input with fp32 parameters: the CPU keeps the statistics in fp32, the meta kernels in bf16; group
        # norm's backward returns the input's gradient in bf16, its meta kernel in fp32.
        ("batch_norm, bf16 input, fp32 parameters",
         lambda x, w, b: F.batch_norm(x, torch.zeros(8), torch.ones(8), w, b, training=True),
         [_leaf(4, 8, 5, 5, dtype=torch.bfloat16), _leaf(8), _leaf(8)], True),
        ("group_norm, bf16 input, fp32 parameters", lambda x, w, b: F.group_norm(x, 4, w, b),
         [_leaf(4, 8, 5, 5, dtype=torch.bfloat16), _leaf(8), _leaf(8)], True),
        ("layer_norm, bf16 input, fp32 weight", lambda x, w: F.layer_norm(x, (8,), w),
         [_leaf(4, 5, 8, dtype=torch.bfloat16), _leaf(8)], True),
        ("layer_norm, no rows", lambda x, w, b: F.layer_norm(x, (8,), w, b),
         [_leaf(0, 8, dtype=torch.bfloat16), _leaf(8), _leaf(8)], True),
        ("_native_batch_norm_legit, bf16 input, fp32 parameters",
         lambda x, w, b: A._native_batch_norm_legit(x, w, b, torch.zeros(8), torch.ones(8), True, 0.1, 1e-5)[0],
         [_leaf(4, 8, 5, dtype=torch.bfloat16), _leaf(8), _leaf(8)], False),
        # A bf16 prediction against an fp32 target: the CPU makes these results and input gradients like the
        # input, in bf16, where the meta kernels promote to fp32.
        ("soft_margin_loss, bf16 input, fp32 target", lambda x, y: F.soft_margin_loss(x, y),
         [_leaf(6, 7, dtype=torch.bfloat16), _leaf(6, 7, grad=False)], True),
        ("huber_loss, bf16 input, fp32 target", lambda x, y: F.huber_loss(x, y, reduction="none"),
         [_leaf(6, 7, dtype=torch.bfloat16, grad=False), _leaf(6, 7, grad=False)], False),  # (no such backward)
        ("mse_loss backward, bf16 input, fp32 target", lambda x, y: A.mse_loss(x, y, 1),
         [_leaf(6, 7, dtype=torch.bfloat16), _leaf(6, 7, grad=False)], True),
        ("normal, bf16 mean, fp32 std", lambda m, sd: torch.normal(m, sd),
         [_leaf(6, 7, dtype=torch.bfloat16, grad=False), _leaf(6, 7, grad=False)], False),
    ]


with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # sparse CSR support is in beta
    _SPARSE = torch.tensor([[1.0, 0, 2, 0, 0], [0, 0, 0, 3, 0], [4, 0, 0, 0, 5], [0, 6, 0, 0, 0],
                            [0, 0, 7, 0, 8]]).to_sparse_csr()


@pytest.mark.parametrize("name, fn, tensors, backward", _cases(), ids=[c[0] for c in _cases()])
def test_each_rule_gives_every_output_the_storage_of_the_real_cpu_kernel(name, fn, tensors, backward):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = _real(fn, tensors, backward)
        # Without the rules the fake kernels differ here (the case needs a rule), with them not an op or a byte.
        assert _simulated(fn, tensors, backward, rules=False) != real
        assert _simulated(fn, tensors, backward) == real


def test_the_issues_loss_keeps_its_whole_elementwise_buffer():
    x, y = torch.rand(4, 64, 128, requires_grad=True), torch.rand(4, 64, 128)
    real = _real(lambda a, b: F.mse_loss(a, b), [x, y], False)
    # 4 * 64 * 128 fp32 elements = 131,072 B under the 0-dim loss; ((x - y) ** 2).mean() would hold 4 B.
    assert real == [("aten.mse_loss.default", [131072])]
    assert _simulated(lambda a, b: F.mse_loss(a, b), [x, y], False) == real


def test_the_rules_leave_real_tensors_alone():
    x, y = torch.rand(4, 8), torch.rand(4, 8)
    with CpuKernels() as rules:
        loss = F.mse_loss(x, y)
    # A real tensor's storage would really grow: the rules leave it as the kernel made it (here that is
    # the buffer already, 4 * 8 * 4 = 128 B).
    assert loss.untyped_storage().nbytes() == 128 and not rules.used


def test_the_rules_leave_with_the_estimate_also_when_the_step_raises():
    def bad_loss(out, target):
        F.mse_loss(out, target)  # a rule runs ...
        raise ValueError("the user's loss fails")  # ... and then the step raises

    with pytest.raises(ValueError, match="the user's loss fails"):
        memprof.estimate(nn.Linear(4, 4), None, inputs=torch.randn(2, 4), targets=torch.randn(2, 4),
                         loss_fn=bad_loss, device="cpu")
    assert torch._C._len_torch_dispatch_stack() == 0


class _NormLayouts(TorchDispatchMode):
    """Each batch norm op beneath it (forward and backward), with the shape and strides of its first output."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "batch_norm" in str(func):
            first = out[0] if isinstance(out, tuple) else out
            self.seen.append((str(func), tuple(first.shape), first.stride()))
        return out


def _norm_layouts(x: torch.Tensor, training: bool, fake: bool) -> list:
    norm = (nn.BatchNorm1d if x.dim() < 4 else nn.BatchNorm2d)(x.shape[1])
    norm.train(training)
    rec = _NormLayouts()
    if not fake:
        with rec:
            norm(x).sum().backward()
        return rec.seen
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        twin = mode.from_tensor(x.detach()).requires_grad_()
        with CpuKernels(), rec:
            norm(twin).sum().backward()
    return rec.seen


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 16, 8).transpose(1, 2),  # PatchTST's BatchNorm1d over x.transpose(1, 2)
    lambda: torch.randn(8, 4).t(),
    lambda: torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last),
    lambda: torch.randn(4, 4, 8, 2).permute(3, 2, 1, 0),
], ids=["transposed_3d", "transposed_2d", "channels_last", "permuted_4d"])
def test_batch_norm_lays_out_its_output_and_input_gradient_as_the_cpu_does(make, training):
    # batch_norm_cpu and its backward make both with empty_like(input, input.suggest_memory_format()): contiguous
    # unless the input is channels-last. The meta kernels kept a transposed input's strides in both, and the input
    # gradient contiguous for a channels-last input in eval mode.
    x = make().requires_grad_()
    assert _norm_layouts(x, training, fake=True) == _norm_layouts(x, training, fake=False)


def test_linears_after_a_batch_norm_of_a_transposed_input_equal_a_real_run_at_every_phase_moment():
    # The real norm's output is contiguous, so the transpose back is not, and each Linear copies its input and saves
    # the copy; with the meta kernel's layout the simulation made neither copy (18.8 % low with three Linears).
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(32)
            self.projs = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))

        def forward(self, x):
            h = self.norm(x.transpose(1, 2)).transpose(1, 2)
            return sum(p(h) for p in self.projs)

    torch.manual_seed(0)
    model, x, y = Model(), torch.randn(64, 16, 32), torch.randn(64, 16, 32)
    est = memprof.estimate(model, torch.optim.AdamW, inputs=x, targets=y, loss_fn=F.mse_loss, steps=2)
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        del loss
    assert _moments(est.trace) == _moments(prof.report().trace)
