"""Edges of "profiling never changes training": what a user does inside the block that torch allows
and memprof must neither break nor miscount.

Each case runs once without memprof and once with it: results must be bit-identical (or the same
error raised), and byte counts must equal the independent sums of tests/helpers.py.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C

from helpers import optimizer_state_bytes, unique_bytes, weight_bytes

MODES = ["exact", "light"]


def _profile(model, opt=None, mode=None):
    return memprof.profile(model, opt, mode=mode) if mode else contextlib.nullcontext()


# ------------------------------------------------------------- saved-tensor hooks outside model calls


@pytest.mark.parametrize("mode", MODES)
def test_torch_func_after_the_forward_inside_a_step(mode):
    # A torch.func transform between the model's forward and its backward: functorch refuses to run
    # under saved-tensor hooks, so memprof's hooks must only be pushed while a module runs.
    from torch.func import jacrev

    def train(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(6, 8)
        with _profile(model, opt, mode):
            for _ in range(2):
                loss = model(x).pow(2).mean()
                jac = jacrev(lambda z: torch.tanh(z).sum(-1))(x)
                (loss + 1e-3 * jac.pow(2).sum()).backward()
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    plain = train(None)
    assert all(torch.equal(a, b) for a, b in zip(plain, train(mode)))


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


# ------------------------------------------------------------------ compiled code first run inside


def _counting_backend():
    graphs: list[int] = []

    def backend(gm, example_inputs):
        graphs.append(0)
        index = len(graphs) - 1

        def run(*args):
            graphs[index] += 1
            return gm(*args)
        return run

    return backend, graphs


def _compiled_step_run(mode):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    backend, graphs = _counting_backend()
    step = torch.compile(opt.step, backend=backend)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with _profile(model, opt, mode):
        for _ in range(2):
            F.mse_loss(model(x), y).backward()
            step()
            opt.zero_grad()
    inside = (len(graphs), sum(graphs))
    for _ in range(2):
        F.mse_loss(model(x), y).backward()
        step()
        opt.zero_grad()
    after = (len(graphs), sum(graphs), sum(counters["recompiles"].values()))
    return inside, after, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", MODES)
def test_an_optimizer_step_compiled_inside_the_block_compiles_as_without_memprof(mode):
    # A step first compiled inside the block compiles to the same graphs, run as often, and nothing
    # memprof installs makes it recompile or run eagerly after the block. (Dynamo's graph-break counter
    # may differ: torch.optim asks for a break that memprof's compiler-disabled step hooks already cause.)
    plain = _compiled_step_run(None)
    profiled = _compiled_step_run(mode)
    assert profiled[:2] == plain[:2]
    assert all(torch.equal(a, b) for a, b in zip(plain[2], profiled[2]))


def _compiled_first_inside(mode, target):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backend, graphs = _counting_backend()
    compiled = torch.compile(model, backend=backend)
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    def step():
        F.mse_loss(compiled(x), y).backward()
        opt.step()
        opt.zero_grad()

    with _profile(compiled if target == "wrapper" else model, opt, mode):
        for _ in range(2):
            step()
    inside = sum(graphs)
    for _ in range(2):
        step()
    breaks = sum(counters["graph_break"].values())
    return inside, sum(graphs) - inside, breaks, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", ["wrapper", "inner"])
def test_a_model_compiled_first_inside_the_block_stays_compiled_after_it(mode, target):
    # Profiling the compiled wrapper, or the model inside it (its hooks are then traced into the graph as
    # no-ops, and dynamo recompiles once when they are gone): the whole forward runs as one compiled
    # graph inside the block and after it, with no graph break, as without memprof.
    plain = _compiled_first_inside(None, target)
    profiled = _compiled_first_inside(mode, target)
    assert profiled[:3] == plain[:3] == (2, 2, 0)  # graph runs inside, graph runs after, graph breaks
    assert all(torch.equal(a, b) for a, b in zip(plain[3], profiled[3]))


# ------------------------------------------------------------------ parameters changed inside


@pytest.mark.parametrize("how", ["cast", "data"])
def test_parameters_cast_or_given_new_data_inside_the_block_are_weights(how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    with memprof.profile(model, mode="exact") as prof:
        if how == "cast":
            model.to(torch.bfloat16)  # Module._apply assigns param.data
        else:
            for p in model.parameters():
                p.data = p.data.clone()
        dtype = next(model.parameters()).dtype
        model(torch.randn(4, 64, dtype=dtype)).float().sum().backward()
    end = prof.report().end
    # (64*64 + 64 + 64*8 + 8) elements x 2 bytes (bf16) or x 4 (fp32), each storage once.
    assert end[C.WEIGHTS] == weight_bytes(model) == 4680 * (2 if how == "cast" else 4)
    assert end[C.GRADIENTS] == unique_bytes(p.grad for p in model.parameters())


def test_parameters_replaced_by_load_state_dict_assign_are_weights():
    # A new Parameter can take the id() of a freed one; memprof must not mistake it for the old one.
    for _ in range(5):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with memprof.profile(model, mode="exact") as prof:
            model.load_state_dict(state, assign=True)
            model(torch.randn(4, 64)).sum().backward()
        end = prof.report().end
        assert end[C.WEIGHTS] == weight_bytes(model)  # 4680 fp32 elements = 18,720 bytes
        assert end[C.GRADIENTS] == unique_bytes(p.grad for p in model.parameters())
        del model, state, prof
        gc.collect()


def test_optimizer_state_loaded_inside_the_block_is_optimizer_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    saved = {"state": {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()},
             "param_groups": opt.state_dict()["param_groups"]}
    opt.zero_grad()
    with memprof.profile(model, opt, mode="exact") as prof:
        opt.load_state_dict(saved)  # casts and copies the loaded tensors: new storages
        model(torch.randn(2, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    # exp_avg + exp_avg_sq per parameter (2 x 1,188 fp32 elements) + one step counter per parameter.
    assert prof.report().end[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt)


# ------------------------------------------------------------------ storages that change size


def _temporaries_holding(make):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with memprof.profile(model, mode="exact") as prof:
        loss = model(torch.randn(2, 4)).sum()
        held = make()  # alive across the backward
        loss.backward()
    assert held.untyped_storage().nbytes() == 4000
    return prof.report().breakdown(0, "backward", "end")


@pytest.mark.parametrize("grow", ["resize_", "out="])
def test_storages_grown_in_place_count_as_a_fresh_allocation_of_their_size(grow):
    fresh = _temporaries_holding(lambda: torch.empty(1000))  # 1000 fp32 = 4,000 bytes
    if grow == "resize_":
        grown = _temporaries_holding(lambda: torch.empty(0).resize_(1000))
    else:  # an out= argument that torch resizes to 20 x 50 fp32 = 4,000 bytes
        grown = _temporaries_holding(lambda: torch.mm(torch.randn(20, 50), torch.randn(50, 50),
                                                      out=torch.empty(0)))
    assert grown[C.TEMPORARIES] == fresh[C.TEMPORARIES]
    assert grown.total == fresh.total


class _PlainAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.table = torch.randn(512, 256)  # a plain tensor attribute, not a registered buffer

    def forward(self, x):
        return self.lin(x + self.table[: x.shape[1]])


def test_a_plain_tensor_attribute_of_a_module_is_counted_as_a_buffer():
    model = _PlainAttribute()
    with memprof.profile(model, mode="exact") as prof:
        model(torch.randn(2, 128, 256)).sum().backward()
    rep = prof.report()
    assert rep.peak[C.BUFFERS] == model.table.untyped_storage().nbytes() == 512 * 256 * 4


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


def _closure_steps(mode, optimizer_cls):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = optimizer_cls(model.parameters())
    x = torch.randn(4, 8)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    with _profile(model, opt, mode) as prof:
        losses = [opt.step(closure).item() for _ in range(3)]
    return losses, [p.detach().clone() for p in model.parameters()], prof


@pytest.mark.parametrize("optimizer_cls", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                           lambda ps: torch.optim.LBFGS(ps, max_iter=3)])
def test_a_step_with_a_closure_trains_identically_and_its_phases_are_in_order(optimizer_cls):
    plain = _closure_steps(None, optimizer_cls)
    losses, params, prof = _closure_steps("exact", optimizer_cls)
    assert losses == plain[0] and all(torch.equal(a, b) for a, b in zip(plain[1], params))
    for step in prof.trace.steps:
        kinds = [p.phase.value for p in step.phases if p.phase.value != "other"]
        # Forward and backward run inside step(closure) (LBFGS calls it several times); the optimizer's
        # own work comes after each closure, never before the first forward.
        assert kinds[:2] == ["forward", "backward"] and kinds[-1] == "optimizer"
