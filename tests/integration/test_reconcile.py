"""The reconciler, the simulation and the planner, against measurements on CPU."""

import os

import pytest
import torch
import torch.nn.functional as F

import memprof
from memprof.anatomy import predict_activations
from memprof import Category as C
from memprof.anatomy import LayerShape, transformer_layer_activations

from blocks import Block
from helpers import optimizer_state_bytes, weight_bytes
from models import MODEL_NAMES, MLP, make
from training import profile_training, train

MODEL_STATES = (C.WEIGHTS, C.GRADIENTS, C.OPTIMIZER_STATES)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps),
    "adam_l2": lambda ps: torch.optim.Adam(ps, weight_decay=0.1),
    "adamw_forloop": lambda ps: torch.optim.AdamW(ps, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, fused=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, amsgrad=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True),
    "adafactor": lambda ps: torch.optim.Adafactor(ps),
}


def _causes(rec, category=None):
    """Named causes of a reconciliation, by name: bytes (of one category, if given)."""
    return {c.name: c.bytes for c in rec.causes if category is None or c.category is category}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fp32_model_states_close_exactly(name):
    model, batch, loss_fn = make("mlp")
    opt = OPTIMIZERS[name](model.parameters())
    x, y = batch
    with memprof.profile(model, opt) as prof:
        # No zero_grad: the gradients stay for the reconciliation at the steady moment.
        train(model, opt, (x, y), loss=loss_fn, zero_grad=False)
        states = optimizer_state_bytes(opt)
    rec = prof.report().reconcile(at="steady")
    for cat in MODEL_STATES:
        row = rec.row(cat)
        assert row.gap == 0, (cat, row)
    # The formula is not the measurement copied: it is computed from parameter counts and the optimizer.
    assert rec.row(C.WEIGHTS).formula == 4 * sum(p.numel() for p in model.parameters())
    assert rec.row(C.OPTIMIZER_STATES).formula == states
    assert rec.unexplained(C.OPTIMIZER_STATES) == 0


def test_frame_and_text():
    model, batch, loss_fn = make("transformer")
    rep = profile_training(model, torch.optim.AdamW(model.parameters()), batch, loss=loss_fn)
    rec = rep.reconcile()
    frame = rec.to_frame()
    assert list(frame.columns) == ["formula", "estimate", "measured", "gap", "gap_pct"]
    assert list(frame.index) == [c.value for c in C] + ["total"]
    assert frame.loc["allocator_overhead"].isna().all()  # CPU: no device rows
    assert frame.loc["weights", "measured"] == weight_bytes(model)
    text = str(rec)
    assert "Why the measurement differs" in text or rec.explanations == []
    assert "formula" in text and "measured" in text
    # Every gap is fully split: causes + unexplained == gap, per category.
    for row in rec.rows:
        if row.gap is not None:
            assert sum(c.bytes for c in rec.explanations if c.category is row.category) == row.gap


def test_lazy_optimizer_state_is_named_when_the_peak_precedes_the_first_step():
    # Batch 4096 through 2048-wide layers: activations (2 x 4096 x 2048 x 4 B = 64 MiB) outweigh the
    # AdamW state (about 34 MiB), so the global peak falls in step 0's backward, before state exists.
    model = MLP(32, 2048, 10)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x, y = torch.randn(4096, 32), torch.randint(0, 10, (4096,))
    with memprof.profile(model, opt) as prof:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        states = optimizer_state_bytes(opt)
    rep = prof.report()
    assert rep.trace.peak_step == 0 and rep.trace.peak_phase.value in ("forward", "backward")
    rec = memprof.reconcile(rep.trace, at="peak")
    row = rec.row(C.OPTIMIZER_STATES)
    assert (row.formula, row.measured) == (states, 0)
    lazy = [c for c in rec.causes if c.name == "state created lazily"]
    assert len(lazy) == 1 and lazy[0].bytes == -states
    assert rec.unexplained(C.OPTIMIZER_STATES) == 0
    assert rep.reconcile(at="steady").row(C.OPTIMIZER_STATES).gap == 0


def test_megatron_block_activations_within_one_percent():
    # bf16 block with 1-byte dropout masks (native_dropout), s=128, b=2, h=256, a=4.
    s, b, h, a = 128, 2, 256, 4
    torch.manual_seed(0)
    block = Block(h, a).to(torch.bfloat16)

    class Layer(torch.nn.Module):
        # The block's input must be a previous op's output, as in a real stack of layers, not the
        # model's own input (which memprof counts as an input): x * 1.0 saves nothing itself.
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, x):
            return self.block(x * 1.0)

    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    with memprof.profile(layer := Layer()) as prof:
        layer(x).float().sum().backward()
    rep = prof.report()
    measured = rep.breakdown(0, "forward", "end")[C.ACTIVATIONS]
    formula = transformer_layer_activations(LayerShape(s, b, h, a))  # sbh(34 + 5as/h) = 65,536 * 44 = 2,883,584
    assert formula == 2_883_584
    # Exactly the measurement in docs/anatomy.md#measured-saved-tensors-per-block (torch 2.13, CPU; the .float()
    # cast and sum() save nothing).
    assert measured == 2_885_632
    assert abs(measured - formula) / formula < 0.01
    rec = rep.reconcile(at="peak", transformer=dict(seq_len=s, batch=b, hidden=h, heads=a, layers=1))
    causes = _causes(rec)
    # 2 LayerNorms x (mean + rstd) x s*b elements x 2 bytes (bf16 on CPU) = 2,048: named, not unexplained.
    assert causes.get("normalisation statistics") == 2 * 2 * s * b * 2


def test_autocast_weight_copies_are_named_with_exact_bytes():
    model = MLP()  # fc1 32->64, fc2 64->64, fc3 64->10, fp32 parameters
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    with memprof.profile(model) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
    rep = prof.report()
    assert rep.trace.autocast_dtype == "bfloat16"
    rec = rep.reconcile(at="peak")
    assert rec.precision == "amp"
    tags = dict(rep.trace.phases[0].tags_end)
    # mm saves the bf16 weight copy only where the input needs a gradient: fc2 and fc3, not fc1 (x has no grad).
    # (64*64 + 10*64) * 2 bytes = 9,472
    assert tags["autocast_weight_copy"] == (64 * 64 + 10 * 64) * 2


def _chain_reconciliation():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(32, 256), torch.randn(32, 256)
    return profile_training(model, opt, (x, y), loss=F.mse_loss)


def test_per_module_formula_gaps_are_all_named_for_a_chain():
    rep = _chain_reconciliation()
    rec = rep.reconcile(at="peak")
    assert rec.where.endswith("backward)")
    causes = _causes(rec, C.ACTIVATIONS)
    x = 32 * 256 * 4  # every activation of this chain is one 32x256 fp32 tensor: 32,768 B
    # Rules: each Linear saves its input, each ReLU its output: 5 x. Measured at the end of forward:
    # the two ReLU outputs (each saved by its ReLU and by the next Linear) and mse_loss's saved prediction.
    assert predict_activations(rep.trace).saved_bytes == 5 * x
    assert causes["saved by two modules"] == -2 * x
    # The first Linear's input is the batch: an input here, an activation in its rule.
    assert rep.trace.facts.activation_inputs_saved == x
    assert causes["model inputs saved by modules"] == -x
    assert causes["saved outside the model"] == x  # the prediction mse_loss keeps: taken at the forward's end
    # Backward had released all three saved tensors (3x, counted from the end of forward) at its peak.
    assert causes["released by backward"] == -3 * x
    assert rec.unexplained(C.ACTIVATIONS) == 0


def test_a_tensor_also_saved_by_a_module_without_a_rule_is_not_counted_as_shared():
    class Square(torch.nn.Module):  # no saved-bytes rule; t * t saves t (twice)
        def forward(self, t):
            return t * t

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), Square())
    with memprof.profile(model) as prof:
        model(torch.randn(4, 16)).sum().backward()
    fwd = next(p for p in prof.trace.phases if p.phase is memprof.Phase.FORWARD)
    # ReLU's output (4*16*4 = 256 B) is saved by ReLU and by Square; only ReLU's rule counts it, so the
    # formula counts it once, as the measurement does: not a double count.
    assert "saved_by_two_modules" not in dict(fwd.tags_end)
    assert fwd.end[C.ACTIVATIONS] == 4 * 16 * 4


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_estimate_matches_measurement(name):
    model, batch, loss_fn = make(name)
    opt = torch.optim.AdamW(model.parameters())
    x, y = batch
    est = memprof.estimate(model, opt, inputs=x, targets=y, loss_fn=loss_fn, device="cpu")
    assert not any(p.grad is not None for p in model.parameters())  # the user's model is untouched
    assert opt.state == {}
    measured = profile_training(model, opt, (x, y), loss=loss_fn).peak
    sim = est.peak
    assert abs(sim.total - measured.total) / measured.total < 0.01
    for cat in (C.WEIGHTS, C.OPTIMIZER_STATES, C.ACTIVATIONS):
        assert sim[cat] == measured[cat], cat


def test_an_lstm_is_simulated_with_onednns_workspace_on_the_cpu_and_said_to_be_unchecked_on_a_gpu():
    # oneDNN's LSTM kernel keeps a workspace for backward on a real CPU (memprof.simulate.onednn_rnn): the CPU
    # target has it, to the byte; a CUDA target runs the cell path, not cuDNN's kernel, and its notes say so.
    model, (x, y), loss_fn = make("lstm")
    est = memprof.estimate(model, None, inputs=x, targets=y, loss_fn=loss_fn, device="cpu")
    assert not any("LSTM" in n for n in est.notes), est.notes
    with memprof.profile(model) as prof:
        loss_fn(model(x), y).backward()
    measured = prof.report().breakdown(0, "forward", "end")[C.ACTIVATIONS]
    assert est.report().breakdown(0, "forward", "end")[C.ACTIVATIONS] == measured
    on_gpu = memprof.estimate(model, None, inputs=x, targets=y, loss_fn=loss_fn, gpu="h100-80gb")
    assert any("cuDNN's fused RNN kernel" in n and "not checked on a GPU" in n for n in on_gpu.notes), on_gpu.notes


def test_meta_estimate_of_a_large_model_uses_no_real_memory():
    from memprof.demo import TinyGPT

    def rss():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    with torch.device("meta"):
        model = TinyGPT(vocab=32000, hidden=2048, layers=16, heads=16, max_seq=1024)  # ~0.87 B parameters
        x = torch.empty(4, 1024, dtype=torch.long)
    n = sum(p.numel() for p in model.parameters())
    assert n > 800_000_000
    before = rss()
    est = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps), inputs=x, targets=x, loss_fn=TinyGPT.loss,
                           device="cuda")
    grown = rss() - before
    # fp32 weights alone would be 3.5 GB; the process grew by less than 200 MB.
    assert grown < 200 * 2**20
    assert est.peak[C.WEIGHTS] == 4 * n  # 4 B/param; every block rounds to 512 B and these are multiples of it
    assert est.peak[C.OPTIMIZER_STATES] == 8 * n  # exp_avg + exp_avg_sq; step counters live on the host


def test_max_batch_size_is_verified_by_simulation():
    model = MLP(256, 1024, 10)

    def make_batch(b):
        return torch.empty(b, 256, device="meta"), torch.empty(b, dtype=torch.long, device="meta")

    loss = lambda out, y: F.cross_entropy(out, y)  # noqa: E731
    small = memprof.estimate(model, None, inputs=torch.empty(8, 256), targets=torch.empty(8, dtype=torch.long),
                             loss_fn=loss)
    budget = small.peak_bytes + 40 * 1024 * 4 * 4  # room for about 40 more samples of activations
    plan = memprof.max_batch_size(model, None, make_batch, budget, loss_fn=loss)
    assert plan.batch_size % 8 == 0 and plan.batch_size >= 8
    assert plan.verified
    points = dict(plan.points)
    assert points[plan.batch_size] <= budget < points[plan.batch_size + 8]
    assert "largest batch size" in str(plan)
    none = memprof.max_batch_size(model, None, make_batch, 1000, loss_fn=loss)
    assert none.batch_size == 0


def test_max_batch_size_confirms_an_exact_line_in_three_simulations():
    # An MLP's peak grows exactly linearly with the batch, and what grows is its inputs and activations: the
    # line batch 8's records give (memprof.simulate.plan_search.per_sample) is exact, so the answer and the next
    # multiple (it fits, the next does not) are the only simulations after it; measuring the line through b=8
    # and b=16 first cost one more.
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    adamw = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
    plan = memprof.max_batch_size(mlp, adamw, lambda b: torch.randn(b, 128, 256, device="meta"), "256 MiB")
    assert plan.verified and [b for b, _ in plan.points] == [8, plan.batch_size, plan.batch_size + 8]


def test_advice_names_levers_and_misaligned_dimensions():
    model = torch.nn.Sequential(torch.nn.Linear(30, 50), torch.nn.ReLU(), torch.nn.Linear(50, 16)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(12, 30, dtype=torch.bfloat16)
    with memprof.profile(model, opt) as prof:
        model(x).float().sum().backward()
        opt.step()
    advice = prof.report().reconcile().advice()
    joined = "\n".join(advice)
    assert advice[0].startswith("largest category:")
    assert "8-bit AdamW" in joined
    # A CPU has no tensor cores: no alignment advice for a CPU run ...
    assert "tensor cores" not in joined and "not divisible" not in joined
    # ... but for the same step simulated for a GPU.
    est = memprof.estimate(model, opt, inputs=x, loss_fn=lambda out: out.float().sum(), device="cuda")
    joined = "\n".join(est.report().reconcile().advice())
    assert "not divisible by 8" in joined and "0.in_features=30" in joined and "0.out_features=50" in joined
    assert "batch size 12 is not a multiple of 8" in joined


def test_advice_frees_gradients_kept_between_steps():
    # set_to_none=False keeps every gradient through the next forward and backward, so they are
    # part of step 1's peak; set_to_none=True would free them.
    model = MLP(32, 1024, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(2048, 32), torch.randint(0, 10, (2048,))
    rep = profile_training(model, opt, (x, y), set_to_none=False)
    assert rep.trace.peak_step == 1 and rep.peak[C.GRADIENTS] == weight_bytes(model)
    assert any("set_to_none=True" in a for a in rep.reconcile().advice())
    # With set_to_none=True (the default) there is nothing to free, and no such advice.
    model2 = MLP(32, 1024, 10)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    assert not any("set_to_none=True" in a for a in profile_training(model2, opt2, (x, y)).reconcile().advice())


class _Split(torch.nn.Module):  # two Linears each save one half (a view) of one storage
    def __init__(self, d):
        super().__init__()
        self.fc0, self.fa, self.fb = torch.nn.Linear(d, 2 * d), torch.nn.Linear(d, 1), torch.nn.Linear(d, 1)

    def forward(self, x):
        a, b = self.fc0(x).chunk(2, dim=-1)
        return self.fa(a) + self.fb(b)


class _QKV(torch.nn.Module):  # three Linears save the same tensor
    def __init__(self, d):
        super().__init__()
        self.fc0 = torch.nn.Linear(d, d)
        self.q, self.k, self.v = torch.nn.Linear(d, 1), torch.nn.Linear(d, 1), torch.nn.Linear(d, 1)

    def forward(self, x):
        h = self.fc0(x)
        return self.q(h) + self.k(h) + self.v(h)


@pytest.mark.parametrize("cls", [_Split, _QKV])
def test_saved_by_two_modules_is_what_the_rules_count_beyond_the_storage(cls):
    torch.manual_seed(0)
    b, d = 64, 256
    model = cls(d)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.profile(model, opt) as prof:
        model(torch.randn(b, d)).square().mean().backward()
        opt.step()
    rec = prof.report().reconcile(at="peak")
    causes = _causes(rec, C.ACTIVATIONS)
    h = b * d * 4  # one 64x256 fp32 tensor: 65,536 B
    if cls is _Split:
        # fc0's output (2h) is one storage; fa and fb each save a half (h): the rules count 2h, as measured.
        assert "saved by two modules" not in causes
    else:
        # q, k and v each save h: the rules count 3h of a storage of h, 2h too many.
        assert causes["saved by two modules"] == -2 * h
    assert rec.unexplained(C.ACTIVATIONS) == 0


def test_model_inputs_saved_count_the_saved_view_not_the_dataset():
    torch.manual_seed(0)
    data = torch.randn(20000, 64)  # a dataset in memory; each batch is a 32-row view of it
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.profile(model, opt) as prof:
        train(model, opt, lambda i: (data[i * 32:(i + 1) * 32], None), loss=lambda out, _: out.square().mean(),
              keep_batch=False)
    # The first Linear's rule counts its input, 32*64*4 = 8,192 B, not the 5,120,000 B storage under it.
    assert prof.trace.facts.activation_inputs_saved == 32 * 64 * 4
    rec = prof.report().reconcile(at="peak")
    assert _causes(rec)["model inputs saved by modules"] == -32 * 64 * 4
    assert rec.unexplained(C.ACTIVATIONS) == 0


def test_a_no_grad_forward_after_backward_is_not_the_forward_backward_counts_from():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 256)
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            model(x).square().mean().backward()
            with torch.no_grad():
                model(torch.randn(4, 256))  # a look at the outputs before the step: a second forward
            opt.step()
            opt.zero_grad()
    phases = [p.phase for p in prof.trace.phases if p.step == 1 and p.phase is not memprof.Phase.OTHER]
    assert phases[:3] == [memprof.Phase.FORWARD, memprof.Phase.BACKWARD, memprof.Phase.FORWARD]
    rec = prof.report().reconcile(at="peak")
    assert rec.where.endswith("backward)")
    causes = _causes(rec, C.ACTIVATIONS)
    # Counted from the training forward's end, not from the no_grad one (which saved nothing).
    assert causes["released by backward"] < 0
    assert rec.unexplained(C.ACTIVATIONS) == 0


def test_a_dropout_mask_saved_in_container_code_is_functional_code_for_the_per_module_formula():
    class Block(torch.nn.Module):  # has a submodule, and calls dropout itself
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):
            return F.dropout(self.lin(x), p=0.5, training=True)

    torch.manual_seed(0)
    model = Block()
    with memprof.profile(model) as prof:
        model(torch.randn(32, 64)).sum().backward()
    fwd = next(p for p in prof.trace.phases if p.phase is memprof.Phase.FORWARD)
    tags = dict(fwd.tags_end)
    mask = 32 * 64 * 4  # the CPU path keeps an fp32 noise mask the size of the input: 8,192 B
    # One storage, two tags: what it is (for Korthikanti's dropout cause) and where it was saved from.
    assert tags["dropout_mask_4byte"] == mask
    assert tags["saved_in_container_code"] == mask
    rec = prof.report().reconcile(at="peak")
    causes = _causes(rec, C.ACTIVATIONS)
    assert causes["functional code in container modules"] == mask
    assert rec.unexplained(C.ACTIVATIONS) == 0


class _FirstToken(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.ln, self.head = torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)

    def forward(self, x):  # x: (batch, seq, 32)
        return self.head(self.ln(self.lin(x)[:, 0]))


def test_a_module_saving_a_view_of_a_larger_storage_is_named():
    torch.manual_seed(0)
    model = _FirstToken()
    with memprof.profile(model) as prof:
        model(torch.randn(8, 16, 32)).sum().backward()
    rec = prof.report().reconcile(at="peak")
    causes = _causes(rec, C.ACTIVATIONS)
    # LayerNorm saves lin's output[:, 0] (8*32*4 = 1,024 B, what its rule counts); autograd keeps the
    # whole 8*16*32*4 = 16,384 B storage under it, which memprof counts: 15,360 B more.
    assert causes["saved views of larger storages"] == 8 * 16 * 32 * 4 - 8 * 32 * 4
    assert rec.unexplained(C.ACTIVATIONS) == 0


class _SquareThenLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.out = torch.nn.Linear(32, 64), torch.nn.Linear(64, 4)

    def forward(self, x):
        h = self.lin(x)
        s = h * h  # the container's own code saves h first...
        return self.out(h) + s.sum()  # ...then out, whose rule counts it


def test_container_code_cause_leaves_out_what_a_later_rule_counts():
    torch.manual_seed(0)
    model = _SquareThenLinear()
    x = torch.randn(16, 32)
    with memprof.profile(model) as prof:
        model(x).sum().backward()
    rec = prof.report().reconcile(at="peak")
    causes = _causes(rec, C.ACTIVATIONS)
    # h (16*64*4 = 4,096 B) is in the formula through out's rule: not functional code as well.
    assert "functional code in container modules" not in causes
    assert causes["model inputs saved by modules"] == -16 * 32 * 4  # lin's rule counts the batch
    assert rec.unexplained(C.ACTIVATIONS) == 0


class _ExpandThenNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)

    def forward(self, x):  # x: (4, 32)
        return self.ln(self.fc(x)[:, None, :].expand(-1, 8, -1)).sum(1)


class _TanhFanout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc0, self.fc1, self.fc2 = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x):
        h = torch.tanh(self.fc0(x))  # the container's code saves h first
        return self.fc1(h) + self.fc2(h)  # then two Linears save it


@pytest.mark.parametrize("cls, cause, nbytes", [
    # LayerNorm saves an expanded view of fc's 4*32*4 = 512 B output: its rule counts 4*8*32*4 = 4,096 B.
    (_ExpandThenNorm, "saved expanded views", -(4096 - 512)),
    # fc1's and fc2's rules each count h (512 B) that tanh's container code saved first: one 512 B too many.
    (_TanhFanout, "saved by two modules", -512),
])
def test_rules_counting_more_than_a_storage_is_named(cls, cause, nbytes):
    torch.manual_seed(0)
    model = cls()
    with memprof.profile(model) as prof:
        F.mse_loss(model(torch.randn(4, 32)), torch.randn(4, 32)).backward()
    rec = prof.report().reconcile(at="peak")
    assert _causes(rec)[cause] == nbytes
    assert rec.unexplained(C.ACTIVATIONS) == 0
