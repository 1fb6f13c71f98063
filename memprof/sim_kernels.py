"""Kernels as a CUDA device runs them, for simulations that target CUDA on shape-only tensors.

On meta tensors ``F.scaled_dot_product_attention`` decomposes into its math path, which saves the
s x s attention scores, and ``F.dropout`` into a mask in the input's dtype. A CUDA device picks a fused
attention kernel that saves only its output and a logsumexp, and keeps 1-byte dropout masks. So a
simulation for a CUDA target runs inside :class:`CudaKernels`, a torch function mode that calls the
kernel torch would pick on the device through its own meta kernels (the CPU build of torch carries
them): ``aten._scaled_dot_product_flash_attention``, ``aten._scaled_dot_product_efficient_attention``
and ``aten.native_dropout``, whose autograd formulas save exactly what the device's kernels save.

Which attention kernel, as torch's CUDA dispatcher decides (aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp): flash for fp16/bf16 inputs without an attention mask and a head dimension that is a
multiple of 8 up to 256; memory-efficient for fp16/bf16/fp32 inputs whose head dimension is a multiple
of 8 (4 for fp32), with or without a mask; the math path otherwise. ``attention=`` forces one.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["CudaKernels", "ATTENTION_KERNELS"]

#: What ``estimate(..., attention=)`` accepts.
ATTENTION_KERNELS = ("auto", "flash", "efficient", "math")


def _choose(q: torch.Tensor, attn_mask: Any, wanted: str) -> str:
    if wanted != "auto":
        return wanted
    head_dim = q.shape[-1]
    if q.dim() != 4:
        return "math"
    if q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and head_dim % 8 == 0 and head_dim <= 256:
        return "flash"
    multiple = 4 if q.dtype == torch.float32 else 8
    if q.dtype in (torch.float16, torch.bfloat16, torch.float32) and head_dim % multiple == 0:
        return "efficient"
    return "math"


class CudaKernels(TorchFunctionMode):
    """Route attention and dropout to the kernels a CUDA device runs; :attr:`used` counts the choices."""

    def __init__(self, attention: str = "auto") -> None:
        super().__init__()
        self.attention = attention
        self.used: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: "float | None" = None,
                   enable_gqa: bool = False) -> torch.Tensor:
        kernel = _choose(query, attn_mask, self.attention)
        if kernel != "math" and query.dim() == 4 and key.shape[-3] != query.shape[-3]:
            # Grouped-query attention: the fused kernels are given key and value expanded to the query's
            # heads here (the device's kernel may read them in place: an overestimate of their size).
            groups = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
            self.used["grouped-query attention expanded"] += 1
        if kernel == "flash" and attn_mask is None:
            self.used["flash"] += 1
            out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                                     scale=scale)
            return out[0]
        if kernel in ("efficient", "flash"):
            self.used["memory-efficient"] += 1
            if is_causal and attn_mask is None:
                out = torch.ops.aten._scaled_dot_product_efficient_attention(
                    query, key, value, None, True, dropout_p, True, scale=scale)
            else:
                bias = attn_mask
                if bias is not None and bias.dtype == torch.bool:  # the kernel takes an additive bias
                    bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(
                        ~bias, float("-inf"))
                if bias is not None:
                    bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
                out = torch.ops.aten._scaled_dot_product_efficient_attention(
                    query, key, value, bias, True, dropout_p, is_causal, scale=scale)
            return out[0]
        self.used["math"] += 1
        extra = {"enable_gqa": True} if enable_gqa else {}  # a keyword torch 2.5 added
        # Inside its own handler the mode is off: this runs torch's own (math) path.
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, **extra)

    def _dropout(self, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if not training or p == 0.0:
            return input
        self.used["dropout, 1-byte masks"] += 1
        out, _ = torch.ops.aten.native_dropout(input, p, True)
        return out

    def notes(self) -> list[str]:
        """What the simulation assumed, in words, for the estimate's notes."""
        if not self.used:
            return []
        parts = ", ".join(f"{kind} x{n}" for kind, n in sorted(self.used.items()))
        return [f"kernels assumed for the CUDA target (as torch's CUDA dispatcher picks them; attention="
                f"{self.attention!r}): {parts}"]
