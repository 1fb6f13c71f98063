"""Profiling never changes training, and never stays silent about what it missed.

Each test runs the user's code with and without memprof and requires the same
behaviour (bit-identical parameters, the same hooks run, the same errors), or
an exact figure against an independent count, or a report that says "not
measured" with a note where memprof cannot see.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C
from memprof.errors import ProfilerStateError

from helpers import hook_registry, unique_bytes, weight_bytes

MODES = ("exact", "light")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _train(model, opt, x, steps=3, ctx=contextlib.nullcontext):
    # Not tests/training.py's loop: ``ctx`` (the user's saved-tensor hooks) wraps the forward and the loss
    # but not the backward, as a user's compression context does.
    for _ in range(steps):
        with ctx():
            loss = model(x).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()


# ------------------------------------------------------------------ 1. the user's saved-tensor hooks


class Compress:
    """Activation compression: keep saved tensors in bf16, as users do to save memory. It changes the
    gradients, so a profile that switched these hooks off would train differently."""

    def __init__(self):
        self.packed = 0
        self.kept: list[torch.Tensor] = []

    def pack(self, t):
        self.packed += 1
        small = t.to(torch.bfloat16)
        self.kept.append(small)
        return small, t.dtype

    def unpack(self, packed):
        small, dtype = packed
        return small.to(dtype)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


@pytest.mark.parametrize("mode", MODES)
def test_users_saved_tensor_hooks_around_the_block_run_as_without_memprof(mode):
    x = torch.randn(8, 16)
    results = []
    for profiled in (False, True):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        comp = Compress()
        with comp.hooks():
            with memprof.profile(model, opt, mode=mode) if profiled else contextlib.nullcontext():
                _train(model, opt, x)
        results.append((comp.packed, [p.detach().clone() for p in model.parameters()]))
    (count_plain, params_plain), (count_prof, params_prof) = results
    assert count_prof == count_plain == 3 * 5  # x, tanh output (as Tanh's output and Linear's input), W2, pow's input
    assert all(torch.equal(a, b) for a, b in zip(params_plain, params_prof))


def test_activations_are_measured_through_the_users_hooks():
    model, x = _mlp(), torch.randn(8, 16)
    comp = Compress()
    with memprof.profile(model) as prof:
        with comp.hooks():
            out = model(x)
        out.sum().backward()
    # What autograd holds is what the pack returned: bf16 copies. Linear 0 saves x (its weight is not
    # needed: x needs no gradient), Tanh its output, Linear 2 that output again (a second copy) and its
    # weight: 8*16*2 + 8*32*2 + 8*32*2 + 32*4*2 = 256 + 512 + 512 + 256 = 1536 B.
    assert unique_bytes(comp.kept) == 1536
    assert prof.report().breakdown(0, "forward", "end")[C.ACTIVATIONS] == 1536
    assert any("saved_tensors_hooks of your own" in n and "Compress.pack" in n for n in prof.trace.notes)


def test_hooks_that_keep_nothing_on_the_device_give_no_activations():
    # Offloading to disk (here: a dict) keeps no tensor memprof can see: activations are truly 0, not
    # unmeasured, and the tensors are freed.
    store = {}

    def pack(t):
        store[len(store)] = t.tolist()
        return len(store) - 1

    def unpack(key):
        return torch.tensor(store[key])

    model, x = _mlp(), torch.randn(8, 16)
    with memprof.profile(model) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = model(x)
        out.sum().backward()
    assert prof.report().breakdown(0, "forward", "end")[C.ACTIVATIONS] == 0
    assert len(store) == 4


# ------------------------------------------------------------------ 2. torch's in-place check


def _modified_output(model, x):
    y = torch.sigmoid(model(x))
    y.mul_(2)
    return y.sum()


def _modified_weight(model, x):
    y = model(x).sum()
    with torch.no_grad():
        model.weight.add_(1)  # the weight Linear saved for backward (x requires grad here)
    return y


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [_modified_output, _modified_weight])
def test_inplace_modification_of_a_saved_tensor_raises_as_without_memprof(mode, case):
    messages = []
    for profiled in (False, True):
        torch.manual_seed(0)
        model, x = nn.Linear(3, 3), torch.randn(2, 3, requires_grad=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
            with memprof.profile(model, mode=mode) if profiled else contextlib.nullcontext():
                case(model, x).backward()
        messages.append(re.search(r"is at version \d+; expected version \d+ instead", str(info.value)).group())
    assert messages[0] == messages[1]


@pytest.mark.parametrize("mode", MODES)
def test_inplace_ops_torch_allows_still_train_identically(mode):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x):
            h = F.relu(self.fc1(x), inplace=True)  # writes addmm's output, which nothing saved: allowed
            h = F.dropout(h * 2, 0.5, training=True)
            return self.fc2(h).add_(1)  # the same for fc2's output

    x = torch.randn(4, 8)
    grads = []
    for profiled in (False, True):
        torch.manual_seed(0)
        model = Net()
        with memprof.profile(model, mode=mode) if profiled else contextlib.nullcontext():
            torch.manual_seed(1)
            model(x).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ------------------------------------------------------------------ 3. hooks left behind


class Detr(nn.Module):
    """A parameter handed to a submodule every forward (DETR's query embeddings)."""

    def __init__(self):
        super().__init__()
        self.query = nn.Embedding(4, 8)
        self.decoder = nn.Linear(8, 8)
        self.head = nn.Identity()

    def forward(self, x):
        return self.head(self.decoder(self.query.weight) + x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("raises", [False, True])
def test_every_tensor_module_and_optimizer_keeps_exactly_its_hooks(mode, raises):
    model = Detr()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    target = torch.randn(4, 8)
    user_hook = model.decoder.register_forward_hook(lambda *a: None)  # the user's own hooks stay
    model.query.weight.register_hook(lambda g: None)
    _train(model, opt, x, steps=1)  # optimizer state exists before the block
    before = hook_registry(model, [opt], [x, target])
    during = []
    with contextlib.suppress(KeyError):
        with memprof.profile(model, opt, mode=mode):
            for _ in range(30):
                F.mse_loss(model(x), target).backward()
                opt.step()
                opt.zero_grad()
                during.append(len(model.query.weight._backward_hooks))
            if raises:
                raise KeyError("body failed")
    assert hook_registry(model, [opt], [x, target]) == before
    # One memprof hook on the parameter for the whole block, not one per forward.
    assert max(during) <= 2 and during[0] == during[-1]
    user_hook.remove()


# ------------------------------------------------------------------ 4. a forward memprof did not see


def test_gradients_from_an_unseen_forward_leave_activations_not_measured():
    model, x = _mlp(), torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).sum()  # the forward ran before the profile
    with memprof.profile(model, opt) as prof:
        loss.backward()
        opt.step()
        opt.zero_grad()
    rep = prof.report()
    assert rep.num_steps == 1 and rep.peak[C.ACTIVATIONS] is None
    assert rep.end[C.WEIGHTS] == weight_bytes(model)
    assert any("forward memprof's module hooks did not see" in n for n in rep.trace.notes)


# ------------------------------------------------------------------ 5. a set-up that fails


def test_a_failing_setup_raises_the_users_error_and_leaves_nothing():
    class OddParameter(nn.Parameter):
        def register_post_accumulate_grad_hook(self, hook):
            raise ValueError("the user's own bug")

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].bias = OddParameter(torch.zeros(2))
    before = hook_registry(nn.Sequential())
    prof = memprof.profile(model)
    with pytest.raises(ValueError, match="the user's own bug"):
        with prof:
            pass
    assert hook_registry(nn.Sequential()) == before
    with pytest.raises(ProfilerStateError, match="never started.*the user's own bug"):
        prof.report()
    with memprof.profile(_mlp()):  # nothing stays active
        pass


# ------------------------------------------------------------------ the whole class: bit-identical training


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1)) for _ in range(2))
        self.out = nn.Linear(32, 4)

    def forward(self, x, checkpointed=None):
        h = self.inp(x)
        for block in self.blocks:
            if checkpointed is None:
                h = h + block(h)
            else:
                h = h + torch.utils.checkpoint.checkpoint(block, h, use_reentrant=checkpointed)
        return self.out(h)


SETUPS = {
    "plain": {},
    "autocast": {"autocast": True},
    "checkpoint": {"checkpointed": False},
    "reentrant checkpoint": {"checkpointed": True},
    "user hooks": {"hooks": True},
    "everything": {"autocast": True, "checkpointed": False, "hooks": True},
}


def _run(setup, profiled, mode, compiled=False):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step_model = torch.compile(model, backend="eager") if compiled else model
    x, y = torch.randn(8, 16, requires_grad=True), torch.randn(8, 4)
    comp = Compress()
    hooks = comp.hooks if setup.get("hooks") else contextlib.nullcontext
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if setup.get("autocast") else contextlib.nullcontext
    kwargs = {"checkpointed": setup["checkpointed"]} if "checkpointed" in setup else {}
    with hooks():
        with memprof.profile(step_model, opt, mode=mode) if profiled else contextlib.nullcontext():
            torch.manual_seed(1)  # the same dropout masks with and without memprof
            for _ in range(3):
                with autocast():
                    loss = F.mse_loss(step_model(x, **kwargs).float(), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()] + [x.grad.clone()], comp.packed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(SETUPS))
def test_training_is_bit_identical_with_and_without_memprof(name, mode):
    (plain, packed_plain), (profiled, packed_profiled) = (_run(SETUPS[name], p, mode) for p in (False, True))
    assert packed_profiled == packed_plain
    assert all(torch.equal(a, b) for a, b in zip(plain, profiled))


@pytest.mark.parametrize("mode", MODES)
def test_compiled_training_is_bit_identical_with_and_without_memprof(mode):
    plain, _ = _run(SETUPS["plain"], False, mode, compiled=True)
    profiled, _ = _run(SETUPS["plain"], True, mode, compiled=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, profiled))


# ------------------------------------------------------------------ saved-tensor hooks outside the model's calls


def _profile(model, opt=None, mode=None):
    return memprof.profile(model, opt, mode=mode) if mode else contextlib.nullcontext()


@pytest.mark.parametrize("mode", MODES)
def test_disabling_saved_tensor_hooks_after_a_forward_works(mode):
    model = nn.Linear(4, 4)
    with memprof.profile(model, mode=mode):
        out = torch.tanh(model(torch.randn(2, 4)))
        with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
            extra = torch.tanh(torch.randn(3, requires_grad=True)).sum()
        extra.backward()
        out.sum().backward()
    assert model.weight.grad is not None


def _detached_saved_output(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with _profile(model, mode=mode):
        h = torch.tanh(model[0](torch.randn(2, 4)))  # TanhBackward saves its output h
        out = model[1](h)
        h.detach_()
        out.sum().backward()


@pytest.mark.parametrize("mode", MODES)
def test_a_saved_output_detached_in_place_fails_as_without_memprof(mode):
    with pytest.raises(RuntimeError) as plain:
        _detached_saved_output(None)
    with pytest.raises(RuntimeError) as profiled:
        _detached_saved_output(mode)
    assert str(profiled.value) == str(plain.value)


def _second_order(mode):
    # A gradient penalty: the second backward differentiates through tensors the first one saved, a leaf
    # input (x, saved by mul) and an op's input with a grad_fn (w * x, saved by pow). A saved tensor handed
    # back without its place in the graph would give a different (or no) gradient.
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with _profile(model, mode=mode):
        y = (model.weight.sum(0) * x).pow(2).sum() + model(x).tanh().sum()
        gw, gx = torch.autograd.grad(y, (model.weight, x), create_graph=True)
        (gw.pow(2).sum() + gx.pow(2).sum()).backward()
    return model.weight.grad, model.bias.grad, x.grad


@pytest.mark.parametrize("mode", MODES)
def test_a_second_order_gradient_is_the_same_to_the_bit(mode):
    plain = _second_order(None)
    profiled = _second_order(mode)
    assert all(a is not None and torch.equal(a, b) for a, b in zip(plain, profiled))


# ------------------------------------------------------------------ the user's dispatch modes


def test_a_users_dispatch_mode_entered_inside_the_block_survives_it():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    model, counter = nn.Linear(4, 4), Count()
    with memprof.profile(model, mode="exact") as prof:
        model(torch.randn(2, 4)).sum().backward()
        counter.__enter__()  # left open past the block, as a run-long tracing mode would be
    try:
        before = counter.ops
        torch.randn(3) + 1  # randn and add: two ops
        assert counter.ops - before == 2
    finally:
        counter.__exit__(None, None, None)
    assert prof.report().peak.total > 0
    # The next profile in this thread starts from an empty dispatch stack.
    with memprof.profile(model, mode="exact"):
        assert torch._C._len_torch_dispatch_stack() == 1
    assert torch._C._len_torch_dispatch_stack() == 0


# ------------------------------------------------------------------ what the loss saves under the user's hooks


def _loss_saved(hooks):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 10))
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    with memprof.profile(model, mode="exact") as prof:
        out = model(x)
        with hooks():
            # Outside the model: log_softmax and nll_loss both save the 8 x 10 fp32 log-softmax output
            # (one 320-byte storage); nll_loss also saves the targets (inputs: made before the profile).
            loss = F.cross_entropy(out, y)
        loss.backward()
    return prof.report().breakdown(0, "backward", "start")


def test_what_the_loss_saves_under_the_users_hooks_is_an_activation():
    plain = _loss_saved(contextlib.nullcontext)
    identity = _loss_saved(lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    assert identity == plain
    # A pack that clones: each node holds its own copy of the log-softmax output (2 x 320 bytes) and the
    # shared original is freed (+320), and the graph holds a clone of the targets (8 int64 = 64 bytes)
    # while the targets themselves stay inputs.
    cloned = _loss_saved(lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t))
    assert cloned[C.ACTIVATIONS] == plain[C.ACTIVATIONS] + 320 + 64
    assert cloned[C.INPUTS] == plain[C.INPUTS]


# ------------------------------------------------------------------ dropout


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.drop = nn.Dropout(0.3)
        self.norm = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(self.norm(self.drop(F.gelu(self.fc1(x)))))


def _train_dropnet(mode):
    torch.manual_seed(123)  # the model init and dropout both draw from the default generator
    model = DropNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    losses = []
    ctx = memprof.profile(model, opt, mode=mode) if mode else torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t)
    with ctx:
        # Not tests/training.py's loop: each step's loss is kept (held alive) to compare the runs' losses.
        for _ in range(4):
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], torch.rand(3)


@pytest.mark.parametrize("mode", ["exact", "light"])
def test_bit_identical_results_with_dropout(mode):
    l0, p0, r0 = _train_dropnet(None)
    l1, p1, r1 = _train_dropnet(mode)
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert torch.equal(r0, r1)  # memprof consumed no random numbers
