"""``torch._grouped_mm`` on shape-only tensors, as the device kernels run it.

transformers 5 runs mixture-of-experts layers through ``torch._grouped_mm`` by default (its
``"grouped_mm"`` experts implementation, ``transformers/integrations/moe.py``). torch's meta kernel
(``torch/_meta_registrations.py``, ``meta_grouped_mm``) copies the checks of the CUDA fast path: it refuses
any dtype but bf16, and pads the output's rows only on a CUDA build. The kernels that really run accept
more and pad always: the CPU kernel (a loop of ``mm_out`` per group) and CUDA's fallback take float32,
bfloat16 and float16, and both make their output with ``create_grouped_gemm_output_tensor``, whose rows
are padded to 16 bytes on builds other than ROCm (``aten/src/ATen/native/GroupedMMUtils.h``): a 12 x 6
float32 output has strides (8, 1) and a 376-byte storage, not 288. :func:`grouped_mm_output` applies those
checks (``_grouped_mm_validate_inputs`` and the stride checks of the same file) and makes that output; what they
refuse is a :class:`~memprof.simulate.failures.KernelRefusal`, since a run on the device fails the same way.
"""

from __future__ import annotations

import torch

from .failures import KernelRefusal

__all__ = ["grouped_mm_output"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: What the kernels' stride check accepts, said to a user whose model they refuse.
_ALIGN = ("Each matrix's leading stride must be a multiple of 16 bytes (8 bf16 or fp16 elements, 4 float32): sizes "
          "such as the hidden size and the experts' intermediate size a multiple of 8, or, for a transformers model, "
          "its per-expert loop (the config's experts_implementation=\"eager\").")


def _refused(message: str, fix: str = "") -> KernelRefusal:
    """The kernels' refusal, ``message`` as torch words it, named by its op."""
    return KernelRefusal(f"torch._grouped_mm: {message}", fix)


def _check_strides(m: torch.Tensor, name: str) -> None:
    """Row- or column-major with the leading stride a multiple of 16 bytes, as the kernels require."""
    st, sz, end = m.stride(), m.shape, m.dim() - 1
    align = 16 // m.element_size()
    if st[end - 1] == 1 and st[end] >= max(1, sz[end - 1]):
        lead = st[end]
    elif st[end] == 1 and st[end - 1] >= max(1, sz[end]):
        lead = st[end - 1]
    else:
        raise _refused(f"Invalid strides/sizes, got {list(st)} for strides and {list(sz)} for sizes of {name}")
    if lead % align:
        raise _refused(f"strides should be multiple of 16 bytes ({name}'s leading stride is "
                            f"{lead} elements of {m.element_size()} B)", fix=_ALIGN)


def grouped_mm_output(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: "torch.Tensor | None" = None,
                      bias: "torch.Tensor | None" = None, out_dtype: "torch.dtype | None" = None) -> torch.Tensor:
    """The output ``torch._grouped_mm(mat_a, mat_b, offs, bias, out_dtype)`` allocates, on ``mat_a``'s device
    (made by whatever mode is beneath the caller: fake or meta), after the kernel's checks; raises the
    kernel's error where it would (a :class:`~memprof.simulate.failures.KernelRefusal`)."""
    for name, m in (("mat_a", mat_a), ("mat_b", mat_b)):
        if m.dtype not in _DTYPES:
            raise _refused(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {m.dtype}")
        if m.dim() not in (2, 3):
            raise _refused(f"{name} has to be 2 or 3d")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if (not a2 or not b2) and mat_a.size(-1) != mat_b.size(-2):
        raise _refused("contraction dimension of mat_a and mat_b must match")
    _check_strides(mat_a, "mat_a")
    _check_strides(mat_b, "mat_b")
    if (offs is not None) != (a2 or b2):
        raise _refused("Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None and (offs.dim() != 1 or offs.dtype != torch.int32):
        raise _refused("offs has to be 1D int32")
    if bias is not None:
        raise _refused("Bias not supported yet")
    dtype = out_dtype or mat_a.dtype
    if dtype != mat_a.dtype:
        raise _refused("Grouped gemm output dtype must match `mat_a` dtype")
    if a2 and b2:
        assert offs is not None  # checked above: a 2-d matrix comes with offsets
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a2:
        size = [mat_a.size(0), mat_b.size(-1)]
    else:
        size = [mat_a.size(1), mat_b.size(1)] if b2 else [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    align = 16 // dtype.itemsize
    padded = (size[-1] + align - 1) // align * align
    stride = [padded, 1] if a2 != b2 else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)
