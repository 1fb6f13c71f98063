"""Harder training set-ups: tied weights, shared modules, in-place ops and views, sparse gradients,
complex and integer tensors, several optimizers, GradScaler, autocast, evaluation, odd inputs and
outputs, threads, light mode, torch.compile. Each figure is compared with an independent sum
(tests/helpers.py) with the arithmetic in a comment.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C

from helpers import (
    assert_sums,
    non_other,
    LiveBytes,
    grad_bytes,
    hooks_left,
    optimizer_state_bytes,
    saved_activation_bytes,
    unique_bytes,
    weight_bytes,
)
from models import MLP


# ---------------------------------------------------------------- training set-ups


def test_gradient_accumulation_no_sync_pattern():
    # DDP-style accumulation: the loss is scaled by 1/k and the optimizer steps every k micro-batches;
    # a no_sync()-like context (here a no-op context) wraps all but the last micro-batch.
    import contextlib

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(12, 32, generator=g), torch.randint(0, 10, (12,), generator=g)
    k = 3
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            for micro in range(k):
                ctx = contextlib.nullcontext()
                with ctx:
                    (F.cross_entropy(model(x[micro::k]), y[micro::k]) / k).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    rep = prof.report()
    w = weight_bytes(model)
    assert rep.num_steps == 2
    for s in prof.trace.steps:
        assert non_other(s) == [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1),
                                ("forward", 2), ("backward", 2), ("optimizer", 0)]
    assert rep.breakdown(0, "backward", "end", occurrence=2)[C.GRADIENTS] == w
    assert rep.breakdown(1, "forward", "start", occurrence=0)[C.GRADIENTS] == w  # zeroed, not freed
    assert rep.end[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt) == w  # momentum 4 B/param
    # Each micro-batch of 4 saves the same: 2 ReLU results 4*64*4, log-softmax 4*10*4, total_weight,
    # and the div's nothing; targets are views of y (an input).
    for occ in range(k):
        assert rep.breakdown(0, "forward", "end", occurrence=occ)[C.ACTIVATIONS] == 2 * 1024 + 160 + 4


def test_frozen_layers_and_lr_scheduler():
    model = MLP()
    model.fc2.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    with memprof.profile(model, opt) as prof:
        for _ in range(3):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    rep = prof.report()
    assert rep.num_steps == 3
    # fc1 + fc3: (32*64+64 + 64*10+10) * 4 = (2112 + 650) * 4 = 11048 B of gradients
    assert rep.breakdown(2, "backward", "end")[C.GRADIENTS] == 11048
    assert rep.breakdown(2, "optimizer", "end")[C.OPTIMIZER_STATES] == 2 * 11048 + 4 * 4
    assert rep.breakdown(2, "forward", "end")[C.WEIGHTS] == weight_bytes(model)


def test_tied_weights_with_optimizer_state_once():
    emb = nn.Embedding(20, 8)
    head = nn.Linear(8, 20, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    opt = torch.optim.Adam(model.parameters())
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            F.cross_entropy(model(torch.tensor([[1, 2, 3]])).flatten(0, 1), torch.tensor([4, 5, 6])).backward()
            opt.step()
            opt.zero_grad()
    rep = prof.report()
    # One 20x8 fp32 storage: 640 B of weights; Adam: 2 * 640 + one 4-byte step.
    assert rep.end[C.WEIGHTS] == 640
    assert rep.end[C.OPTIMIZER_STATES] == 2 * 640 + 4 == optimizer_state_bytes(opt)
    assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == 640


def test_shared_module_called_twice():
    lin = nn.Linear(16, 16)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(torch.relu(self.lin(x)))

    model = Twice()
    x = torch.randn(8, 16)
    expected = saved_activation_bytes(lambda: model(x).sum(), list(model.parameters()) + [x])
    assert expected == 8 * 16 * 4  # the ReLU result, saved by relu and by lin's second call
    with memprof.profile(model) as prof:
        model(x).sum().backward()
    rep = prof.report()
    assert rep.breakdown(0, "forward", "end")[C.ACTIVATIONS] == expected
    mods = rep.modules()
    assert mods.loc["lin", "calls"] == 2
    # Gradients of both calls accumulate into one (16*16+16)*4 = 1088 B.
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == mods.loc["lin", "gradients"] == 1088


def test_module_used_outside_the_model():
    model = nn.Linear(16, 16)
    ext = nn.Linear(16, 16)  # not part of the profiled model
    x = torch.randn(8, 16)

    def step():
        return ext(torch.relu(model(x))).sum()

    expected = saved_activation_bytes(step, list(model.parameters()) + list(ext.parameters()) + [x])
    assert expected == 8 * 16 * 4  # the ReLU result (relu and ext both save it)
    with memprof.profile(model) as prof:
        step().backward()
    rep = prof.report()
    fwd = rep.breakdown(0, "forward", "end")
    assert fwd[C.ACTIVATIONS] == expected  # counted in the totals...
    assert rep.modules().loc["<model>", "activations"] == 0  # ...but attributed to no module of the model
    assert fwd[C.WEIGHTS] == weight_bytes(model) == 1088  # ext's parameters are not the model's weights
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == 1088
    assert_sums(fwd)


def test_inplace_ops_and_views():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 32)
            self.b = nn.Linear(16, 4)

        def forward(self, x):
            h = self.a(x)
            h.relu_()
            v = h.view(8, 2, 16)[:, 0]
            t = v.clone().t_()
            return self.b(t.t() * 2)

    model = M()
    x = torch.randn(8, 16)
    expected = saved_activation_bytes(lambda: model(x).sum(), list(model.parameters()) + [x])
    # relu_ saves the mutated 8x32 buffer (1024 B); the clone of the view is 8x16 (512 B), the
    # product (mat1 of b) another 512 B; mul by a scalar saves nothing.
    assert expected == 1024 + 512
    counter = LiveBytes(list(model.parameters()) + [x])
    with counter:
        with memprof.profile(model) as prof:
            model(x).sum().backward()
    counter.close()
    rep = prof.report()
    assert rep.breakdown(0, "forward", "end")[C.ACTIVATIONS] == expected
    assert rep.peak.total == counter.peak


@pytest.mark.parametrize("opt_name", ["SparseAdam", "SGD"])
def test_sparse_embedding_gradients(opt_name):
    emb = nn.Embedding(100, 16, sparse=True)
    model = nn.Sequential(emb)
    opt = torch.optim.SparseAdam(list(model.parameters())) if opt_name == "SparseAdam" else \
        torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.tensor([[1, 2, 3, 2]])
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            model(idx).sum().backward()
            g = emb.weight.grad
            # A sparse COO gradient: int64 indices 1x4 (32 B) + values 4x16 fp32 (256 B).
            sparse_bytes = g._indices().untyped_storage().nbytes() + g._values().untyped_storage().nbytes()
            del g  # a gradient the user still holds after zero_grad is another matter (see below)
            opt.step()
            opt.zero_grad()
    assert sparse_bytes == 32 + 256
    rep = prof.report()
    assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == sparse_bytes
    # SparseAdam: dense exp_avg + exp_avg_sq (2 * 100*16*4 = 12800) + a step; SGD: nothing.
    assert rep.end[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt)
    # (SparseAdam keeps its step count as a Python int: no tensor.)
    assert rep.end[C.OPTIMIZER_STATES] == (12800 if opt_name == "SparseAdam" else 0)
    assert rep.end[C.WEIGHTS] == 6400
    assert hooks_left(model) == []


def test_gradient_kept_by_user_after_zero_grad_is_not_a_gradient():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    with memprof.profile(model, opt) as prof:
        F.cross_entropy(model(x), y).backward()
        kept = [p.grad for p in model.parameters()]  # e.g. for logging a gradient norm later
        opt.step()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    rep = prof.report()
    w = weight_bytes(model)
    assert unique_bytes(kept) == w
    start = rep.breakdown(1, "forward", "start")
    assert grad_bytes(model) == w  # the second backward's gradients
    # Before the second backward no parameter has a .grad: the kept tensors are ordinary ones.
    assert start[C.GRADIENTS] == 0
    assert start[C.TEMPORARIES] == w
    assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == w
    del kept


def test_complex_and_integer_tensors():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            c = torch.complex(h, h * 2)
            c = c * c
            i = torch.arange(8) * 3  # int64, no grad
            return c.abs().sum() + i.sum()

    model = M()
    x = torch.randn(4, 8)
    expected = saved_activation_bytes(lambda: model(x), list(model.parameters()) + [x])
    # complex64 4x8: 256 B, saved by the mul (once) and by abs (the product, another 256);
    # h (4x8 fp32, 128) is saved by complex(); h*2 (128) too.
    assert expected == 768
    counter = LiveBytes(list(model.parameters()) + [x])
    with counter:
        with memprof.profile(model) as prof:
            model(x).backward()
    counter.close()
    rep = prof.report()
    assert rep.breakdown(0, "forward", "end")[C.ACTIVATIONS] == expected
    assert rep.peak.total == counter.peak
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == weight_bytes(model) == 288


def test_two_optimizers_one_iteration_is_one_step():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    o1 = torch.optim.Adam([{"params": [model[0].weight], "lr": 1e-3}, {"params": [model[0].bias], "lr": 1e-2}])
    o2 = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 8)
    with memprof.profile(model, [o1, o2]) as prof:
        for _ in range(2):
            model(x).sum().backward()
            o1.step()
            o2.step()
            o1.zero_grad()
            o2.zero_grad()
    rep = prof.report()
    assert rep.num_steps == 2
    for s in prof.trace.steps:
        assert non_other(s) == [("forward", 0), ("backward", 0), ("optimizer", 0), ("optimizer", 1)]


def test_two_optimizers_and_param_groups_states():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    o1 = torch.optim.Adam([{"params": [model[0].weight], "lr": 1e-3}, {"params": [model[0].bias], "lr": 1e-2}])
    o2 = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.ExponentialLR(o1, 0.9)
    x = torch.randn(4, 8)
    with memprof.profile(model, [o1, o2]) as prof:
        for _ in range(2):
            model(x).sum().backward()
            o1.step()
            o2.step()
            sched.step()
            o1.zero_grad()
            o2.zero_grad()
    rep = prof.report()
    # Adam on layer 0: 2 * (8*16 + 16) * 4 = 1152 + two 4-byte steps; SGD momentum on layer 2: (16*4+4)*4 = 272.
    assert rep.end[C.OPTIMIZER_STATES] == 1152 + 8 + 272
    assert rep.end[C.OPTIMIZER_STATES] == optimizer_state_bytes(o1) + optimizer_state_bytes(o2)
    assert rep.end[C.GRADIENTS] == 0
    assert hooks_left(model) == []


def test_gradscaler_on_cpu_with_autocast():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(16, 64)
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    rep = prof.report()
    assert rep.num_steps == 2
    for s in prof.trace.steps:
        assert non_other(s) == [("forward", 0), ("backward", 0), ("optimizer", 0)]
    # Gradients have the parameters' dtype (fp32), not the autocast dtype.
    assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == weight_bytes(model)
    assert rep.trace.autocast_dtype == "bfloat16"
    assert hooks_left(model) == []


def test_autocast_bf16_weight_copies_are_activations():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    x = torch.randn(16, 64, requires_grad=True)

    def fwd():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().sum()

    expected = saved_activation_bytes(fwd, list(model.parameters()) + [x])
    # bf16 copies saved by mm: x 16*64*2 = 2048, W1 64*128*2 = 16384 (2 B/param), the ReLU
    # result 16*128*2 = 4096 (also Linear 2's mat1), W2 128*32*2 = 8192. Biases are not saved.
    assert expected == 2048 + 16384 + 4096 + 8192
    with memprof.profile(model) as prof:
        loss = fwd()
        loss.backward()
    rep = prof.report()
    fwd_end = rep.breakdown(0, "forward", "end")
    assert fwd_end[C.ACTIVATIONS] == expected
    assert fwd_end[C.WEIGHTS] == weight_bytes(model)  # the fp32 masters only
    assert rep.breakdown(0, "backward", "end")[C.ACTIVATIONS] == 0


@pytest.mark.parametrize("ctx", ["no_grad", "inference_mode"])
def test_evaluation_without_grad(ctx):
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(4, 8)
    manager = torch.no_grad if ctx == "no_grad" else torch.inference_mode
    with memprof.profile(model) as prof:
        with manager():
            out = model(x)
    rep = prof.report()
    bd = rep.breakdown(0, "forward", "end")
    assert bd[C.ACTIVATIONS] == 0 and bd[C.GRADIENTS] == 0
    assert bd[C.WEIGHTS] == weight_bytes(model)
    # BatchNorm1d(16): running_mean + running_var (16 fp32 each) + num_batches_tracked (int64)
    assert bd[C.BUFFERS] == 16 * 4 * 2 + 8
    assert bd[C.INPUTS] == 4 * 8 * 4
    assert bd[C.TEMPORARIES] == 4 * 4 * 4  # only the output is still alive
    del out


def test_models_returning_tuples_and_dicts():
    class Multi(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return h.relu(), {"a": h.tanh(), "b": [h.sigmoid()]}

    model = Multi()
    x = torch.randn(4, 8)
    expected = saved_activation_bytes(lambda: model(x), list(model.parameters()) + [x])
    assert expected == 3 * 4 * 8 * 4  # relu, tanh and sigmoid each save their 4x8 result
    with memprof.profile(model) as prof:
        a, d = model(x)
        (a.sum() + d["a"].sum() + d["b"][0].sum()).backward()
    rep = prof.report()
    assert rep.breakdown(0, "forward", "end")[C.ACTIVATIONS] == expected
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == weight_bytes(model)
    assert rep.modules().loc["<model>", "activations"] == expected


def test_dict_input_and_kwargs_are_inputs():
    class KW(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, batch, *, scale):
            return self.lin(batch["x"]) * scale

    model = KW()
    batch = {"x": torch.randn(4, 8)}
    scale = torch.tensor(2.0)
    with memprof.profile(model) as prof:
        model(batch, scale=scale).sum().backward()
    # x 4*8*4 = 128 B and the 0-dim fp32 scale (4 B)
    assert prof.report().breakdown(0, "forward", "end")[C.INPUTS] == 128 + 4


def _thread_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def _profiled_loop(model, x):
    with memprof.profile(model) as prof:
        for _ in range(5):
            model(x).sum().backward()
            model.zero_grad()
    return prof.report()


def test_another_thread_is_not_attributed():
    x = torch.randn(32, 64)
    solo = _profiled_loop(_thread_model(), x)

    other = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    other_opt = torch.optim.Adam(other.parameters())
    stop, started = threading.Event(), threading.Event()
    errors = []

    def work():
        try:
            y = torch.randn(256, 64)
            while not stop.is_set():
                big = torch.empty(1000, 1000)  # noqa: F841  4 MB the profile must never see
                other(y).sum().backward()
                other_opt.step()
                other_opt.zero_grad()
                started.set()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            started.set()

    th = threading.Thread(target=work)
    th.start()
    started.wait(30)
    try:
        together = _profiled_loop(_thread_model(), x)
    finally:
        stop.set()
        th.join()
    assert errors == []
    assert together.trace.steps == solo.trace.steps  # every phase's start, peak and end, exactly
    assert together.peak == solo.peak
    assert together.trace.optimizer is None  # the other thread's Adam is not ours


def test_light_mode_sees_what_the_model_saves_exact_mode_also_the_loss():
    model = MLP()
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    # 2 ReLU results 16*64*4, log-softmax 16*10*4 = 640, total_weight 4
    expected = saved_activation_bytes(lambda: F.cross_entropy(model(x), y), list(model.parameters()) + [x, y])
    assert expected == 2 * 4096 + 640 + 4
    out = {}
    notes = {}
    for mode in ("exact", "light"):
        with memprof.profile(model, mode=mode) as prof:
            F.cross_entropy(model(x), y).backward()
        out[mode] = prof.report().breakdown(0, "forward", "end")
        notes[mode] = prof.trace.notes
    assert out["exact"][C.ACTIVATIONS] == expected
    assert out["exact"][C.INPUTS] == 16 * 32 * 4 + 16 * 8
    # memprof's saved-tensor pair is on the stack only inside the model's calls (so that torch.func
    # and the user's own pairs work outside them). Exact mode finds what the loss saved on the graph when
    # backward starts; light mode sees no op and no graph, so it counts what the model saved: the two
    # ReLU results. It says so in a note.
    assert out["light"][C.ACTIVATIONS] == 2 * 4096
    assert out["light"][C.INPUTS] == 16 * 32 * 4
    assert any("outside the model's modules" in n for n in notes["light"])


@pytest.mark.skipif(not os.environ.get("MEMPROF_SLOW"), reason="torch.compile takes ~25 s on this CPU; "
                                                                "set MEMPROF_SLOW=1 to run")
def test_torch_compile_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    F.cross_entropy(compiled(x), y).backward()  # compile outside the profile
    opt.zero_grad()
    eager = {}
    for name, m in (("eager", model), ("compiled", compiled)):
        with memprof.profile(m, opt) as prof:  # the module the loop calls: the compiled wrapper
            for _ in range(2):
                F.cross_entropy(m(x), y).backward()
                opt.step()
                opt.zero_grad()
        rep = prof.report()
        eager[name] = rep
        assert rep.num_steps == 2
        assert_sums(rep.peak)
        assert rep.breakdown(1, "forward", "end")[C.WEIGHTS] == weight_bytes(model)
        assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == weight_bytes(model)
        assert hooks_left(model) == []
    assert eager["compiled"].breakdown(1, "forward", "end")[C.ACTIVATIONS] == eager["eager"].breakdown(1, "forward", "end")[
        C.ACTIVATIONS]
