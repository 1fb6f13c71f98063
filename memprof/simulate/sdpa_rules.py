"""Which kernel torch's CUDA dispatcher runs ``F.scaled_dot_product_attention`` with, one named rule per constraint.

torch 2.13 picks the kernel in ``select_sdp_backend`` (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``):
it walks the backends in priority order and takes the first whose ``can_use_*`` function passes every constraint,
each a function of ``sdp_params`` (query, key, value, mask, dropout, is_causal, enable_gqa) and the device. Each
constraint is one :class:`Rule` here, named after torch's function, in torch's order, so that the first one failing
is the reason torch gives in its debug warnings. The shared ones live in
``aten/src/ATen/native/transformers/sdp_utils_cpp.h`` (shipped with the installed torch under
``torch/include``); the CUDA ones in ``sdp_utils.cpp``. The rule sets and constants were read from that source and
held against torch 2.13's compiled CUDA build (the ``torch-2.13.0`` cu130 wheel's ``libtorch_cuda.so``: its symbols
name every constraint function and template instance each ``can_use_*`` calls, and its code gives the constants),
where the newest source on the main branch has moved on (memory-efficient attention learnt grouped-query attention
after 2.13; cuDNN's head-dim limits changed).

What the target decides (:class:`Device`): its compute capability, the runtime cuDNN and CUDA versions of the torch
build it runs, and the switches torch reads at run time (backends enabled, a priority order set with
``sdpa_kernel(..., set_priority=True)``, deterministic algorithms, ``TORCH_CUDNN_SDPA_DEPRIORITIZED``), read from
this process when the simulation runs, so a ``sdpa_kernel`` context in the model's own code applies as on the device.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, NamedTuple

import torch

__all__ = ["FLASH", "EFFICIENT", "CUDNN", "MATH", "Facts", "Call", "Device", "Rule", "RULES", "Choice", "choose",
           "priority", "device"]

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"
# torch._C._SDPBackend's values, in which torch._C._get_sdp_priority_order() answers (4, overrideable, is no
# CUDA kernel: select_sdp_backend refuses it).
_BACKENDS = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN}
#: torch's default order (at::Context's sdp_priority_order), before select_sdp_backend puts cuDNN first.
DEFAULT_ORDER = (FLASH, EFFICIENT, MATH, CUDNN)

#: The runtime cuDNN of the target when nothing says otherwise: torch 2.13's default wheel (CUDA 13.0) requires
#: ``nvidia-cudnn-cu13==9.20.0.48`` (its METADATA); cuDNN numbers versions major * 10000 + minor * 100 + patch.
CUDNN_VERSION = 92000
#: The major CUDA version of that build (``torch.version.cuda == '13.0'``).
CUDA_MAJOR = 13
#: The compute capability taken for a CUDA target whose GPU was not named: an A100's.
ASSUMED_CAPABILITY = (8, 0)

_HALF = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the rules read of one tensor."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> "Facts":
        local = getattr(t, "_local_tensor", t)  # a DTensor's shard is what the kernel gets
        return cls(tuple(local.shape), tuple(local.stride()), int(local.storage_offset()), local.dtype,
                   bool(t.requires_grad))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of scaled_dot_product_attention, as ``sdp_params`` holds it (``sdp_utils_cpp.h``)."""

    q: Facts
    k: Facts
    v: Facts
    mask: "Facts | None" = None
    dropout: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    #: ``input_requires_grad``: a tensor of q, k, v requires grad and grad mode is on.
    requires_grad: bool = False

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object, dropout: float, is_causal: bool,
           enable_gqa: bool) -> "Call":
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return cls(Facts.of(q), Facts.of(k), Facts.of(v), Facts.of(mask) if isinstance(mask, torch.Tensor) else None,
                   float(dropout), bool(is_causal), bool(enable_gqa), grad)


@dataclasses.dataclass(frozen=True)
class Device:
    """What the target device and its torch build decide."""

    capability: tuple[int, int] = ASSUMED_CAPABILITY
    cudnn: int = CUDNN_VERSION
    cuda: int = CUDA_MAJOR
    enabled: frozenset[str] = frozenset({FLASH, EFFICIENT, CUDNN, MATH})
    #: The order set with sdpa_kernel(..., set_priority=True); None: torch's default, which the device reorders.
    order: "tuple[str, ...] | None" = None
    deterministic: bool = False
    fa3: bool = False
    cudnn_deprioritized: bool = False


def device(capability: "tuple[int, int] | None", forced: "str | None" = None) -> Device:
    """The :class:`Device` for a GPU of ``capability`` (None: :data:`ASSUMED_CAPABILITY`), with the switches torch
    reads at run time as this process has them; ``forced`` enables that backend alone, as
    ``sdpa_kernel([backend])`` does."""
    cuda = torch.backends.cuda  # its switches (flash_sdp_enabled() ...) are untyped in torch's source
    enabled = {b for b, on in ((FLASH, cuda.flash_sdp_enabled()),  # type: ignore[no-untyped-call]
                               (EFFICIENT, cuda.mem_efficient_sdp_enabled()),  # type: ignore[no-untyped-call]
                               (CUDNN, cuda.cudnn_sdp_enabled()),  # type: ignore[no-untyped-call]
                               (MATH, cuda.math_sdp_enabled())) if on}  # type: ignore[no-untyped-call]
    order = tuple(_BACKENDS[i] for i in torch._C._get_sdp_priority_order() if i in _BACKENDS)
    return Device(
        capability=capability or ASSUMED_CAPABILITY,
        enabled=frozenset({forced} if forced is not None else enabled),
        order=None if order == DEFAULT_ORDER else order,
        deterministic=torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled(),
        fa3=bool(getattr(torch._C, "_get_fa3_sdp_enabled", lambda: False)()),
        # c10::utils::check_env: "1" is true, "0" false, anything else ignored.
        cudnn_deprioritized=os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") == "1")


def _sm(d: Device, low: tuple[int, int], high: tuple[int, int]) -> bool:
    """``check_sm_version<low, high>``: the capability within [low, high], both included."""
    return low <= d.capability <= high


class Rule(NamedTuple):
    """One constraint: torch's function name, what it asks in words, and its test."""

    name: str
    says: str
    test: Callable[[Call, Device], bool]


# Constraints of sdp_utils_cpp.h, shared by the backends.

def check_tensor_shapes(c: Call, d: Device) -> bool:
    return len(c.q.shape) == len(c.k.shape) == len(c.v.shape) == 4


def check_for_attn_mask(c: Call, d: Device) -> bool:
    return c.mask is None


def check_attn_mask_shape(c: Call, d: Device) -> bool:
    m = c.mask
    if m is None:
        return True
    if m.requires_grad or len(m.shape) < 2:
        return False

    def fits(mask_dim: int, dim: int) -> bool:  # equal, or 1 (broadcast)
        return mask_dim == dim or mask_dim == 1

    if not (fits(m.shape[-2], c.q.shape[2]) and fits(m.shape[-1], c.k.shape[2])):
        return False
    if len(m.shape) == 2:
        return True
    return len(m.shape) == 4 and fits(m.shape[0], c.q.shape[0]) and fits(m.shape[1], c.q.shape[1])


def check_nonzero_sequence_lengths_dense(c: Call, d: Device) -> bool:
    return c.q.shape[-2] != 0 and c.k.shape[-2] != 0


def _last_dim_stride(ignore_singleton: bool) -> Callable[[Call, Device], bool]:
    def check_last_dim_stride_equals_1_dense(c: Call, d: Device) -> bool:
        ok = c.q.stride[-1] == 1 and c.k.stride[-1] == 1 and c.v.stride[-1] == 1
        ok = ok or (ignore_singleton and c.q.shape[-1] == 1)  # pytorch/pytorch#116333: the query's size alone
        # The mask's last stride counts on a GPU (not on the CPU).
        return ok and (c.mask is None or c.mask.stride[-1] == 1)
    return check_last_dim_stride_equals_1_dense


def _batch_and_heads(supports_gqa: bool, same_kv_heads: bool) -> Callable[[Call, Device], bool]:
    def check_batch_size_and_num_heads_dense(c: Call, d: Device) -> bool:
        if not c.q.shape[0] == c.k.shape[0] == c.v.shape[0]:
            return False
        qh, kh, vh = c.q.shape[-3], c.k.shape[-3], c.v.shape[-3]
        if c.enable_gqa and supports_gqa:  # check_grouped_query_attention<same_kv_heads>
            if same_kv_heads and kh != vh or not kh or not vh:
                return False
            return qh % kh == 0 and (same_kv_heads or qh % vh == 0)
        return qh == kh == vh
    return check_batch_size_and_num_heads_dense


def _enabled(backend: str, name: str) -> Callable[[Call, Device], bool]:
    def check_runtime_disabled(c: Call, d: Device) -> bool:
        return backend in d.enabled
    check_runtime_disabled.__name__ = name
    return check_runtime_disabled


def _dtypes(c: Call, allowed: tuple[torch.dtype, ...]) -> bool:
    """``check_tensor_dtype``: q, k and v of one dtype, among ``allowed``."""
    return c.q.dtype == c.k.dtype == c.v.dtype and c.q.dtype in allowed


def check_dtypes_low_precision(c: Call, d: Device) -> bool:
    return _dtypes(c, _HALF if d.capability[0] >= 8 else (torch.float16,))


# Flash attention (can_use_flash_attention).

def check_head_dim_size_flash(c: Call, d: Device) -> bool:
    return c.q.shape[-1] == c.k.shape[-1] == c.v.shape[-1] and c.q.shape[-1] <= 256


def check_flash_attention_hardware_support(c: Call, d: Device) -> bool:
    return _sm(d, (8, 0), (12, 1))


def check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120(c: Call, d: Device) -> bool:
    # Flash's backward on these parts has no kernel for head dims in (192, 224], nor in (224, 256] with dropout.
    if not (c.requires_grad and (_sm(d, (8, 6), (8, 9)) or _sm(d, (12, 0), (12, 1)))):
        return True
    head = c.q.shape[-1]
    return head <= 192 or (c.dropout <= 0.0 and head > 224)


def check_flash_causal_non_square_seqlens(c: Call, d: Device) -> bool:
    return not c.is_causal or c.q.shape[-2] == c.k.shape[-2]


def check_dtypes_flash_attention(c: Call, d: Device) -> bool:
    if d.capability[0] >= 9 and d.fa3:
        return _dtypes(c, (torch.float8_e4m3fn, *_HALF))
    return check_dtypes_low_precision(c, d)


# Memory-efficient attention (can_use_mem_efficient_attention).

def check_mem_efficient_hardware_support(c: Call, d: Device) -> bool:
    return _sm(d, (5, 0), (12, 1))


def _gemm_alignment(c: Call, d: Device) -> int:
    """``minimum_gemm_alignment``: elements a head dim must be a multiple of."""
    half, major = c.q.dtype in _HALF, d.capability[0]
    tensor_cores = major >= 8 or (major >= 7 and half)  # use_tensor_cores
    return max(4 if major >= 8 else 1, (128 // (16 if half else 32)) if tensor_cores else 1)


def check_head_dim_size_mem_efficient(c: Call, d: Device) -> bool:
    n, qd, vd = _gemm_alignment(c, d), c.q.shape[-1], c.v.shape[-1]
    return qd == c.k.shape[-1] and qd > 0 and qd % n == 0 and vd > 0 and vd % n == 0


def check_data_ptr_alignment_mem_efficient(c: Call, d: Device) -> bool:
    # The caching allocator's blocks start at least 256-byte aligned (torch's comment there), so a tensor's
    # alignment is its storage offset's.
    if d.capability[0] < 8:
        return True
    n = _gemm_alignment(c, d)
    return all(t.numel == 0 or t.offset % n == 0 for t in (c.q, c.k, c.v))


def check_dtypes_mem_efficient(c: Call, d: Device) -> bool:
    # The dtype lists at the end of can_use_mem_efficient_attention.
    return _dtypes(c, (torch.float16, torch.float32, torch.bfloat16) if d.capability[0] >= 8
                   else (torch.float16, torch.float32))


# cuDNN attention (can_use_cudnn_attention).

def check_cudnn_version_dropout(c: Call, d: Device) -> bool:
    # can_use_cudnn_attention's first test: no dropout with cuDNN 9.11 to 9.13.
    return not (c.dropout > 0.0 and 91100 < d.cudnn < 91400)


def check_cudnn_deterministic(c: Call, d: Device) -> bool:
    return not d.deterministic


def check_cudnn_hardware_support(c: Call, d: Device) -> bool:
    return _sm(d, (8, 0), (12, 1))


def check_cudnn_dropout(c: Call, d: Device) -> bool:
    return float(c.dropout * 16.0).is_integer()  # cuDNN's dropout resolution is 1/16


def check_cudnn_tensor_shapes(c: Call, d: Device) -> bool:
    (b, h, s_q, d_qk), s_k, d_v, v = c.q.shape, c.k.shape[2], c.v.shape[3], d.cudnn
    if b > 65535 or h > 65535 or v < 8903 or (v < 8906 and c.dropout != 0.0):
        return False
    limit = 128
    if v >= 91000 and d.capability == (9, 0):
        limit = 256  # Hopper: head dims up to 256 from cuDNN 9.10
    if v >= 91100 and d.capability[0] == 10 and d_qk == 192 and d_v == 128:
        limit = 192  # Blackwell: DeepSeek's (192, 128) from cuDNN 9.11
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8 or (v < 8906 and s_k % 64):
        return False
    if v < 90000 and (s_q < 64 or c.dropout != 0.0 and (s_q % 64 or s_k % 64)):
        return False
    return s_k != 1 and not (c.dropout != 0.0 and s_q == 1)


def _rules(*pairs: "tuple[Callable[[Call, Device], bool], str]") -> tuple[Rule, ...]:
    return tuple(Rule(f.__name__, says, f) for f, says in pairs)


#: Each backend's constraints in the order its can_use_* function tests them (general constraints, then the dense
#: ones); math has none but being enabled.
RULES: dict[str, tuple[Rule, ...]] = {
    FLASH: _rules(
        (_enabled(FLASH, "check_runtime_disabled_flash"), "flash attention enabled"),
        (check_tensor_shapes, "query, key and value 4-D"),
        (check_for_attn_mask, "no attn_mask"),
        (check_head_dim_size_flash, "query, key and value of one head dim, at most 256"),
        (check_flash_attention_hardware_support, "compute capability sm80 to sm121"),
        (check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120,
         "on sm86-89 and sm120-121 with grad, head dim at most 192, or above 224 without dropout"),
        (check_flash_causal_non_square_seqlens, "is_causal only with equal query and key lengths"),
        (check_dtypes_flash_attention, "fp16 or bf16 (sm80+; fp16 below)"),
        (_batch_and_heads(True, True), "one batch size; one head count, or grouped-query with enable_gqa"),
        (check_nonzero_sequence_lengths_dense, "no zero-length sequence"),
        (_last_dim_stride(True), "last dims of stride 1")),
    EFFICIENT: _rules(
        (_enabled(EFFICIENT, "check_runtime_disabled_mem_efficient"), "memory-efficient attention enabled"),
        (check_mem_efficient_hardware_support, "compute capability sm50 to sm121"),
        (check_tensor_shapes, "query, key and value 4-D"),
        (check_head_dim_size_mem_efficient, "query and key of one head dim; head dims multiples of the GEMM "
                                            "alignment (8 in fp16/bf16, 4 in fp32 on sm80+)"),
        (check_data_ptr_alignment_mem_efficient, "storage offsets aligned to the GEMM alignment (sm80+)"),
        (check_nonzero_sequence_lengths_dense, "no zero-length sequence"),
        (_last_dim_stride(False), "last dims (and the mask's) of stride 1"),
        (_batch_and_heads(False, True), "one batch size and one head count (no grouped-query attention)"),
        (check_dtypes_mem_efficient, "fp16, fp32 or bf16 (bf16 on sm80+)")),
    CUDNN: _rules(
        (check_cudnn_version_dropout, "no dropout with cuDNN 9.11 to 9.13"),
        (_enabled(CUDNN, "check_runtime_disabled_cudnn"), "cuDNN attention enabled"),
        (check_tensor_shapes, "query, key and value 4-D"),
        (check_cudnn_deterministic, "deterministic algorithms off (or warn-only)"),
        (check_dtypes_low_precision, "fp16 or bf16 (sm80+; fp16 below)"),
        (check_attn_mask_shape, "a mask of 2 or 4 dims broadcastable to the scores, not requiring grad"),
        (check_cudnn_hardware_support, "compute capability sm80 to sm121"),
        (check_cudnn_dropout, "dropout a multiple of 1/16"),
        (check_nonzero_sequence_lengths_dense, "no zero-length sequence"),
        (_last_dim_stride(True), "last dims (and the mask's) of stride 1"),
        (_batch_and_heads(True, False), "one batch size; one head count, or grouped-query with enable_gqa"),
        (check_cudnn_tensor_shapes, "batch and heads at most 65535; head dims multiples of 8, at most 128 "
                                    "(256 on sm90, 192/128 on sm10x); key length not 1")),
    MATH: _rules((_enabled(MATH, "check_runtime_disabled_math"), "math enabled")),
}


def priority(d: Device) -> tuple[str, ...]:
    """The order ``select_sdp_backend`` tries: the one set with sdpa_kernel(set_priority=True), else torch's
    default, with cuDNN first where ``check_prefer_cudnn_attention`` holds: cuDNN newer than 9.15.0 on sm9x or
    sm10x (CUDA 12 builds: sm90, sm100 and sm103 only), unless TORCH_CUDNN_SDPA_DEPRIORITIZED=1."""
    if d.order is not None:
        return d.order
    major, minor = d.capability
    prefer = (not d.cudnn_deprioritized and d.cudnn > 91500 and major in (9, 10)
              and (d.cuda >= 13 or minor in (0, 3)))
    return (CUDNN, FLASH, EFFICIENT, MATH) if prefer else DEFAULT_ORDER


class Choice(NamedTuple):
    """The backend torch runs (None: none is eligible, and torch raises 'No available kernel'), and the first
    failing rule of each backend tried before it."""

    backend: "str | None"
    passed_over: tuple[tuple[str, Rule], ...]


def failing(backend: str, c: Call, d: Device) -> "Rule | None":
    """The first rule of ``backend`` the call fails on this device, or None."""
    for rule in RULES[backend]:
        if not rule.test(c, d):
            return rule
    return None


def choose(c: Call, d: Device) -> Choice:
    """``select_sdp_backend``: the first backend in :func:`priority` order whose rules all pass."""
    passed: list[tuple[str, Rule]] = []
    for backend in priority(d):
        rule = failing(backend, c, d)
        if rule is None:
            return Choice(backend, tuple(passed))
        if backend in d.enabled:  # a disabled backend was not a candidate: no reason worth giving
            passed.append((backend, rule))
    return Choice(None, tuple(passed))
