"""CUDA's autocast policy on shape-only tensors (memprof.simulate.autocast) against torch's own.

The oracle: torch's real ``AutocastCUDA`` kernels run forward-only on fake CUDA tensors even on a
CPU-only build (autograd is what needs a CUDA device, so parameters do not require grad there). The
emulation on meta tensors must issue the same aten ops with the same output shapes and dtypes. The
weight cache and what autograd saves are held to a real CPU autocast run, whose cache is the same code
(aten/src/ATen/autocast_mode.cpp), on a model whose ops both devices' lists treat alike.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memprof
from memprof.simulate.autocast import CudaAutocast
from memprof.simulate.kernels import CudaKernels


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace != "prim":
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.ops.append((str(func.overloadpacket),
                             tuple((tuple(o.shape), o.dtype) for o in outs if isinstance(o, torch.Tensor))))
        return out


class _GPTish(nn.Module):
    """LayerNorm, linears, explicit softmax attention, GELU, RMSNorm both ways, tied logits, three losses."""

    def __init__(self, h=16, a=2, v=32):
        super().__init__()
        self.a = a
        self.emb = nn.Embedding(v, h)
        self.ln1, self.ln2, self.rms = nn.LayerNorm(h), nn.LayerNorm(h), nn.RMSNorm(h)
        self.qkv, self.o = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.pr = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, ids, tgt):
        x = self.emb(ids)
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        b, t, h = q.shape
        q, k, v = (z.view(b, t, self.a, h // self.a).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / 4, -1)
        y = torch.einsum("bhts,bhsd->bhtd", att, v).transpose(1, 2).reshape(b, t, h)
        x = x + self.o(y)
        x = x + self.pr(F.gelu(self.fc(self.ln2(x))))
        x = self.rms(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        logits = F.linear(x, self.emb.weight)
        return (F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1)) + F.mse_loss(x, x.detach())
                + logits.sum() * 0 + torch.baddbmm(att.select(1, 0), x, x.transpose(1, 2)).mean())


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.gn, self.c2 = nn.GroupNorm(2, 8), nn.Conv2d(8, 4, 3)

    def forward(self, x, tgt):
        y = self.gn(F.relu(self.bn(self.c1(x))))
        y = F.interpolate(y, scale_factor=2, mode="nearest")
        return F.cross_entropy(self.c2(y).mean((2, 3)), tgt)


class _MHA(nn.Module):
    """torch's own attention: a Python composite (F.multi_head_attention_forward) around listed ops."""

    def __init__(self):
        super().__init__()
        # kdim/vdim of their own: separate projections (the packed one reshapes in a way fake CUDA tensors refuse)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True, kdim=8, vdim=8)

    def forward(self, x, tgt):
        mem = x.narrow(-1, 0, 8)  # (indexing needs a CUDA device guard on fake CUDA tensors; narrow does not)
        y, w = self.mha(x, mem, mem, need_weights=True)
        return F.normalize(y, dim=-1).sum() + w.sum() + tgt.sum()


_CASES = {
    "gpt-like": (_GPTish, lambda: (torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long))),
    "cnn": (_CNN, lambda: (torch.zeros(2, 3, 8, 8), torch.zeros(2, dtype=torch.long))),
    "multihead-attention": (_MHA, lambda: (torch.zeros(2, 4, 16), torch.zeros(2))),
}


def _real_cuda_autocast_ops(build, inputs, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        model, args = build().eval(), inputs()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        memo = {id(p): nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="cuda"),
                                    requires_grad=False) for p in model.parameters()}
        memo.update({id(b): torch.zeros(b.shape, dtype=b.dtype, device="cuda") for b in model.buffers()})
        model = copy.deepcopy(model, memo)
        args = tuple(torch.zeros(t.shape, dtype=t.dtype, device="cuda") for t in args)
    log = _OpLog()
    # torch.autocast("cuda") refuses to start without a GPU; these are the calls it makes.
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        with fake, torch.no_grad(), log:
            model(*args)
    finally:
        torch.autocast_decrement_nesting()
        torch.set_autocast_enabled("cuda", False)
        torch.clear_autocast_cache()
    return log.ops


def _emulated_ops(build, inputs, dtype):
    with torch.device("meta"):
        model, args = build().eval(), inputs()
    for p in model.parameters():
        p.requires_grad_(False)  # as in the oracle, which cannot run autograd
    log, emulated = _OpLog(), CudaAutocast(dtype)
    with emulated:
        emulated.begin_forward()
        with torch.no_grad(), log:
            model(*args)
        emulated.end_forward()
    return log.ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(_CASES))
def test_the_emulation_issues_the_ops_torchs_cuda_autocast_issues(case, dtype):
    build, inputs = _CASES[case]
    real = _real_cuda_autocast_ops(build, inputs, dtype)
    emulated = _emulated_ops(build, inputs, dtype)
    # Same aten ops, in the same order, with the same output shapes and dtypes: which ops run in 16 bits,
    # which in fp32, and every cast autocast makes (the C++ argument order included).
    assert emulated == real
    casts = [op for op in real if op[0] == "aten._to_copy"]
    assert casts, "the oracle must exercise autocast's casts"


class _MLP(nn.Module):
    # Ops on which CPU's and CUDA's autocast lists agree (linear in 16 bits; relu and the cast loss as they
    # come); the second linear is used twice, so the weight cache decides how many copies exist.
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.b(F.relu(self.b(F.relu(self.a(x))))).float().pow(2).sum()


def _measured(model, x, autocast):
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt, mode="exact") as prof:
        for _ in range(2):
            with autocast():
                loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
        del loss  # the loop has ended: its last loss is released, as the estimate's loop releases it
    return prof.report().trace


def test_weight_casts_are_cached_and_saved_as_a_real_autocast_run_keeps_them():
    from memprof.collect.profiler import Profiler

    torch.manual_seed(0)
    real = _measured(_MLP(), torch.randn(16, 32), lambda: torch.autocast("cpu", dtype=torch.bfloat16))

    from torch._subclasses.fake_tensor import FakeTensorMode

    # Shape-only CPU tensors, as a CPU-target simulation uses (on meta, AdamW's step counters would live on
    # the CPU, outside the count); the emulation casts them without torch's CPU autocast running.
    fake = FakeTensorMode()
    with fake:
        model, x = _MLP(), torch.empty(16, 32)
    opt = torch.optim.AdamW(model.parameters())
    emulated = CudaAutocast(torch.bfloat16)
    prof = Profiler(model, opt, mode="exact", timeline=False, _allow_meta=True, _fake_mode=fake)
    with fake, prof, emulated:
        for _ in range(2):
            emulated.begin_forward()
            loss = model(x)
            emulated.end_forward()
            loss.backward()
            opt.step()
            opt.zero_grad()
        del loss  # the loop has ended: its last loss is released, as the estimate's loop releases it
    # Every category at the peak and each phase's peak, to the byte: one bf16 copy per weight per forward
    # (b's weight is used twice and cast once), saved for backward, dropped after it.
    assert prof.trace.peak == real.peak
    assert [p.peak for p in prof.trace.phases] == [p.peak for p in real.phases]


def test_fused_attention_inside_torchs_multihead_attention_is_seen_on_a_cuda_target():
    # F.multi_head_attention_forward is Python; the attention it calls must still reach the CUDA kernel choice.
    if getattr(torch._C, "_skip_one_hop_torch_function", None) is None:
        pytest.skip("this torch cannot re-enter a torch function mode")
    with torch.device("meta"):
        mha, x = nn.MultiheadAttention(64, 4, batch_first=True, dtype=torch.bfloat16), torch.empty(
            2, 128, 64, dtype=torch.bfloat16)
    kernels = CudaKernels()
    with kernels:
        mha(x, x, x, need_weights=False)
    assert kernels.used == {"flash": 1}


def test_a_mixed_estimate_for_cuda_saves_one_16_bit_copy_per_weight():
    with torch.device("meta"):
        model = _MLP()
    est = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps), inputs=torch.empty(16, 32), device="cuda",
                           precision="mixed", loss_fn=lambda out: out)
    forward = est.trace.phases[0]
    assert forward.phase.value == "forward"
    # Saved for backward: b's bf16 weight, 64*64*2 = 8,192 B (a multiple of 512, so no rounding), once although b
    # runs twice (the cache); a's copy is not saved, as the input x needs no gradient.
    assert dict(forward.tags_end)["autocast_weight_copy"] == 64 * 64 * 2
    assert est.trace.autocast_dtype == "bfloat16"


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.ln, self.b = nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64)

    def _region(self, x):
        return self.b(F.gelu(self.ln(self.a(x))))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self._region, x, use_reentrant=False).float().sum()


def test_checkpointed_regions_recompute_under_the_policy_they_ran_under():
    # torch.utils.checkpoint compares what the recomputation saves with what the forward saved: a recomputation
    # outside the emulated autocast would save fp32 where the forward saved bf16, and raise CheckpointError.
    with torch.device("meta"):
        model = _Checkpointed()
    est = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps), inputs=torch.empty(512, 64), device="cuda",
                           precision="mixed", loss_fn=lambda out: out)
    backward = next(p for p in est.trace.phases if p.phase.value == "backward")
    # The recomputed region saves again in backward, in bf16: a's input cast (512*64*2 = 65,536 B) among them.
    assert backward.peak["activations"] >= 512 * 64 * 2
    # The optimizer step runs outside autocast: AdamW's exp_avg and exp_avg_sq in fp32 for each of the 6 parameters,
    # in 512-byte blocks: a.weight, b.weight 64*64*4 = 16,384 B; a.bias, b.bias, ln.weight, ln.bias 256 -> 512 B.
    states = 2 * (2 * 16384 + 4 * 512)
    assert est.trace.phases[-1].end["optimizer_states"] == states


def test_a_checkpointed_hf_llama_is_estimated_for_cuda_in_mixed_precision():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.zeros(2, 32, dtype=torch.long)
    est = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps), inputs={"input_ids": ids, "labels": ids},
                           loss_fn=lambda out: out.loss, device="cuda", precision="mixed")
    # Flash attention in the forward and again in each layer's recomputation; the packed-sequence check that needs
    # values is named, not a crash.
    assert any("flash x4" in n or "flash x8" in n for n in est.notes)
    assert any("find_packed_sequence_indices" in n and "plain case" in n for n in est.notes)
    assert est.trace.autocast_dtype == "bfloat16"


def test_torchs_own_attention_layer_gets_cast_then_flash_on_a_cuda_target():
    # Autocast's casts (fp32 parameters, bf16 compute) and then the kernel choice both see the attention called
    # inside F.multi_head_attention_forward, a Python composite: one mode applies both rules in order.
    if getattr(torch._C, "_skip_one_hop_torch_function", None) is None:
        pytest.skip("this torch cannot re-enter a torch function mode")

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(64, 4, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    with torch.device("meta"):
        model = Layer()
    est = memprof.estimate(model, None, inputs=torch.empty(2, 128, 64), device="cuda", precision="mixed")
    assert any("flash x2" in n for n in est.notes)  # one attention per step, two steps
    fp32 = memprof.estimate(model, None, inputs=torch.empty(2, 128, 64), device="cuda")
    # In fp32 flash cannot run: the memory-efficient kernel takes it.
    assert any("memory-efficient x2" in n for n in fp32.notes)


def test_a_failed_estimate_leaves_no_emulated_autocast_behind():
    from memprof.simulate.autocast import emulated_autocast_dtype

    class ReadsValues(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            y = self.lin(x)
            return y * 2 if y.sum() > 0 else y

    with pytest.raises(memprof.errors.SimulationError):
        memprof.estimate(ReadsValues(), None, inputs=torch.randn(4, 16), device="cuda", precision="mixed")
    assert emulated_autocast_dtype() is None
    assert not torch.is_autocast_enabled("cuda")
    # A real profile on the same thread afterwards is not taken for an autocast run.
    model = nn.Linear(16, 16)
    with memprof.profile(model) as prof:
        model(torch.randn(4, 16)).sum().backward()
    assert prof.report().trace.autocast_dtype is None


def test_a_region_the_model_runs_without_autocast_stays_fp32():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            h = self.body(x)
            with torch.autocast("cuda", enabled=False):  # the usual way to keep a head in fp32
                return self.head(h.float())

    with torch.device("meta"):
        model = Head()
    est = memprof.estimate(model, None, inputs=torch.empty(512, 64), device="cuda", precision="mixed")
    forward = est.trace.phases[0]
    # body runs in bf16 (its input cast for the weight's gradient, 512*64*2 = 65,536 B); the head in fp32 saves
    # the fp32 h (512*64*4 = 131,072 B) and no bf16 weight copy.
    assert dict(forward.tags_end).get("autocast_weight_copy", 0) == 0
    assert forward.end["activations"] == 512 * 64 * 2 + 512 * 64 * 4
