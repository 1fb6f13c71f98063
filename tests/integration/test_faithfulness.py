"""Profiling never changes training, and never stays silent about what it missed.

Each test runs the user's code with and without memprof and requires the same
behaviour (bit-identical parameters, the same hooks run, the same errors), or
an exact figure against an independent count, or a report that says "not
measured" with a note where memprof cannot see.
"""

from __future__ import annotations

import contextlib
import re
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C
from memprof.errors import InvalidArgumentError, ProfilerStateError

from helpers import hook_registry, optimizer_state_bytes, unique_bytes, weight_bytes
from models import MLP

MODES = ("exact", "light")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _train(model, opt, x, steps=3, ctx=contextlib.nullcontext):
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


# ------------------------------------------------------------------ 4. torch.compile


def _counting_backend():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    calls = {"forward": 0, "backward": 0}

    def compiler(kind):
        def compile_graph(gm, _inputs):
            def run(*args):
                calls[kind] += 1
                return gm(*args)
            return make_boxed_func(run)
        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward")), calls


@pytest.fixture(scope="module")
def compiled_runs():
    """The same two training steps eager, compiled (whole model) and with a compiled block; the compiled
    graphs count their own runs. Compiling costs a few seconds, so the runs are shared."""
    backend, calls = _counting_backend()
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))

    def run(profiled, called):
        opt = torch.optim.SGD(profiled.parameters(), lr=0.1)
        with memprof.profile(profiled, opt) as prof:
            for _ in range(2):
                F.cross_entropy(called(x), y).backward()
                opt.step()
                opt.zero_grad()
        return prof.report()

    torch.manual_seed(0)
    plain = MLP()
    eager = run(plain, plain)
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend=backend)
    F.cross_entropy(compiled(x), y).backward()  # compiled before the profile
    model.zero_grad(set_to_none=True)
    before = dict(calls)
    whole = run(compiled, compiled)
    inside = {k: calls[k] - before[k] for k in calls}
    before = dict(calls)
    F.cross_entropy(compiled(x), y).backward()
    after = {k: calls[k] - before[k] for k in calls}
    model.zero_grad(set_to_none=True)
    wrapped_inner = run(model, compiled)  # profiled: the inner model; called: its compiled wrapper
    torch.manual_seed(0)
    part = MLP()
    part.fc2 = torch.compile(part.fc2, backend=backend)  # a compiled block inside an eager model
    before = dict(calls)
    block = run(part, part)
    block_calls = {k: calls[k] - before[k] for k in calls}
    return {"eager": eager, "whole": whole, "inside": inside, "after": after, "block": block,
            "block_calls": block_calls, "model": model, "inner": wrapped_inner}


def test_a_compiled_model_stays_compiled_inside_and_after_the_block(compiled_runs):
    assert compiled_runs["inside"] == {"forward": 2, "backward": 2}
    assert compiled_runs["after"] == {"forward": 1, "backward": 1}
    assert compiled_runs["block_calls"] == {"forward": 2, "backward": 2}


def test_a_compiled_model_is_measured_and_says_what_it_cannot_see(compiled_runs):
    eager, whole, block = compiled_runs["eager"], compiled_runs["whole"], compiled_runs["block"]
    model = compiled_runs["model"]
    for rep in (whole, block):
        assert rep.num_steps == 2
        assert rep.breakdown(1, "forward", "end")[C.WEIGHTS] == weight_bytes(model)
        assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == weight_bytes(model)
        assert any("torch.compile'd code" in n and "lower bounds" in n for n in rep.trace.notes)
    # This backend runs aten ops, so what autograd keeps equals eager's to the byte.
    assert whole.breakdown(1, "forward", "end") == eager.breakdown(1, "forward", "end")
    assert block.breakdown(1, "forward", "end") == eager.breakdown(1, "forward", "end")
    # Modules inside compiled code have no per-module figures: not measured, not 0.
    inner = whole.modules().loc["_orig_mod.fc1"]
    assert inner["calls"] == 0 and inner["activations"] is pd_na()


def pd_na():
    import pandas as pd

    return pd.NA


def test_profiling_the_model_inside_a_compiled_wrapper_says_what_it_missed(compiled_runs):
    # The wrapper's compiled code skips the hooks memprof put on the model it wraps (they were added after
    # compilation): the forward is unseen, so what it saved is not measured (not 0), and the note names the
    # fix. Steps still end at optimizer steps, and model states are exact.
    rep = compiled_runs["inner"]
    assert rep.num_steps == 2
    assert rep.peak[C.ACTIVATIONS] is None
    assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == weight_bytes(compiled_runs["model"])
    assert any("did not see" in n and "memprof.profile(compiled_model, optimizer)" in n for n in rep.trace.notes)


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


def test_a_model_compiled_in_place_is_refused_with_the_fix():
    model = MLP()
    model.compile(backend="eager")
    with pytest.raises(InvalidArgumentError, match=r"torch.compile\(model\)"):
        memprof.profile(model)


# ------------------------------------------------------------------ 5. and 6. optimizers


class Wrapped:
    """What accelerate (``.optimizer``) and Lightning (``._optimizer``) hand a training loop."""

    def __init__(self, opt, attr):
        setattr(self, attr, opt)
        self._attr = attr

    def step(self):
        getattr(self, self._attr).step()

    def zero_grad(self):
        getattr(self, self._attr).zero_grad()

    @property
    def param_groups(self):
        return getattr(self, self._attr).param_groups


@pytest.mark.parametrize("attr", ["optimizer", "_optimizer"])
def test_optimizer_wrappers_are_followed_to_the_torch_optimizer(attr):
    model, x = _mlp(), torch.randn(8, 16)
    inner = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, Wrapped(Wrapped(inner, attr), attr)) as prof:
        _train(model, Wrapped(inner, attr), x)
    rep = prof.report()
    assert rep.num_steps == 3
    # exp_avg + exp_avg_sq (fp32, as the 676 weights) + a 4-byte step per tensor: 2 * 2,704 + 4 * 4 = 5,424 B.
    assert rep.end[C.OPTIMIZER_STATES] == optimizer_state_bytes(inner) == 2 * weight_bytes(model) + 16 == 5424


def test_accelerates_optimizer_is_followed():
    accelerate = pytest.importorskip("accelerate")
    model, x = _mlp(), torch.randn(8, 16)
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    with memprof.profile(model, opt) as prof:
        for _ in range(3):
            accelerator.backward(model(x).pow(2).sum())
            opt.step()
            opt.zero_grad()
    rep = prof.report()
    assert rep.num_steps == 3
    assert rep.end[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt.optimizer) == 5424


def test_something_else_as_optimizer_is_refused_with_the_fix():
    with pytest.raises(InvalidArgumentError, match="AcceleratedOptimizer"):
        memprof.profile(_mlp(), object())


def test_an_optimizer_recreated_inside_the_block_is_measured_and_named():
    model, x = _mlp(), torch.randn(8, 16)
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.profile(model, first) as prof:
        _train(model, first, x, steps=1)
        second = torch.optim.Adam(model.parameters())
        _train(model, second, x, steps=2)
    rep = prof.report()
    assert rep.num_steps == 3
    assert rep.end[C.OPTIMIZER_STATES] == optimizer_state_bytes(second) == 5424
    assert any("Adam not passed to profile()" in n and "step 1" in n for n in rep.trace.notes)


def test_parameters_added_inside_the_block_become_weights():
    model, x = _mlp(), torch.randn(8, 16)
    with memprof.profile(model) as prof:
        model(x).sum().backward()
        model.add_module("extra", nn.Linear(4, 4))  # a new head, not yet used
        model.extra2 = nn.Parameter(torch.zeros(1000))
        model(x).sum().backward()
    rep = prof.report()
    # 676 + 20 + 1,000 fp32 parameters = 6,784 B; none of them counted as temporaries.
    assert rep.end[C.WEIGHTS] == weight_bytes(model) == (676 + 20 + 1000) * 4
    assert any("changed during profiling (step 1: 3 parameter(s) (4.0 KiB) and 1 module(s))" in n
               for n in rep.trace.notes)
    assert rep.breakdown(1, "forward", "start")[C.WEIGHTS] == rep.end[C.WEIGHTS]


def test_lazy_modules_are_measured():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    rep = prof.report()
    # (3*8 + 8) + (8*2 + 2) = 50 fp32 parameters, and as many gradient elements.
    assert rep.end[C.WEIGHTS] == weight_bytes(model) == 200
    assert rep.end[C.GRADIENTS] == 200
    assert rep.breakdown(1, "forward", "start")[C.TEMPORARIES] == 0


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


# ------------------------------------------------------------------ 7. storages made outside dispatch


def test_tensors_made_with_torch_tensor_are_counted():
    model = _mlp()
    with memprof.profile(model) as prof:
        keep = torch.tensor([1.0] * 262144)  # built in C++, seen by dispatch only as lift_fresh
        model(torch.randn(2, 16)).sum().backward()
    rep = prof.report()
    assert rep.end[C.TEMPORARIES] == keep.untyped_storage().nbytes() == 1048576
    assert rep.end.total == sum(v for v in rep.end.counts if v is not None)


def test_adam_step_counters_are_in_the_peak():
    model, x = _mlp(), torch.randn(8, 16)
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt) as prof:
        _train(model, opt, x, steps=1)
    rep = prof.report()
    # The first step's peak is inside step(): exp_avg, exp_avg_sq and the four 4-byte counters are live.
    assert rep.breakdown(0, "optimizer", "peak")[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt) == 5424


# ------------------------------------------------------------------ 8. threads


def test_training_in_another_thread_is_reported_as_not_measured():
    model, x = _mlp(), torch.randn(8, 16)
    before = hook_registry(model, tensors=[x])
    with memprof.profile(model) as prof:
        worker = threading.Thread(target=lambda: model(x).sum().backward())
        worker.start()
        worker.join()
    model.zero_grad(set_to_none=True)
    rep = prof.report()
    for category in (C.ACTIVATIONS, C.INPUTS, C.TEMPORARIES):
        assert rep.peak[category] is None
    assert rep.peak.total is None and rep.peak[C.WEIGHTS] == weight_bytes(model)
    assert any("thread(s) other than the one that started" in n for n in rep.trace.notes)
    assert hook_registry(model, tensors=[x]) == before


def test_a_profile_ended_from_another_thread_cleans_up_and_says_so():
    model, x = _mlp(), torch.randn(8, 16)
    before = hook_registry(model)
    prof = memprof.profile(model)
    prof.__enter__()
    model(x).sum().backward()
    errors = []

    def end():
        try:
            prof.__exit__(None, None, None)
        except ProfilerStateError as exc:
            errors.append(str(exc))

    worker = threading.Thread(target=end)
    worker.start()
    worker.join()
    assert errors and "ended in another thread" in errors[0]
    assert prof.report().breakdown(0, "forward", "end")[C.WEIGHTS] == weight_bytes(model)
    model.zero_grad(set_to_none=True)
    # Global hooks are gone at once; this thread's inert dispatch mode goes with the next profile here.
    after = hook_registry(model)
    assert {k: v for k, v in after.items() if k[0] != "global"} == {
        k: v for k, v in before.items() if k[0] != "global"}
    with memprof.profile(model) as again:
        model(x).sum().backward()
    assert again.report().breakdown(0, "forward", "end")[C.ACTIVATIONS] > 0
    model.zero_grad(set_to_none=True)
    assert hook_registry(model) == before


# ------------------------------------------------------------------ 9. torch.func


@pytest.mark.parametrize("mode", MODES)
def test_torch_func_runs_as_without_memprof(mode):
    from torch.func import functional_call, grad, vmap

    model, x = _mlp(), torch.randn(5, 16)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi):
        return functional_call(model, p, (xi.unsqueeze(0),)).pow(2).sum()

    plain = vmap(grad(loss), in_dims=(None, 0))(params, x)
    with memprof.profile(model, mode=mode) as prof:
        profiled = vmap(grad(loss), in_dims=(None, 0))(params, x)
    assert all(torch.equal(plain[k], profiled[k]) for k in plain)
    rep = prof.report()
    assert rep.peak[C.ACTIVATIONS] is None and rep.peak[C.TEMPORARIES] is None
    assert any("torch.func transforms" in n for n in rep.trace.notes)


def test_torch_func_between_steps_of_ordinary_training():
    from torch.func import functional_call, grad

    model, x = _mlp(), torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.profile(model, opt) as prof:
        _train(model, opt, x, steps=1)
        params = {k: v.detach() for k, v in model.named_parameters()}
        grad(lambda p: functional_call(model, p, (x,)).sum())(params)
        _train(model, opt, x, steps=1)
    assert prof.report().num_steps >= 2


# ------------------------------------------------------------------ 10. one formula per moment


def test_an_estimate_and_reconcile_show_one_formula_for_one_moment():
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(2, 256)
    est = memprof.estimate(model, opt, inputs=x)
    rec = memprof.reconcile(est.trace)
    assert est.trace.peak_phase is memprof.Phase.OPTIMIZER  # small batch: the foreach step is the peak
    assert est.formula == memprof.Breakdown.from_mapping(
        {r.category: r.formula for r in rec.rows}, total=est.formula.total)
    assert est.formula[C.ACTIVATIONS] == 0


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
