"""The attention kernel torch 2.13's CUDA dispatcher picks, held case by case against its rules.

Each case names the kernel ``select_sdp_backend`` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) returns
and, where a kernel tried first is ruled out, the rule that rules it out, with the source in a comment. The rules
shared with the CPU dispatcher (sdp_utils_cpp.h) are also held against torch's own compiled code: on CPU tensors
``torch._fused_sdp_choice`` runs the same functions. The CUDA-only ones cannot run here: the CPU build's
``torch.backends.cuda.can_use_flash_attention`` / ``can_use_efficient_attention`` / ``can_use_cudnn_attention``
answer False for every input ("Torch was not compiled with flash attention"), which the last test checks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memprof.simulate import sdpa_rules as sdpa
from memprof.simulate.sdpa_rules import CUDNN, EFFICIENT, FLASH, MATH

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _t(shape, dtype=BF16, stride=None, offset=0, grad=False):
    if stride is None:  # contiguous
        stride, n = [], 1
        for s in reversed(shape):
            stride.insert(0, n)
            n *= s
    return sdpa.Facts(tuple(shape), tuple(stride), offset, dtype, grad)


def call(q=(2, 8, 128, 64), k=None, v=None, dtype=BF16, mask=None, dropout=0.0, causal=False, gqa=False, grad=True,
         **facts):
    """A call of sdpa with contiguous q, k, v of these shapes (k and v default to q's); ``facts`` replaces a
    tensor's facts (``q_facts=``...)."""
    k, v = k or q, v or k or q
    return sdpa.Call(facts.get("q_facts", _t(q, dtype)), facts.get("k_facts", _t(k, dtype)),
                     facts.get("v_facts", _t(v, dtype)), mask, dropout, causal, gqa, grad)


SM75, SM80, SM86, SM89, SM90, SM100, SM120 = (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)
DS = dict(q=(2, 4, 64, 192), v=(2, 4, 64, 128))  # DeepSeek-V3's MLA: qk head dim 128 + 64 rope, v head dim 128


def dev(cc, **kw):
    return sdpa.Device(capability=cc, **kw)


# (id, call, device, expected kernel, {kernel ruled out first: the rule ruling it out})
CASES = [
    # Every flash rule holds: flash comes first in torch's default order (at::Context's sdp_priority_order).
    ("bf16-sm80", call(), dev(SM80), FLASH, {}),
    # check_head_dim_size_flash: q, k and v must share one head dim; check_head_dim_size_mem_efficient asks only
    # q's and k's to be equal (and v's a multiple of 8).
    ("mla-192-128-sm80", call(**DS), dev(SM80), EFFICIENT, {FLASH: "check_head_dim_size_flash"}),
    # check_prefer_cudnn_attention: cuDNN 9.20 (> 9.15.0) on sm90 puts cuDNN first; check_cudnn_tensor_shapes
    # allows head dims up to 256 on sm90 from cuDNN 9.10.
    ("mla-192-128-sm90", call(**DS), dev(SM90), CUDNN, {}),
    # sm100: cuDNN's limit is 128, but (192, 128) is allowed from cuDNN 9.11 (check_cudnn_tensor_shapes).
    ("mla-192-128-sm100", call(**DS), dev(SM100), CUDNN, {}),
    # cuDNN 9.10 is not newer than 9.15.0: torch's default order, flash ruled out by the head dims.
    ("mla-sm100-cudnn-9.10", call(**DS), dev(SM100, cudnn=91000), EFFICIENT, {FLASH: "check_head_dim_size_flash"}),
    # Head dim 256 on sm100: cuDNN's limit there is 128 (check_cudnn_tensor_shapes); flash takes up to 256.
    ("d256-sm100", call(q=(2, 4, 64, 256)), dev(SM100), FLASH, {CUDNN: "check_cudnn_tensor_shapes"}),
    # Head dim 320: above flash's 256 (check_head_dim_size_flash) and cuDNN's 256 on sm90; memory-efficient has
    # no upper limit, only the alignment.
    ("d320-sm80", call(q=(2, 4, 64, 320)), dev(SM80), EFFICIENT, {FLASH: "check_head_dim_size_flash"}),
    ("d320-sm90", call(q=(2, 4, 64, 320)), dev(SM90), EFFICIENT,
     {CUDNN: "check_cudnn_tensor_shapes", FLASH: "check_head_dim_size_flash"}),
    # fp32: check_dtypes_flash_attention takes fp16/bf16 only; memory-efficient takes fp32.
    ("fp32-sm80", call(dtype=FP32), dev(SM80), EFFICIENT, {FLASH: "check_dtypes_flash_attention"}),
    # Grouped-query attention with enable_gqa: flash's check_batch_size_and_num_heads_dense<true, true> takes it;
    # memory-efficient's <false, true> does not (torch 2.13; native GQA came to it later).
    ("gqa-bf16-sm80", call(q=(2, 8, 64, 64), k=(2, 2, 64, 64), gqa=True), dev(SM80), FLASH, {}),
    ("gqa-fp32-sm80", call(q=(2, 8, 64, 64), k=(2, 2, 64, 64), gqa=True, dtype=FP32), dev(SM80), MATH,
     {FLASH: "check_dtypes_flash_attention", EFFICIENT: "check_batch_size_and_num_heads_dense"}),
    # Unequal head counts without enable_gqa: no fused kernel takes them.
    ("heads-no-gqa-sm80", call(q=(2, 8, 64, 64), k=(2, 2, 64, 64)), dev(SM80), MATH,
     {FLASH: "check_batch_size_and_num_heads_dense", EFFICIENT: "check_batch_size_and_num_heads_dense"}),
    # cuDNN's check_batch_size_and_num_heads_dense<true, false>: key and value head counts may differ if both divide.
    ("gqa-k2-v4-sm90", call(q=(2, 8, 64, 64), k=(2, 2, 64, 64), v=(2, 4, 64, 64), gqa=True), dev(SM90), CUDNN, {}),
    # A mask: check_for_attn_mask rules flash out; memory-efficient takes any mask.
    ("mask-sm80", call(mask=_t((2, 1, 128, 128), torch.bool)), dev(SM80), EFFICIENT, {FLASH: "check_for_attn_mask"}),
    # cuDNN takes a 4-D mask broadcastable to the scores (check_attn_mask_shape) ...
    ("mask-sm90", call(mask=_t((2, 1, 128, 128), torch.bool)), dev(SM90), CUDNN, {}),
    # ... but not a 3-D one.
    ("mask-3d-sm90", call(mask=_t((2, 128, 128), torch.bool)), dev(SM90), EFFICIENT,
     {CUDNN: "check_attn_mask_shape", FLASH: "check_for_attn_mask"}),
    # A mask whose last dim is not of stride 1: check_last_dim_stride_equals_1_dense on a GPU.
    ("mask-strided-sm80", call(mask=_t((128, 128), BF16, stride=(1, 128))), dev(SM80), MATH,
     {FLASH: "check_for_attn_mask", EFFICIENT: "check_last_dim_stride_equals_1_dense"}),
    # check_cudnn_dropout: a dropout that is not a multiple of 1/16 rules cuDNN out; flash keeps its own dropout.
    ("dropout-0.1-sm90", call(dropout=0.1), dev(SM90), FLASH, {CUDNN: "check_cudnn_dropout"}),
    ("dropout-0.125-sm90", call(dropout=0.125), dev(SM90), CUDNN, {}),
    # check_nonzero_sequence_lengths_dense, in every fused backend.
    ("empty-query-sm80", call(q=(2, 8, 0, 64), k=(2, 8, 128, 64)), dev(SM80), MATH,
     {FLASH: "check_nonzero_sequence_lengths_dense", EFFICIENT: "check_nonzero_sequence_lengths_dense"}),
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: training, head dim in (192, 224].
    ("d208-train-sm86", call(q=(2, 4, 64, 208)), dev(SM86), EFFICIENT,
     {FLASH: "check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120"}),
    ("d208-inference-sm86", call(q=(2, 4, 64, 208), grad=False), dev(SM86), FLASH, {}),
    ("d208-train-sm80", call(q=(2, 4, 64, 208)), dev(SM80), FLASH, {}),
    # Above 224 only without dropout.
    ("d256-train-sm89", call(q=(2, 4, 64, 256)), dev(SM89), FLASH, {}),
    ("d256-dropout-sm89", call(q=(2, 4, 64, 256), dropout=0.1), dev(SM89), EFFICIENT,
     {FLASH: "check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120"}),
    ("d208-train-sm120", call(q=(2, 4, 64, 208)), dev(SM120), EFFICIENT,
     {FLASH: "check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120"}),
    # sm75 (T4): flash needs sm80 (check_flash_attention_hardware_support); memory-efficient takes fp16 there but
    # not bf16 (its dtype lists by compute capability).
    ("fp16-sm75", call(dtype=FP16), dev(SM75), EFFICIENT, {FLASH: "check_flash_attention_hardware_support"}),
    ("bf16-sm75", call(), dev(SM75), MATH,
     {FLASH: "check_flash_attention_hardware_support", EFFICIENT: "check_dtypes_mem_efficient"}),
    # check_flash_causal_non_square_seqlens: is_causal with a query shorter than the key.
    ("causal-nonsquare-sm80", call(q=(2, 8, 16, 64), k=(2, 8, 128, 64), causal=True), dev(SM80), EFFICIENT,
     {FLASH: "check_flash_causal_non_square_seqlens"}),
    # The query's last dim not of stride 1 (a transposed view): check_last_dim_stride_equals_1_dense everywhere.
    ("query-strided-sm80", call(q_facts=_t((2, 8, 128, 64), stride=(65536, 8192, 1, 128))), dev(SM80), MATH,
     {FLASH: "check_last_dim_stride_equals_1_dense", EFFICIENT: "check_last_dim_stride_equals_1_dense"}),
    # check_data_ptr_alignment_mem_efficient (sm80+): a value 4 bf16 elements into its storage (a split at a
    # head dim of 4) is not 8-element aligned; with a mask flash is out too.
    ("misaligned-sm80", call(mask=_t((128, 128)), v_facts=_t((2, 8, 128, 64), offset=4)), dev(SM80), MATH,
     {FLASH: "check_for_attn_mask", EFFICIENT: "check_data_ptr_alignment_mem_efficient"}),
    # check_head_dim_size_mem_efficient: head dim 12 is no multiple of 8 in bf16 (4 in fp32 on sm80).
    ("d12-mask-bf16-sm80", call(q=(2, 8, 64, 12), mask=_t((64, 64))), dev(SM80), MATH,
     {FLASH: "check_for_attn_mask", EFFICIENT: "check_head_dim_size_mem_efficient"}),
    ("d12-mask-fp32-sm80", call(q=(2, 8, 64, 12), dtype=FP32, mask=_t((64, 64), FP32)), dev(SM80), EFFICIENT,
     {FLASH: "check_for_attn_mask"}),
    ("d12-bf16-sm80", call(q=(2, 8, 64, 12)), dev(SM80), FLASH, {}),  # flash's head dim is padded to 16
    # check_cudnn_deterministic: torch.use_deterministic_algorithms(True) rules cuDNN out.
    ("deterministic-sm90", call(**DS), dev(SM90, deterministic=True), EFFICIENT,
     {CUDNN: "check_cudnn_deterministic", FLASH: "check_head_dim_size_flash"}),
    # cuDNN refuses a key of length 1 (check_cudnn_tensor_shapes): a decode step falls to flash.
    ("decode-sm90", call(q=(2, 8, 1, 64), k=(2, 8, 1, 64)), dev(SM90), FLASH, {CUDNN: "check_cudnn_tensor_shapes"}),
    # Batch sizes differ: check_batch_size_and_num_heads_dense.
    ("batch-mismatch-sm80", call(k=(1, 8, 128, 64)), dev(SM80), MATH,
     {FLASH: "check_batch_size_and_num_heads_dense", EFFICIENT: "check_batch_size_and_num_heads_dense"}),
    # 3-D inputs: check_tensor_shapes.
    ("3d-sm80", call(q=(8, 128, 64)), dev(SM80), MATH, {FLASH: "check_tensor_shapes", EFFICIENT: "check_tensor_shapes"}),
    # The user's switches: flash disabled (check_runtime_disabled_flash) ...
    ("flash-disabled-sm80", call(), dev(SM80, enabled=frozenset({EFFICIENT, CUDNN, MATH})), EFFICIENT, {}),
    # ... a priority order of their own (sdpa_kernel(..., set_priority=True)) ...
    ("user-order-sm80", call(), dev(SM80, order=(CUDNN, MATH, FLASH, EFFICIENT)), CUDNN, {}),
    # ... TORCH_CUDNN_SDPA_DEPRIORITIZED=1 keeps torch's default order on sm90.
    ("deprioritized-sm90", call(), dev(SM90, cudnn_deprioritized=True), FLASH, {}),
    # A CUDA 12 build prefers cuDNN on sm90/sm100/sm103 only (minor 0 or 3), the CUDA 13 build on every sm9x/sm10x.
    ("cuda12-sm101", call(), dev((10, 1), cuda=12), FLASH, {}),
    ("cuda13-sm101", call(), dev((10, 1)), CUDNN, {}),
    # Only memory-efficient enabled (attention="efficient") with grouped-query attention: torch finds no kernel.
    ("forced-efficient-gqa", call(q=(2, 8, 64, 64), k=(2, 2, 64, 64), gqa=True), dev(SM80, enabled=frozenset({EFFICIENT})),
     None, {EFFICIENT: "check_batch_size_and_num_heads_dense"}),
]


@pytest.mark.parametrize("name, c, d, kernel, ruled_out", CASES, ids=[case[0] for case in CASES])
def test_the_kernel_torch_picks(name, c, d, kernel, ruled_out):
    choice = sdpa.choose(c, d)
    assert choice.backend == kernel
    assert {backend: rule.name for backend, rule in choice.passed_over} == ruled_out


def test_the_priority_order_follows_check_prefer_cudnn_attention():
    default = (FLASH, EFFICIENT, MATH, CUDNN)  # torch._C._get_sdp_priority_order() on a fresh process: [1, 2, 0, 3]
    assert sdpa.priority(dev(SM80)) == default
    assert sdpa.priority(dev(SM90)) == (CUDNN, FLASH, EFFICIENT, MATH)
    assert sdpa.priority(dev(SM90, cudnn=91500)) == default  # "> 91500": 9.15.0 itself is not enough
    assert sdpa.priority(dev(SM90, cudnn=91501)) == (CUDNN, FLASH, EFFICIENT, MATH)
    assert sdpa.priority(dev(SM120)) == default


def test_the_device_reads_torchs_switches_as_this_process_has_them(monkeypatch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    plain = sdpa.device(None)
    assert plain.capability == sdpa.ASSUMED_CAPABILITY and plain.order is None
    assert plain.enabled == {FLASH, EFFICIENT, CUDNN, MATH}
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert sdpa.device(SM90).enabled == {EFFICIENT, MATH}
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert sdpa.device(SM90).order[:2] == (MATH, FLASH)
    assert sdpa.device(SM90, forced=CUDNN).enabled == {CUDNN}
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert sdpa.device(SM90).cudnn_deprioritized
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "yes")  # c10::utils::check_env takes "0" and "1" only
    assert not sdpa.device(SM90).cudnn_deprioritized


def test_the_rules_are_torchs_functions():
    # The constraint functions torch 2.13's libtorch_cuda.so (cu130 wheel) defines in namespace sdp (its symbol
    # table), and the three tests written inline in can_use_* that have no function of their own.
    torch_213 = {
        "check_runtime_disabled_flash", "check_runtime_disabled_mem_efficient", "check_runtime_disabled_cudnn",
        "check_tensor_shapes", "check_for_attn_mask", "check_attn_mask_shape", "check_head_dim_size_flash",
        "check_flash_attention_hardware_support", "check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120",
        "check_flash_causal_non_square_seqlens", "check_dtypes_flash_attention", "check_dtypes_low_precision",
        "check_batch_size_and_num_heads_dense", "check_nonzero_sequence_lengths_dense",
        "check_last_dim_stride_equals_1_dense", "check_mem_efficient_hardware_support",
        "check_head_dim_size_mem_efficient", "check_data_ptr_alignment_mem_efficient", "check_cudnn_deterministic",
        "check_cudnn_hardware_support", "check_cudnn_dropout", "check_cudnn_tensor_shapes"}
    inline = {"check_dtypes_mem_efficient", "check_cudnn_version_dropout", "check_runtime_disabled_math"}
    names = {rule.name for rules in sdpa.RULES.values() for rule in rules}
    assert names <= torch_213 | inline and inline <= names


# The rules the CPU dispatcher shares with the CUDA one (sdp_utils_cpp.h): the CPU's flash needs exactly these,
# with check_batch_size_and_num_heads_dense<true, true> and check_last_dim_stride_equals_1_dense<false>, the
# instances flash and memory-efficient use on CUDA (torch 2.13's select_sdp_backend_cpp, sdp_utils_cpp.cpp).
_SHARED = [r for r in sdpa.RULES[FLASH] if r.name in ("check_tensor_shapes", "check_batch_size_and_num_heads_dense",
                                                      "check_nonzero_sequence_lengths_dense")]
_SHARED += [r for r in sdpa.RULES[EFFICIENT] if r.name == "check_last_dim_stride_equals_1_dense"]
_SHARED += [r for r in sdpa.RULES[CUDNN] if r.name == "check_attn_mask_shape"]

_R = torch.randn
SHARED_CASES = [
    ("plain", _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(2, 4, 8, 16), None, False),
    ("3-d", _R(4, 8, 16), _R(4, 8, 16), _R(4, 8, 16), None, False),
    ("kv-heads-without-gqa", _R(2, 4, 8, 16), _R(2, 2, 8, 16), _R(2, 2, 8, 16), None, False),
    ("kv-heads-with-gqa", _R(2, 4, 8, 16), _R(2, 2, 8, 16), _R(2, 2, 8, 16), None, True),
    ("k-and-v-heads-differ", _R(2, 4, 8, 16), _R(2, 2, 8, 16), _R(2, 4, 8, 16), None, True),
    ("heads-not-dividing", _R(2, 6, 8, 16), _R(2, 4, 8, 16), _R(2, 4, 8, 16), None, True),
    ("batch-differs", _R(2, 4, 8, 16), _R(1, 4, 8, 16), _R(1, 4, 8, 16), None, False),
    ("empty-query", _R(2, 4, 0, 16), _R(2, 4, 8, 16), _R(2, 4, 8, 16), None, False),
    ("empty-key", _R(2, 4, 8, 16), _R(2, 4, 0, 16), _R(2, 4, 0, 16), None, False),
    ("strided-key", _R(2, 4, 8, 16), _R(2, 4, 16, 8).transpose(-1, -2), _R(2, 4, 8, 16), None, False),
    ("mask-2d", _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(8, 8), False),
    ("mask-2d-broadcast", _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(1, 8), False),
    ("mask-3d", _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(2, 8, 8), False),
    ("mask-4d", _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(2, 1, 8, 8), False),
    ("mask-4d-heads", _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(1, 4, 1, 8), False),
    ("mask-4d-wrong-heads", _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(2, 3, 8, 8), False),
    ("mask-wrong-length", _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(8, 4), False),
    ("mask-requires-grad", _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(2, 4, 8, 16), _R(8, 8, requires_grad=True), False),
]


@pytest.mark.parametrize("name, q, k, v, mask, gqa", SHARED_CASES, ids=[case[0] for case in SHARED_CASES])
def test_the_shared_rules_answer_as_torchs_compiled_ones(name, q, k, v, mask, gqa):
    # fp32, no dropout, equal head dims: the CPU's other rules hold, so its choice is flash (1) exactly when the
    # shared ones do, and math (0) otherwise.
    torch_says = torch._fused_sdp_choice(q, k, v, mask, 0.0, False, scale=None, enable_gqa=gqa) == 1
    c = sdpa.Call.of(q, k, v, mask, 0.0, False, gqa)
    assert all(rule.test(c, sdpa.Device()) for rule in _SHARED) == torch_says
    assert torch_says == (name in ("plain", "kv-heads-with-gqa", "mask-2d", "mask-2d-broadcast", "mask-4d",
                                   "mask-4d-heads"))  # the case is the one it says it is


def test_torchs_cuda_checks_cannot_run_on_this_build():
    # Were these True on some input, the CUDA rules could be checked against torch directly, as the shared ones are.
    q = torch.empty(2, 4, 16, 64, dtype=BF16)
    params = torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, False, False)
    if torch.cuda.is_available():
        pytest.skip("a CUDA build: see tests/integration/test_sim_attention_choice.py's GPU check")
    assert not any(check(params, False) for check in (torch.backends.cuda.can_use_flash_attention,
                                                      torch.backends.cuda.can_use_efficient_attention,
                                                      torch.backends.cuda.can_use_cudnn_attention))


def test_a_call_reads_the_shapes_strides_and_grad_the_rules_need():
    q = torch.empty(2, 4, 8, 24, requires_grad=True)
    k, v = torch.empty(2, 4, 8, 40).split([24, 16], dim=-1)
    c = sdpa.Call.of(q, k, v, None, 0.0, True, False)
    assert (c.v.offset, c.v.stride, c.k.shape) == (24, (1280, 320, 40, 1), (2, 4, 8, 24))
    assert c.requires_grad and c.is_causal
    with torch.no_grad():
        assert not sdpa.Call.of(q, k, v, None, 0.0, False, False).requires_grad
    assert dataclasses.replace(c, enable_gqa=True).enable_gqa
