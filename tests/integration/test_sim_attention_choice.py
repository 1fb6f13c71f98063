"""A CUDA target's attention runs as the kernel torch's dispatcher picks for that GPU (memprof.simulate.sdpa_rules),
saving what that kernel saves; DeepSeek-V3's multi-head latent attention (query and key head dim 192, value 128),
which flash attention does not take, is estimated on an H100 and an A100 with the kernels torch would run there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C
from memprof.errors import InvalidArgumentError, SimulationError

transformers = pytest.importorskip("transformers")


class _Mla(nn.Module):
    """Attention with DeepSeek-V3's head dims: query and key 192 (128 + 64 rope), value 128."""

    def __init__(self, heads=4, qk=192, v=128, hidden=64):
        super().__init__()
        self.heads, self.qk, self.v = heads, qk, v
        self.q = nn.Linear(hidden, heads * qk, bias=False)
        self.k = nn.Linear(hidden, heads * qk, bias=False)
        self.val = nn.Linear(hidden, heads * v, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k = (p(x).view(b, s, self.heads, self.qk).transpose(1, 2) for p in (self.q, self.k))
        v = self.val(x).view(b, s, self.heads, self.v).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def _saved(gpu, b=2, s=48, attention="auto"):
    with torch.device("meta"):
        model = _Mla()
    est = memprof.estimate(model, None, inputs=torch.empty(b, s, 64), gpu=gpu, precision="bf16",
                           loss_fn=lambda out: out, attention=attention)
    forward = next(ph for ph in est.trace.phases if ph.phase.value == "forward")
    return forward.end[C.ACTIVATIONS], est


def test_mla_head_dims_take_cudnn_on_an_h100_and_the_memory_efficient_kernel_on_an_a100():
    b, s, h = 2, 48, 4
    q = k = b * s * h * 192 * 2  # the projections' bf16 outputs, which q and k view
    v = out = b * s * h * 128 * 2
    # H100 (sm90): cuDNN 9.20 (torch 2.13's wheel) is newer than 9.15.0, so cuDNN comes first, and takes head
    # dims up to 256 on sm90. It saves q, k, v, its output, an fp32 logsumexp of (b, h, s, 1) and two int64
    # philox scalars (512 B each in CUDA's allocator).
    saved, est = _saved("h100")
    assert saved == q + k + v + out + b * h * s * 4 + 2 * 512
    assert any("cuDNN x2" in n for n in est.notes)
    # A100 (sm80): flash first, ruled out by check_head_dim_size_flash (value's head dim differs); the
    # memory-efficient kernel's logsumexp pads the sequence to a multiple of 32: (b, h, 64) in fp32.
    saved, est = _saved("a100")
    assert saved == q + k + v + out + b * h * 64 * 4 + 2 * 512
    assert any("memory-efficient x2" in n for n in est.notes)
    assert any("flash: check_head_dim_size_flash" in n for n in est.notes)
    # T4 (sm75): flash needs sm80 and the memory-efficient kernel takes no bf16 there: math, which keeps the
    # s x s softmax of every head (and more).
    math, est = _saved("t4")
    assert any("math x2" in n for n in est.notes) and math - saved >= b * h * s * s * 2


def test_a_deepseek_v3_model_is_estimated_for_an_h100_and_an_a100():
    T = transformers
    cfg = T.DeepseekV3Config(
        vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=64, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)  # DeepSeek-V3's head dims: 192 and 128
    with torch.device("meta"):
        model = T.DeepseekV3ForCausalLM(cfg)
    ids = torch.zeros(2, 16, dtype=torch.long)
    for gpu, kernel in (("h100", "cuDNN x2"), ("a100", "memory-efficient x2")):
        est = memprof.estimate(model, None, inputs={"input_ids": ids, "labels": ids}, gpu=gpu, precision="bf16",
                               loss_fn=lambda out: out.loss)
        assert any(f"attention='auto'): {kernel}" in n for n in est.notes), (gpu, est.notes)
        assert est.peak_bytes > 0


def test_without_a_gpu_the_choice_says_which_capability_it_took():
    with torch.device("meta"):
        model = _Mla()
    est = memprof.estimate(model, None, inputs=torch.empty(2, 48, 64), device="cuda", precision="bf16",
                           loss_fn=lambda out: out)
    assert any("no GPU named" in n and "8.0" in n for n in est.notes)
    assert any("memory-efficient x2" in n for n in est.notes)


def test_forcing_a_kernel_torch_could_not_run_names_its_rule():
    with pytest.raises(InvalidArgumentError, match="check_head_dim_size_flash.*No available kernel"):
        _saved("a100", attention="flash")
    # cuDNN's head dims stop at 128 on sm80 (check_cudnn_tensor_shapes); 256 on sm90.
    with pytest.raises(InvalidArgumentError, match="check_cudnn_tensor_shapes"):
        _saved("a100", attention="cudnn")
    _, est = _saved("h100", attention="efficient")
    assert any("attention='efficient'): memory-efficient x2" in n for n in est.notes)


def test_the_users_own_backend_switches_are_honoured():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # as a training script may pin it
        _, est = _saved("h100")
    assert any("attention='auto'): memory-efficient x2" in n for n in est.notes)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # flash alone: torch finds no kernel for these head dims
        with pytest.raises(InvalidArgumentError, match="no attention kernel torch may use.*No available kernel"):
            _saved("h100")


def test_a_failure_inside_memprofs_kernel_rule_names_the_rule_not_the_model(monkeypatch):
    from memprof.simulate.kernels import CudaKernels

    def wrong(self, query, key, value, *args):  # a defect in memprof's rule: the value's head dim lost
        return torch.empty(*query.shape, dtype=query.dtype, device=query.device)

    monkeypatch.setattr(CudaKernels, "_efficient", wrong)
    with pytest.raises(SimulationError, match="memprof's own rule failed, not the model.*memory-efficient kernel"):
        _saved("a100")

    def raising(self, *args):
        raise RuntimeError("an op this rule called refused its arguments")

    monkeypatch.setattr(CudaKernels, "_efficient", raising)
    with pytest.raises(SimulationError, match="memprof's own rule failed, not the model.*refused its arguments"):
        _saved("a100")


def test_a_call_torch_refuses_itself_keeps_torchs_error():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x, mask):
            q = self.lin(x).view(2, 16, 4, 16).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum()

    with torch.device("meta"):
        model = Masked()
    # A mask of 3 query rows for 16 queries: no kernel's rule checks it for the memory-efficient kernel, whose
    # preparation fails on it as torch's math path does; the error is the model's call, not memprof's rule.
    with pytest.raises(SimulationError) as info:
        memprof.estimate(model, None, inputs=(torch.empty(2, 16, 64), torch.ones(3, 16, dtype=torch.bool)),
                         gpu="a100", loss_fn=lambda out: out)
    assert "memprof's own" not in str(info.value)


def _raised_in(path: str, function: str) -> BaseException:
    namespace: dict = {}
    exec(compile(f"def {function}():\n    raise RuntimeError('refused')\n", path, "exec"), namespace)
    try:
        namespace[function]()
    except RuntimeError as exc:
        return exc
    raise AssertionError("unreachable")  # pragma: no cover


def test_the_simulation_error_blames_memprofs_rule_only_where_the_rule_made_the_call():
    from memprof.simulate.failures import simulation_error as _simulation_error

    own = _simulation_error(_raised_in("/x/memprof/simulate/autocast.py", "_cast"), 0)
    assert "inside memprof's own simulation rule memprof.simulate.autocast._cast" in str(own)
    assert "must run on shape-only tensors" not in str(own)
    # A rule's dispatch frame hands the model's own call on: the failure is the model's call.
    passed = _simulation_error(_raised_in("/x/memprof/simulate/shadows.py", "__torch_dispatch__"), 0)
    assert "memprof's own" not in str(passed) and "must run on shape-only tensors" in str(passed)
    # A rule that runs a device kernel's own checks (the grouped GEMM's) refuses what the device refuses.
    from memprof.simulate.failures import KernelRefusal

    refused = KernelRefusal("torch._grouped_mm: strides should be multiple of 16 bytes", fix="Sizes a multiple of 8.")
    said = str(_simulation_error(refused, 0))
    assert "memprof's own" not in said and "a run on the device fails here too. Sizes a multiple of 8." in said


def test_the_memory_efficient_kernel_keeps_its_mask_padded_to_16_columns():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x, mask):
            q = self.lin(x).view(2, 12, 4, 16).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum()

    with torch.device("meta"):
        model = Masked()
    est = memprof.estimate(model, None, inputs=(torch.empty(2, 12, 64), torch.ones(12, 12, dtype=torch.bool)),
                           gpu="a100", loss_fn=lambda out: out)
    assert any("memory-efficient x2" in n for n in est.notes)
    forward = next(ph for ph in est.trace.phases if ph.phase.value == "forward")
    # fp32, b 2, a 4, s 12, head dim 16. Saved: the projection's output, which q, k and v view (2 x 12 x 64 x 4 =
    # 6,144 B), the output (6,144 B), the logsumexp padded to 32 rows (2 x 4 x 32 x 4 = 1,024 B), two philox
    # scalars (512 B each) and the mask as attention.cpp's preprocess_mask hands it to the kernel: made additive,
    # expanded to (2, 4, 12, 12) and padded to 16 columns, a copy of 2 x 4 x 12 x 16 x 4 = 6,144 B.
    assert forward.end[C.ACTIVATIONS] == 6_144 + 6_144 + 1_024 + 2 * 512 + 6_144
