"""Kernels as a CUDA device runs them, for simulations that target CUDA on shape-only tensors.

On meta tensors ``F.scaled_dot_product_attention`` decomposes into its math path, which saves the
s x s attention scores, and ``F.dropout`` into a mask in the input's dtype. A CUDA device picks a fused
attention kernel that saves only its output and a logsumexp, and keeps 1-byte dropout masks. So a
simulation for a CUDA target runs inside :class:`CudaKernels`, a torch function mode that calls the
kernel torch would pick on the device through its own meta kernels (the CPU build of torch carries
them): ``aten._scaled_dot_product_flash_attention``, ``aten._scaled_dot_product_efficient_attention``
and ``aten.native_dropout``, whose autograd formulas save exactly what the device's kernels save.

Which attention kernel, as torch's CUDA dispatcher decides (aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp): flash for 4-D fp16/bf16 inputs without an attention mask, a head dimension up to 256
(padded to a multiple of 8, attention.cpp) and a causal mask only on square attention, grouped-query
attention natively; memory-efficient for 4-D fp16/bf16/fp32 inputs, with or without a mask, but not
grouped-query attention; the math path otherwise. ``attention=`` forces one, and is refused where the
device could not run it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from .modes import Next, Rule

__all__ = ["CudaKernels", "ATTENTION_KERNELS", "ValueDependentCode", "VALUE_DEPENDENT_CODE", "CustomOps"]

# torch's own function, whatever ``F.scaled_dot_product_attention`` is bound to: context_parallel() rebinds that name
# to a wrapper that hands DTensors to this one.
_SDPA = getattr(torch._C._nn, "scaled_dot_product_attention", F.scaled_dot_product_attention)

#: What ``estimate(..., attention=)`` accepts.
ATTENTION_KERNELS = ("auto", "flash", "efficient", "math")


def _choose(q: torch.Tensor, k: torch.Tensor, attn_mask: Any, is_causal: bool, gqa: bool, wanted: str) -> str:
    """The kernel torch's CUDA dispatcher picks (sdp_utils.cpp), or the one ``wanted`` forces, after
    checking that the device could run it."""
    from ..errors import InvalidArgumentError

    four_d = q.dim() == 4
    low = q.dtype in (torch.float16, torch.bfloat16)
    square = q.shape[-2] == k.shape[-2]
    # Flash: fp16/bf16, no mask, head dim up to 256 (padded to a multiple of 8), a causal mask only on
    # square attention; grouped-query attention natively.
    flash = four_d and low and attn_mask is None and q.shape[-1] <= 256 and (square or not is_causal)
    # Memory-efficient: fp16/bf16/fp32, masks allowed, no grouped-query attention.
    efficient = four_d and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and not gqa
    if wanted == "auto":
        return "flash" if flash else "efficient" if efficient else "math"
    if wanted == "flash" and not flash or wanted == "efficient" and not efficient:
        raise InvalidArgumentError(
            f"attention={wanted!r}: a CUDA device could not run this attention with that kernel (query "
            f"{tuple(q.shape)} {str(q.dtype).replace('torch.', '')}, "
            f"mask {'given' if attn_mask is not None else 'none'}"
            f"{', grouped-query' if gqa else ''}); torch would raise 'No available kernel'. Use attention='auto'")
    return wanted


class CudaKernels(Rule):
    """Route attention and dropout to the kernels a CUDA device runs; :attr:`used` counts the choices."""

    def __init__(self, attention: str = "auto") -> None:
        super().__init__()
        self.attention = attention
        self.used: Counter[str] = Counter()

    def handle(self, func: Any, args: tuple, kwargs: dict, next: Next) -> Any:
        if func is _SDPA:
            return self._attention(*args, **kwargs)
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        return next(func, args, kwargs)

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: "float | None" = None,
                   enable_gqa: bool = False) -> torch.Tensor:
        extra = {"enable_gqa": True} if enable_gqa else {}  # a keyword torch 2.5 added
        gqa = query.dim() == 4 and key.shape[-3] != query.shape[-3]
        if gqa and not enable_gqa:
            # torch refuses unequal head counts without enable_gqa=True: its own path raises the same.
            return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
        kernel = _choose(query, key, attn_mask, is_causal, gqa, self.attention)
        if kernel == "flash":
            self.used["flash"] += 1
            head = query.shape[-1]
            if scale is None:
                scale = head ** -0.5  # of the head dimension before padding, as torch's dispatcher keeps it
            if head % 8:
                # torch pads the head dimension to a multiple of 8 for flash (attention.cpp, pad_last_dim)
                # and slices the output back: the padded copies are what the kernel saves.
                pad = 8 - head % 8
                query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
                self.used["flash head dim padded to a multiple of 8"] += 1
            out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                                     scale=scale)[0]
            return out[..., :head] if out.shape[-1] != head else out
        if kernel == "efficient":
            self.used["memory-efficient"] += 1
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:  # the kernel takes an additive bias
                bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(~bias, float("-inf"))
            if bias is not None:
                bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, True, dropout_p, is_causal and bias is None, scale=scale)[0]
        self.used["math"] += 1
        # Inside its own handler the mode is off: this runs torch's own (math) path.
        return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     **extra)

    def _dropout(self, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if not training or p == 0.0:
            return input
        if inplace:  # dropout_ on CUDA keeps a mask in the input's dtype, as the shape-only path does
            return F.dropout(input, p, training, inplace)
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


#: Library code that decides what to build from tensor values, which shape-only tensors do not have:
#: transformers' attention-mask helpers skip building a mask when its values make it unnecessary, and
#: build it in full on fake and meta tensors.
VALUE_DEPENDENT_CODE = ("transformers.masking_utils", "transformers.modeling_attn_mask_utils")


_USER, _SKIPPED, _VALUE_DEPENDENT, _MEMPROF = 0, 1, 2, 3


def _kind(frame: Any) -> int:
    """Whether a frame's code is memprof's own, torch's (both skipped by the walk up to the library code above),
    in :data:`VALUE_DEPENDENT_CODE`, or anyone else's."""
    module = frame.f_globals.get("__name__", "")
    if module.startswith("memprof."):
        return _MEMPROF
    if module.startswith("torch."):
        return _SKIPPED
    return _VALUE_DEPENDENT if module.startswith(VALUE_DEPENDENT_CODE) else _USER


def _output_bytes(out: Any) -> int:
    """Bytes of the dense tensors an op returned (one, or a tuple or list of them)."""
    return sum(t.numel() * t.element_size() for t in (out if isinstance(out, (tuple, list)) else (out,))
               if isinstance(t, torch.Tensor) and t.layout == torch.strided)


def _shape_only(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, torch.Tensor) and (t.is_meta or isinstance(t, FakeTensor))


class ValueDependentCode(Rule):
    """Count what code in :data:`VALUE_DEPENDENT_CODE` builds during a simulation: bytes a real run may
    not hold, named in the estimate's notes instead of drifting silently."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.calls = 0
        self.where: set[str] = set()
        self.assumed: set[str] = set()
        self._kinds: dict[Any, int] = {}  # code object -> _USER, _SKIPPED, _VALUE_DEPENDENT or _MEMPROF

    def handle(self, func: Any, args: tuple, kwargs: dict, next: Next) -> Any:
        if func is torch.Tensor.__bool__ and args and _shape_only(args[0]):
            caller = self._user_frame(self.caller())
            module = caller.f_globals.get("__name__", "") if caller is not None else ""
            if caller is not None and self._kinds[caller.f_code] == _VALUE_DEPENDENT:
                # A check of the values (are these sequences packed? is this mask all ones?) that shape-only
                # tensors cannot answer: take the plain case, where the check is true, and say so.
                self.assumed.add(f"{module}.{caller.f_code.co_name}")
                return True
        module = self._value_dependent(self.caller())
        out = next(func, args, kwargs)
        if module is not None:
            self.calls += 1
            self.where.add(module)
            self.bytes += _output_bytes(out)
        return out

    def _kind(self, frame: Any) -> int:
        """A frame's kind (:func:`_kind`), by its code object: it depends on the code alone (the module it was
        defined in), so it is worked out once per code, and a walk is a dictionary lookup per frame rather than a
        string test."""
        kind = self._kinds.get(frame.f_code)
        if kind is None:
            kind = self._kinds[frame.f_code] = _kind(frame)
        return kind

    def _user_frame(self, frame: Any) -> Any:
        """The first frame from ``frame`` up outside memprof's and torch's own code (other modes on the stack call
        in between), or None within 32 frames."""
        kinds = self._kinds
        for _ in range(32):
            if frame is None:
                return None
            kind = kinds.get(frame.f_code)  # self._kind(frame) written out: this loop runs up torch's frames
            if kind is None:
                kind = kinds[frame.f_code] = _kind(frame)
            if kind != _SKIPPED and kind != _MEMPROF:
                return frame
            frame = frame.f_back
        return None

    def _value_dependent(self, caller: Any) -> "str | None":
        """The module of :data:`VALUE_DEPENDENT_CODE` among the first frame outside memprof and torch above
        ``caller`` (the frame that called the torch function) and the three above that (the helpers call torch
        directly, or through a helper of their own), or None."""
        if caller is None or self._kind(caller) == _MEMPROF:
            # memprof's own bookkeeping (a storage looked up, a saved tensor detached) is no library code's doing,
            # whatever runs above it; and it is most of the calls a simulation's rules see.
            return None
        frame = self._user_frame(caller)
        for _ in range(4):
            if frame is None:
                return None
            if self._kind(frame) == _VALUE_DEPENDENT:
                return frame.f_globals.get("__name__", "")
            frame = frame.f_back
        return None

    def notes(self) -> list[str]:
        out = []
        if self.assumed:
            out.append(f"{', '.join(sorted(self.assumed))} checked tensor values a simulation does not have; it was "
                       "taken to find the plain case (unpacked sequences, masks of all ones), which a real run with "
                       "packed sequences or padding would not")
        if not self.bytes:  # views and shape checks only: nothing a real run could skip
            return out
        from ..units import format_bytes

        return out + [f"{', '.join(sorted(self.where))} built {format_bytes(self.bytes)} of tensors in "
                f"{self.calls} op(s) "
                "on shape-only tensors; a real run may skip some of them (it checks the mask's values, which a "
                f"simulation does not have): up to that much of the simulated figures may not exist on the device"]


# Namespaces of torch's own ops, whose meta kernels are torch's statement of what the device allocates (fsdp:
# FSDP2's copy-in and copy-out ops, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py).
_TORCH_NAMESPACES = frozenset({"aten", "prim", "prims", "_c10d_functional", "_c10d_functional_autograd", "c10d",
                               "profiler", "higher_order", "fsdp", "_dtensor"})


class CustomOps(Rule):
    """Count the ops from outside torch (``torch.library`` custom ops, extension kernels) a simulation ran:
    they run through the fake kernel their author registered, which gives the outputs' shapes but not
    whatever workspace the real kernel allocates, so the estimate's notes name them and their bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def handle(self, func: Any, args: tuple, kwargs: dict, next: Next) -> Any:
        out = next(func, args, kwargs)
        if isinstance(func, torch._ops.OpOverload):
            name = func._schema.name
        elif isinstance(func, torch._ops.OpOverloadPacket):
            name = func._qualified_op_name
        else:
            return out
        if name.split("::")[0] not in _TORCH_NAMESPACES:
            self.calls[name] += 1
            self.bytes[name] += _output_bytes(out)
        return out

    def notes(self) -> list[str]:
        if not self.calls:
            return []
        from ..units import format_bytes

        what = "; ".join(f"{n} x{c} ({format_bytes(self.bytes[n])} of outputs)" for n, c in sorted(self.calls.items()))
        return [f"custom ops ran through their registered fake kernels: {what}. Their outputs are counted; "
                "any workspace their real kernels allocate is not"]
