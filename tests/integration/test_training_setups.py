"""Training set-ups: steps, phases and categories stay exact."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import memprof
from memprof import Category as C, Phase
from memprof.anatomy import predict_activations

from helpers import grad_bytes, hooks_left, non_other, optimizer_state_bytes, saved_activation_bytes, weight_bytes
from models import MLP
from training import profile_training


def phase_names(step):
    return [(p.phase.value, p.occurrence) for p in step.phases if p.phase is not Phase.OTHER]


def data(n=16):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_multi_step_records_each_step():
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    x, y = data()
    tr = profile_training(model, opt, (x, y), steps=3).trace
    assert [s.index for s in tr.steps] == [0, 1, 2]
    for s in tr.steps:
        assert phase_names(s) == [("forward", 0), ("backward", 0), ("optimizer", 0)]
    # The zero_grad after the last step frees the gradients: end has none, states remain.
    assert tr.end[C.GRADIENTS] == 0
    assert tr.end[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt)


def test_gradient_accumulation_is_one_step_with_several_passes():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            for micro in range(3):
                F.cross_entropy(model(x[micro::3]), y[micro::3]).backward()
            opt.step()
            opt.zero_grad()
    rep = prof.report()
    assert rep.num_steps == 2
    for s in prof.trace.steps:
        assert phase_names(s) == [
            ("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1),
            ("forward", 2), ("backward", 2), ("optimizer", 0),
        ]
    w = weight_bytes(model)
    # Gradients accumulate in place: one fp32 grad per parameter, after every micro-batch.
    assert rep.breakdown(0, "backward", "end", occurrence=0)[C.GRADIENTS] == w
    assert rep.breakdown(0, "backward", "end", occurrence=2)[C.GRADIENTS] == w
    assert rep.breakdown(0, "forward", "start", occurrence=1)[C.GRADIENTS] == w


def test_zero_grad_set_to_none_false_keeps_gradients():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    rep = profile_training(model, opt, (x, y), set_to_none=False)
    w = weight_bytes(model)
    assert rep.end[C.GRADIENTS] == w  # zeroed, not freed
    assert rep.breakdown(1, "forward", "peak")[C.GRADIENTS] == w


def test_frozen_layers_have_no_gradients_or_state():
    model = MLP()
    for p in model.fc1.parameters():
        p.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable)
    x, y = data()
    with memprof.profile(model, opt) as prof:
        F.cross_entropy(model(x), y).backward()
        g = grad_bytes(model)
        opt.step()
    rep = prof.report()
    # fc2 + fc3 only: (64*64+64 + 64*10+10) * 4 B = (4160 + 650) * 4 = 19240
    assert g == 19240
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == 19240
    # AdamW: 2 * 19240 B of moments + 4 parameters * 4-byte step
    assert rep.breakdown(0, "optimizer", "end")[C.OPTIMIZER_STATES] == 2 * 19240 + 4 * 4
    assert rep.breakdown(0, "forward", "end")[C.WEIGHTS] == weight_bytes(model)


def test_no_grad_evaluation_saves_nothing():
    model = MLP()
    x, _ = data()
    with memprof.profile(model) as prof:
        with torch.no_grad():
            out = model(x)
    rep = prof.report()
    bd = rep.breakdown(0, "forward", "end")
    assert bd[C.ACTIVATIONS] == 0
    assert bd[C.GRADIENTS] == 0
    # The output 16 x 10 fp32 is alive at the end, as a temporary.
    assert bd[C.TEMPORARIES] >= 16 * 10 * 4
    del out


def test_optimizer_created_after_first_forward():
    model = MLP()
    x, y = data()
    with memprof.profile(model) as prof:  # no optimizer given: found through torch's global step hooks
        loss = F.cross_entropy(model(x), y)
        opt = torch.optim.AdamW(model.parameters())
        loss.backward()
        opt.step()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    tr = prof.trace
    assert len(tr.steps) == 2
    assert phase_names(tr.steps[0]) == [("forward", 0), ("backward", 0), ("optimizer", 0)]
    assert prof.report().breakdown(1, "optimizer", "end")[C.OPTIMIZER_STATES] == optimizer_state_bytes(opt)
    assert tr.optimizer == "torch.optim.adamw.AdamW"


def test_without_optimizer_each_backward_ends_a_step():
    model = MLP()
    x, y = data()
    assert len(profile_training(model, None, (x, y), steps=3).trace.steps) == 3


def test_explicit_steps():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            with prof.step():
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    model(x)  # evaluation in the same step
    tr = prof.trace
    assert len(tr.steps) == 2
    assert [p.phase.value for p in tr.steps[0].phases if p.phase is not Phase.OTHER] == [
        "forward", "backward", "optimizer", "forward"]


class Blocks(torch.nn.Module):
    def __init__(self, reentrant, width=64, hidden=1024):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width))
            for _ in range(3)
        )

    def forward(self, x, use_checkpoint=True):
        for b in self.blocks:
            if use_checkpoint:
                x = checkpoint(b, x, use_reentrant=self.reentrant)
            else:
                x = b(x)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    # Batch 512, width 64, hidden 1024: a block's activations (4 MiB) outweigh all gradients (1.5 MiB),
    # so backward's peak falls while a block is recomputed.
    model = Blocks(reentrant)
    x = torch.randn(512, 64, requires_grad=True)
    exclude = list(model.parameters()) + [x]
    # Independent count: what autograd holds at the end of forward under checkpointing.
    expected_ckpt = saved_activation_bytes(lambda: model(x).sum(), exclude)
    expected_full = saved_activation_bytes(lambda: model(x, use_checkpoint=False).sum(), exclude)
    block_input = 512 * 64 * 4  # 131072
    block_inner = 2 * 512 * 1024 * 4  # GELU input + GELU output (saved by Linear 2) = 4194304
    # Checkpointed: only block inputs stay saved; block 1's input is x (an input, excluded).
    assert expected_ckpt == 2 * block_input
    # Without checkpointing: Linear-1 inputs of blocks 2 and 3, and every block's inner tensors.
    assert expected_full == 2 * block_input + 3 * block_inner
    with memprof.profile(model) as prof:
        model(x).sum().backward()
    rep = prof.report()
    assert rep.breakdown(0, "forward", "end")[C.ACTIVATIONS] == expected_ckpt
    # In backward, recomputed tensors count as activations of that backward, one block at a time.
    # Backward's peak comes while the first block is recomputed (all other gradients exist by then
    # and every other block's tensors are freed): exactly that block's inner tensors.
    bw_peak = rep.breakdown(0, "backward", "peak")
    assert bw_peak[C.ACTIVATIONS] == block_inner
    assert rep.breakdown(0, "backward", "end")[C.ACTIVATIONS] == 0
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == weight_bytes(model)


def test_submodules_called_directly_make_a_forward():
    # A ModuleDict is never called itself: its members are. Each outermost call is the model's forward.
    torch.manual_seed(0)
    model = nn.ModuleDict({"enc": nn.Linear(16, 32), "dec": nn.Linear(32, 8)})
    x = torch.randn(4, 16)
    with memprof.profile(model) as prof:
        h = model["enc"](x)
        model["dec"](h).sum().backward()
    trace = prof.trace
    fwd = next(p for p in trace.phases if p.phase is Phase.FORWARD)
    # x, made before the profile, is the model's input: 4*16*4 = 256 B. h (4*32*4 = 512 B) is made by enc
    # and saved by dec: an activation, not an input, although it is handed to the outermost call of dec.
    assert fwd.end[C.INPUTS] == 4 * 16 * 4
    assert fwd.end[C.ACTIVATIONS] == 4 * 32 * 4
    mods = prof.report().modules()
    assert mods.loc["dec", "activations"] == 4 * 32 * 4
    assert mods.loc["enc", "activations"] == 0  # enc saved x, which is an input
    assert any(p.phase is Phase.BACKWARD for p in trace.phases)


def test_a_frozen_submodule_called_under_no_grad_first_is_not_the_forward():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.cond_encoder = nn.Linear(16, 64)  # frozen, called by the training loop under no_grad
            self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

        def forward(self, x, cond):
            return self.body(x + cond)

    torch.manual_seed(0)
    model = Net()
    model.cond_encoder.requires_grad_(False)
    opt = torch.optim.SGD(model.body.parameters(), lr=0.1)
    x, c = torch.randn(128, 64), torch.randn(128, 16)
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            with torch.no_grad():
                cond = model.cond_encoder(c)
            model(x, cond).square().mean().backward()
            opt.step()
            opt.zero_grad()
    facts = prof.trace.facts
    # The formula comes from the model's own (grad-enabled) forward: the body's Linear inputs
    # (128*64*4 + 128*256*4) and ReLU's output (128*256*4).
    assert facts.batch_size == 128
    assert predict_activations(prof.trace).saved_bytes == 128 * 64 * 4 + 2 * 128 * 256 * 4
    first = [p.phase for p in prof.trace.phases if p.step == 0][:2]
    assert first == [Phase.OTHER, Phase.FORWARD]  # the encoder ran in "other", then the forward


def test_a_tensor_the_loop_makes_between_submodule_calls_is_not_an_input():
    torch.manual_seed(0)
    model = nn.ModuleDict({"enc": nn.Linear(16, 32), "head": nn.Linear(32, 4)})
    x = torch.randn(4, 16)
    with memprof.profile(model) as prof:
        h = model["enc"](x)
        model["head"](F.gelu(h)).sum().backward()  # F.gelu runs in the loop, outside every module
    fwd = next(p for p in prof.trace.phases if p.phase is Phase.FORWARD)
    # Inputs: x only (4*16*4 = 256 B). Activations: h, saved by gelu (4*32*4 = 512 B), and gelu's output,
    # saved by head (512 B).
    assert fwd.end[C.INPUTS] == 4 * 16 * 4
    assert fwd.end[C.ACTIVATIONS] == 2 * 4 * 32 * 4
    assert prof.trace.facts.activation_inputs_saved == 4 * 16 * 4


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
