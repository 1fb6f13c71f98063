"""Kernels as a CUDA device runs them, for simulations that target CUDA on shape-only tensors.

On meta tensors ``F.scaled_dot_product_attention`` decomposes into its math path, which saves the
s x s attention scores, and ``F.dropout`` into a mask in the input's dtype. A CUDA device picks a fused
attention kernel that saves only its output and a logsumexp, and keeps 1-byte dropout masks. So a
simulation for a CUDA target runs inside :class:`CudaKernels`, a torch function mode that calls the
kernel torch would pick on the device through its own meta kernels (the CPU build of torch carries
them): ``aten._scaled_dot_product_flash_attention``, ``aten._scaled_dot_product_efficient_attention``,
``aten._scaled_dot_product_cudnn_attention`` and ``aten.native_dropout``, whose autograd formulas save exactly
what the device's kernels save.

Which attention kernel: :mod:`memprof.simulate.sdpa_rules` holds torch's selection rules
(``select_sdp_backend`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``), one named rule per
constraint, evaluated on the call's shapes, strides, dtypes, mask, dropout, ``is_causal`` and ``enable_gqa`` and
the target GPU's compute capability; the kernel is the first eligible in torch's priority order, else math. What
each kernel is handed is what ``scaled_dot_product_attention`` in ``aten/src/ATen/native/transformers/attention.cpp``
hands it (a boolean mask made additive, the memory-efficient kernel's mask expanded and padded, flash's head dim
padded to a multiple of 8). ``attention=`` forces one, as ``sdpa_kernel([backend])`` does, and is refused where
torch would find no kernel.
"""

from __future__ import annotations

from collections import Counter
import types
from typing import TYPE_CHECKING, Callable, NoReturn

import torch
import torch.nn.functional as F

from ..errors import is_interrupt
from . import sdpa_rules as sdpa
from .modes import TORCH_NAMESPACES, Next, Rule

if TYPE_CHECKING:
    from .aliases import OpValue

__all__ = ["CudaKernels", "ATTENTION_KERNELS", "ValueDependentCode", "VALUE_DEPENDENT_CODE", "CustomOps"]

# torch's own function, whatever ``F.scaled_dot_product_attention`` is bound to: context_parallel() rebinds that name
# to a wrapper that hands DTensors to this one.
_SDPA = getattr(torch._C._nn, "scaled_dot_product_attention", F.scaled_dot_product_attention)

#: What ``estimate(..., attention=)`` accepts.
ATTENTION_KERNELS = ("auto", "flash", "efficient", "cudnn", "math")
#: An attention mask (boolean, or a bias added to the scores), or none.
_Mask = torch.Tensor | None
# How the notes name each backend.
_NAMES = {sdpa.FLASH: "flash", sdpa.EFFICIENT: "memory-efficient", sdpa.CUDNN: "cuDNN", sdpa.MATH: "math"}


def _describe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: _Mask, gqa: bool) -> str:
    return (f"query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)} "
            f"{str(q.dtype).replace('torch.', '')}, mask {'given' if mask is not None else 'none'}"
            f"{', grouped-query' if gqa else ''}")


def _additive(mask: _Mask, dtype: torch.dtype) -> _Mask:
    """``convert_boolean_attn_mask`` (attention.cpp): a boolean mask as a bias of ``dtype``, -inf where False."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    bias = torch.zeros_like(mask, dtype=dtype)
    return bias.masked_fill_(mask.logical_not(), float("-inf"))


def _preprocess_mask(bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask`` (attention.cpp): the memory-efficient kernel's bias expanded to 4-D, its last dim padded
    to a multiple of 16 (then sliced back: the padded copy is what the kernel keeps), or made contiguous where its
    strides are not multiples of 16."""
    bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    last = bias.shape[-1]
    if last % 16:
        return F.pad(bias, (0, 16 - last % 16))[..., :last]
    if any(st % 16 for st in bias.stride()[:3]):
        return bias.contiguous()
    return bias


class CudaKernels(Rule):
    """Route attention and dropout to the kernels a CUDA device of compute ``capability`` runs (None: the GPU was
    not named, and :data:`memprof.simulate.sdpa_rules.ASSUMED_CAPABILITY` is taken); :attr:`used` counts the
    choices, :attr:`passed_over` the rules that ruled out a kernel torch tries first."""

    def __init__(self, attention: str = "auto", capability: "tuple[int, int] | None" = None) -> None:
        super().__init__()
        self.attention, self.capability = attention, capability
        self.used: Counter[str] = Counter()
        self.passed_over: Counter[str] = Counter()
        self.orders: set[tuple[str, ...]] = set()

    def handle(self, func: Callable[..., OpValue], args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]",
               next: Next) -> "OpValue":
        if func is _SDPA:
            return self._attention(*args, **kwargs)
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        return next(func, args, kwargs)

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: _Mask = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: "float | None" = None,
                   enable_gqa: bool = False) -> torch.Tensor:
        extra = {"enable_gqa": True} if enable_gqa else {}  # a keyword torch 2.5 added
        if any(t.is_nested for t in (query, key, value)):
            # Nested inputs have rules of their own that memprof does not model: torch's own shape-only path,
            # which keeps the scores, rather than a cheaper kernel the device may not run.
            self.used["math (nested tensors: the fused kernels' rules for them are not modelled)"] += 1
            return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, **extra)
        forced = None if self.attention == "auto" else self.attention
        dev = sdpa.device(self.capability, forced)
        self.orders.add(sdpa.priority(dev))
        choice = sdpa.choose(sdpa.Call.of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa), dev)
        for backend, rule in choice.passed_over:
            if backend != forced:
                self.passed_over[f"{_NAMES[backend]}: {rule.name} ({rule.says})"] += 1
        if choice.backend is None:
            self._refuse(choice, query, key, value, attn_mask, enable_gqa)
        if choice.backend == sdpa.MATH:
            self.used["math"] += 1
            # Inside its own handler the mode is off: this runs torch's own (math) path.
            return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, **extra)
        run = {sdpa.FLASH: self._flash, sdpa.EFFICIENT: self._efficient, sdpa.CUDNN: self._cudnn}[choice.backend]
        try:
            out = run(query, key, value, attn_mask, dropout_p, is_causal, scale)
        except (RuntimeError, NotImplementedError) as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            # Torch's own path on the same arguments tells whose the failure is: where it fails too, the call is
            # one torch refuses on any device (a mask of the wrong shape), and its own error is the one to give.
            _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                  **extra)
            raise self._own_failure(choice.backend, f"{type(exc).__name__}: {exc}",
                                    _describe(query, key, value, attn_mask, enable_gqa)) from exc
        shape = (*query.shape[:-1], value.shape[-1])
        if tuple(out.shape) != shape or out.dtype != query.dtype:
            raise self._own_failure(choice.backend, f"it gave {tuple(out.shape)} {out.dtype} where torch gives "
                                    f"{shape} {query.dtype}", _describe(query, key, value, attn_mask, enable_gqa))
        return out

    def _refuse(self, choice: sdpa.Choice, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: _Mask,
                gqa: bool) -> NoReturn:
        from ..errors import InvalidArgumentError

        why = "; ".join(f"{_NAMES[b]}: {r.name} ({r.says})" for b, r in choice.passed_over) or "every backend disabled"
        what = (f"attention={self.attention!r}: a CUDA device could not run this attention with that kernel"
                if self.attention != "auto" else "no attention kernel torch may use here runs this attention")
        raise InvalidArgumentError(f"{what} ({_describe(q, k, v, mask, gqa)}; {why}); torch would raise 'No "
                                   "available kernel'. Use attention='auto', or enable the math kernel")

    def _own_failure(self, backend: str, what: str, call: str) -> Exception:
        from ..errors import SimulationError

        return SimulationError(
            f"memprof's own rule failed, not the model: memprof.simulate.kernels ran this attention ({call}) as "
            f"torch's {_NAMES[backend]} kernel, and {what}. Please report it; attention='math' goes around it "
            "(an over-estimate: the math kernel keeps the scores)")

    def _flash(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: _Mask, dropout_p: float,
               is_causal: bool, scale: "float | None") -> torch.Tensor:
        self.used["flash"] += 1
        head = query.shape[-1]
        if scale is None:
            scale = head ** -0.5  # of the head dimension before padding, as torch's dispatcher keeps it
        if head % 8:
            # torch pads the head dimension to a multiple of 8 for flash (attention.cpp, pad_last_dim) and slices
            # the output back: the padded copies are what the kernel saves.
            pad = 8 - head % 8
            query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
            self.used["flash head dim padded to a multiple of 8"] += 1
        out: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p,
                                                                               is_causal, False, scale=scale)[0]
        return out[..., :head] if out.shape[-1] != head else out

    def _efficient(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: _Mask,
                   dropout_p: float, is_causal: bool, scale: "float | None") -> torch.Tensor:
        self.used["memory-efficient"] += 1
        bias = _additive(attn_mask, query.dtype)
        if bias is not None:
            bias = _preprocess_mask(bias, query, key)
        out: torch.Tensor = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, _logsumexp(query, key, value), dropout_p, is_causal, scale=scale)[0]
        return out

    def _cudnn(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: _Mask, dropout_p: float,
               is_causal: bool, scale: "float | None") -> torch.Tensor:
        self.used["cuDNN"] += 1
        out: torch.Tensor = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, key, value, _additive(attn_mask, query.dtype), _logsumexp(query, key, value), dropout_p,
            is_causal, False, scale=scale)[0]
        return out

    def _dropout(self, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
                 ) -> torch.Tensor:
        if not training or p == 0.0:
            return input
        if inplace:  # dropout_ on CUDA keeps a mask in the input's dtype, as the shape-only path does
            return F.dropout(input, p, training, inplace)
        self.used["dropout, 1-byte masks"] += 1
        out: torch.Tensor
        out, _ = torch.ops.aten.native_dropout(input, p, True)
        return out

    def notes(self) -> list[str]:
        """What the simulation assumed, in words, for the estimate's notes."""
        if not self.used:
            return []
        parts = ", ".join(f"{kind} x{n}" for kind, n in sorted(self.used.items()))
        out = [f"kernels assumed for the CUDA target (as torch's CUDA dispatcher picks them; attention="
               f"{self.attention!r}): {parts}"]
        if self.passed_over:
            out.append("attention kernels torch tries first, ruled out by its rule (aten/src/ATen/native/transformers/"
                       "cuda/sdp_utils.cpp) named: " + "; ".join(f"{why} x{n}" for why, n in
                                                                  sorted(self.passed_over.items())))
        if not self.orders:
            return out
        if self.capability is None:
            cc = ".".join(map(str, sdpa.ASSUMED_CAPABILITY))
            out.append(f"no GPU named: the attention kernel was chosen as torch chooses it on compute capability {cc} "
                       "(an A100); give gpu= to choose it for yours")
        if any(order[0] == sdpa.CUDNN for order in self.orders) or self.used["cuDNN"]:
            v = sdpa.CUDNN_VERSION
            out.append(f"cuDNN attention is torch's first choice here (runtime cuDNN newer than 9.15.0 on sm9x/"
                       f"sm10x): the target was taken to run torch's default CUDA {sdpa.CUDA_MAJOR} build, whose cuDNN "
                       f"is {v // 10000}.{v // 100 % 100}.{v % 100}; with TORCH_CUDNN_SDPA_DEPRIORITIZED=1, an older "
                       "cuDNN or a CUDA 12 build on other than sm90/sm100/sm103, flash comes first")
        return out


def _logsumexp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``should_compute_logsumexp`` (attention.cpp): the fused kernels keep a logsumexp only for backward."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


#: Library code that decides what to build from tensor values, which shape-only tensors do not have:
#: transformers' attention-mask helpers skip building a mask when its values make it unnecessary, and
#: build it in full on fake and meta tensors.
VALUE_DEPENDENT_CODE = ("transformers.masking_utils", "transformers.modeling_attn_mask_utils")


_USER, _SKIPPED, _VALUE_DEPENDENT, _MEMPROF, _DRIVER = 0, 1, 2, 3, 4

#: memprof's modules that run a simulated step (the estimate, its stages, the step and the loops that call the
#: model, the loss, backward and the optimizer). Below such a frame on the stack is the model's code; above it only
#: the estimate's caller, never library code building a mask: a walk up from a torch function that reaches one
#: (the optimizer's ops, backward's) ends there, as it would have ended anyway with nothing found, but without
#: climbing through the rest of the estimate (half the watcher's time before; every frame it skipped was one of
#: these or torch's). The rules' own frames (modes, kernels, routers, autocast, moe), which sit between a torch
#: composite and the library code that called it, are not among them.
_DRIVERS = ("memprof.simulate.step", "memprof.simulate.stages", "memprof.simulate.estimate",
            "memprof.simulate.loops", "memprof.simulate.user_step", "memprof.simulate.depth", "memprof.report.")


def _kind(frame: types.FrameType) -> int:
    """Whether a frame's code is memprof's own (one that runs the step: a driver), torch's (both skipped by the walk
    up to the library code above), in :data:`VALUE_DEPENDENT_CODE`, or anyone else's."""
    module = frame.f_globals.get("__name__", "")
    if module.startswith("memprof."):
        return _DRIVER if module.startswith(_DRIVERS) else _MEMPROF
    if module.startswith("torch."):
        return _SKIPPED
    return _VALUE_DEPENDENT if module.startswith(VALUE_DEPENDENT_CODE) else _USER


def _output_bytes(out: "OpValue") -> int:
    """Bytes of the dense tensors an op returned (one, or a tuple or list of them)."""
    return sum(t.numel() * t.element_size() for t in (out if isinstance(out, (tuple, list)) else (out,))
               if isinstance(t, torch.Tensor) and t.layout == torch.strided)


def _shape_only(t: object) -> bool:
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
        self._kinds: dict[types.CodeType, int] = {}  # code object -> _USER, _SKIPPED, _VALUE_DEPENDENT, ...

    def handle(self, func: Callable[..., OpValue], args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]",
               next: Next) -> "OpValue":
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

    def _kind(self, frame: types.FrameType) -> int:
        """A frame's kind (:func:`_kind`), by its code object: it depends on the code alone (the module it was
        defined in), so it is worked out once per code, and a walk is a dictionary lookup per frame rather than a
        string test."""
        kind = self._kinds.get(frame.f_code)
        if kind is None:
            kind = self._kinds[frame.f_code] = _kind(frame)
        return kind

    def _user_frame(self, frame: "types.FrameType | None") -> "types.FrameType | None":
        """The first frame from ``frame`` up outside memprof's and torch's own code (other modes on the stack call
        in between), or None within 32 frames or where a frame of memprof's that runs the step comes first
        (:data:`_DRIVERS`)."""
        kinds = self._kinds
        for _ in range(32):
            if frame is None:
                return None
            kind = kinds.get(frame.f_code)  # self._kind(frame) written out: this loop runs up torch's frames
            if kind is None:
                kind = kinds[frame.f_code] = _kind(frame)
            if kind != _SKIPPED and kind != _MEMPROF:
                return frame if kind != _DRIVER else None
            frame = frame.f_back
        return None

    def _value_dependent(self, caller: "types.FrameType | None") -> "str | None":
        """The module of :data:`VALUE_DEPENDENT_CODE` among the first frame outside memprof and torch above
        ``caller`` (the frame that called the torch function) and the three above that (the helpers call torch
        directly, or through a helper of their own), or None."""
        if caller is None or self._kind(caller) >= _MEMPROF:
            # memprof's own bookkeeping (a storage looked up, a saved tensor detached) is no library code's doing,
            # whatever runs above it; and it is most of the calls a simulation's rules see.
            return None
        frame = self._user_frame(caller)
        for _ in range(4):
            if frame is None:
                return None
            if self._kind(frame) == _VALUE_DEPENDENT:
                module: str = frame.f_globals.get("__name__", "")
                return module
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
                "simulation does not have): the simulated figures may be over by up to that much, and where a "
                "phase keeps the mask's attention (its backward, a checkpointed layer's recomputation) by what the "
                "attention keeps of an explicit mask, which a real run's causal kernel does not"]


class CustomOps(Rule):
    """Count the ops from outside torch (``torch.library`` custom ops, extension kernels) a simulation ran:
    they run through the fake kernel their author registered, which gives the outputs' shapes but not
    whatever workspace the real kernel allocates, so the estimate's notes name them and their bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def handle(self, func: Callable[..., OpValue], args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]",
               next: Next) -> "OpValue":
        out = next(func, args, kwargs)
        if isinstance(func, torch._ops.OpOverload):
            name = func._schema.name
        elif isinstance(func, torch._ops.OpOverloadPacket):
            name = func._qualified_op_name
        else:
            return out
        if name.split("::")[0] not in TORCH_NAMESPACES:
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
