"""CUDA's autocast policy, applied to shape-only tensors for simulations that target CUDA.

``torch.autocast("cuda")`` works through the ``AutocastCUDA`` dispatch key, which only CUDA tensors
carry; meta tensors never reach it, and fake CUDA tensors cannot run autograd on a build without
CUDA. So a simulation of mixed precision for a CUDA target runs its forward inside
:class:`CudaAutocast`, a torch function mode that applies the same policy one level up, op by op,
with the op lists torch 2.13 registers for CUDA (``aten/src/ATen/autocast_mode.h``:
``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
``AT_FORALL_PROMOTE``) and the same weight cache (``aten/src/ATen/autocast_mode.cpp``,
``cached_cast``: 16-bit casts of fp32 leaf tensors that require grad are kept until the
outermost autocast region ends, that is, for one forward).

The casts are ordinary ``Tensor.to`` calls above autograd, as autocast's are, so autograd saves the
16-bit copies exactly as it does on a GPU. ``tests/unit/test_sim_autocast.py`` holds the
emulation to torch's own CUDA autocast, run forward-only on fake CUDA tensors: the same aten ops
with the same dtypes and shapes.

Where it cannot follow: ops that torch implements as C++ compositions are seen whole, so a listed
op inside an unlisted composite is not cast (``cross_entropy`` is decomposed here as torch does;
others are counted in :meth:`CudaAutocast.notes`). Backward runs outside autocast, as on a GPU,
except the recomputation of checkpointed regions, which runs under the policy without the cache.
"""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Callable, TypeGuard

import torch

# The state this rule sets lives beneath the collectors, which read it (memprof.collect.autocast_state).
from ..collect.autocast_state import emulated_autocast_dtype, set_emulated_autocast_dtype
from .modes import Next, Rule

if TYPE_CHECKING:
    from .aliases import OpValue

__all__ = ["CudaAutocast", "AutocastFactory", "emulated_autocast_dtype", "LOWER_PRECISION", "FP32",
           "FP32_SET_OPT_DTYPE", "PROMOTE"]

#: A CPU target's mixed precision: makes the ``torch.autocast("cpu", dtype=...)`` region a step enters around each
#: forward (a fresh one per entry, as ``with torch.autocast(...):`` makes).
AutocastFactory = Callable[[], AbstractContextManager[object]]

# aten/src/ATen/autocast_mode.h (torch 2.13): ops that run in the 16-bit dtype.
LOWER_PRECISION = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
})
# Ops that run in fp32 (their 16-bit inputs are cast up).
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
    "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
})
# Ops given dtype=float32 when their first input is eligible and no dtype is set (softmax and reductions).
FP32_SET_OPT_DTYPE = frozenset({
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum",
})
# Ops whose floating inputs are cast to the widest floating dtype among them.
PROMOTE = frozenset({
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add",
})
# Python spellings of the same ops (operators and reflected operators).
_BACKWARD = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})
_ALIASES = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow"}

def _name(func: Callable[..., OpValue]) -> str:
    name = getattr(func, "__name__", "")
    return _ALIASES.get(name, name)


def _eligible(t: object) -> TypeGuard[torch.Tensor]:
    # autocast_mode.h is_eligible: a defined floating tensor other than float64.
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class CudaAutocast(Rule):
    """Apply CUDA's autocast policy in ``dtype`` to the ops of the forward run inside it.

    Enter it around a training step, and call :meth:`begin_forward` before the forward and
    :meth:`end_forward` once the loss is computed (where a ``with torch.autocast(...)`` block would
    begin and end): the weight cache is dropped there, and the policy then applies only to code
    backward runs in Python (checkpoint recomputation).
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.dtype = dtype
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._caching = False
        self._active = False
        self._backward = False
        self._flag: "tuple[bool, torch.dtype] | None" = None
        self.composites: Counter[str] = Counter()

    def begin_forward(self) -> None:
        self._caching = self._active = True
        set_emulated_autocast_dtype(self.dtype)
        # torch's own CUDA autocast flag, on for the forward (it changes nothing on meta tensors): a region the
        # model runs under torch.autocast("cuda", enabled=False), or torch.amp.custom_fwd, turns it off, and
        # the policy follows it there.
        self._flag = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", self.dtype)

    def end_forward(self) -> None:
        # autocast_mode.cpp clear_cache(): the casts live until the outermost autocast region exits.
        self._cache.clear()
        self._caching = self._active = False
        set_emulated_autocast_dtype(None)
        flag = getattr(self, "_flag", None)
        if flag is not None:
            torch.set_autocast_enabled("cuda", flag[0])
            torch.set_autocast_dtype("cuda", flag[1])
            self._flag = None

    # ------------------------------------------------------------------ the policy

    def handle(self, func: Callable[..., OpValue], args: tuple[OpValue, ...], kwargs: dict[str, OpValue],
               next: Next) -> OpValue:
        if func in _BACKWARD:
            # Backward runs outside autocast, but torch.utils.checkpoint re-enters it to recompute a region
            # (with a cache of its own): the policy applies to what backward runs in Python, uncached.
            active, self._active, self._backward = self._active, True, True
            try:
                return next(func, args, kwargs)
            finally:
                self._active, self._backward = active, False
        if not self._active or not (self._backward or torch.is_autocast_enabled("cuda")):
            # The optimizer step, anything else outside the forward, and regions the model runs without autocast.
            return next(func, args, kwargs)
        name = _name(func)
        if name in LOWER_PRECISION:
            args, kwargs = self._cast_all(args, kwargs, self.dtype)
        elif name in FP32:
            args, kwargs = self._cast_all(args, kwargs, torch.float32)
        elif name in FP32_SET_OPT_DTYPE:
            first = args[0] if args else kwargs.get("input")
            if _eligible(first) and kwargs.get("dtype") is None and not any(isinstance(a, torch.dtype) for a in args):
                if name in ("softmax", "log_softmax") and first.dtype == torch.float16:
                    # On CUDA, fp16 in and fp32 out is one kernel with no fp32 copy of the input
                    # (aten/src/ATen/native/SoftMax.cpp: half_to_float).
                    return _half_to_float(name, first, args, kwargs)
                kwargs = {**kwargs, "dtype": torch.float32}
        elif name in PROMOTE:
            widest = _widest(args, kwargs)
            if widest is not None:
                args, kwargs = self._cast_all(args, kwargs, widest)
        elif name == "cross_entropy_loss":
            return self._cross_entropy(*args, **kwargs)
        elif func is torch.Tensor.norm:
            # A Python method that forwards to torch.norm, which calls the linalg norms autocast lists
            # (torch/_tensor.py, torch/functional.py): follow it, so those calls are seen.
            func = torch.norm
        return next(func, args, kwargs)

    def _cast(self, t: OpValue, dtype: torch.dtype) -> OpValue:
        if isinstance(t, (list, tuple)):
            return type(t)(self._cast(x, dtype) for x in t)
        if not _eligible(t) or t.dtype == dtype:
            return t
        if (self._caching and dtype != torch.float32 and t.dtype == torch.float32 and t.requires_grad
                and t.is_leaf and not t._is_view()):
            hit = self._cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            cast = t.to(dtype)
            self._cache[id(t)] = (t, cast)  # the source too: its id must not be reused while cached
            return cast
        return t.to(dtype)

    def _cast_all(self, args: tuple[OpValue, ...], kwargs: dict[str, OpValue], dtype: torch.dtype
                  ) -> tuple[tuple[OpValue, ...], dict[str, OpValue]]:
        # Last argument first, as torch's build evaluates the casts of a C++ argument pack (GCC: right to
        # left); the order only decides which copy is allocated first.
        new_kwargs = {k: self._cast(kwargs[k], dtype) for k in reversed(kwargs)}
        new_args = tuple(reversed([self._cast(a, dtype) for a in reversed(args)]))
        return new_args, {k: new_kwargs[k] for k in kwargs}

    def _cross_entropy(self, input: torch.Tensor, target: torch.Tensor, weight: "torch.Tensor | None" = None,
                       reduction: int = 1, ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
        # cross_entropy_loss is a C++ composite that autocast does not list; it runs
        # log_softmax(input, class_dim, input.dtype), whose explicit dtype autocast leaves alone, then
        # nll_loss, which autocast runs in fp32 (aten/src/ATen/native/LossNLL.cpp).
        if target.is_floating_point() or label_smoothing > 0.0:
            # Probability targets and label smoothing add reductions of their own: run whole, inputs in fp32.
            self.composites["cross_entropy (probability targets or label smoothing)"] += 1
            # reduction: the at::Reduction int torch.nn.functional passes too; torch's stub says str.
            return torch._C._nn.cross_entropy_loss(self._cast(input, torch.float32), target, weight,
                                                   reduction, ignore_index, label_smoothing)  # type: ignore[arg-type]
        class_dim = 0 if input.dim() == 1 else 1
        logp = torch.log_softmax(input, class_dim, dtype=input.dtype)
        # reduction: the at::Reduction int torch.nn.functional passes too; torch's stub says str.
        return torch._C._nn.nll_loss_nd(self._cast(logp, torch.float32), target,
                                        self._cast(weight, torch.float32), reduction, ignore_index)  # type: ignore[arg-type]

    def notes(self) -> list[str]:
        out = [f"mixed precision on a CUDA target: the forward ran under CUDA's autocast policy in "
               f"{str(self.dtype).replace('torch.', '')} (torch's op lists applied op by op to shape-only tensors)"]
        if self.composites:
            what = ", ".join(f"{n} x{c}" for n, c in sorted(self.composites.items()))
            out.append(f"autocast on CUDA: {what} ran whole in fp32; torch splits it into ops of which only some "
                       "run in fp32, so its casts may differ by one copy of the logits")
        return out


def _half_to_float(name: str, x: torch.Tensor, args: tuple[OpValue, ...], kwargs: dict[str, OpValue]) -> torch.Tensor:
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None:  # F.softmax's implicit dim (deprecated): 0 for 0-, 1- and 3-D inputs, else 1
        dim = 0 if x.dim() in (0, 1, 3) else 1
    op = torch._softmax if name == "softmax" else torch._log_softmax
    return op(x, dim, True)


def _widest(args: tuple[OpValue, ...], kwargs: dict[str, OpValue]) -> "torch.dtype | None":
    dtypes = [t.dtype for t in (*args, *kwargs.values()) if _eligible(t)]
    if not dtypes:
        return None
    return max(dtypes, key=lambda d: torch.finfo(d).bits)
