"""The optimizer formulas of torch.optim's classes (torch 2.13, ``torch/optim/*.py``) and of
bitsandbytes' 8-bit optimizers (never imported: registered by name), each registered with
:func:`~memprof.anatomy.optimizers.register_optimizer_formula` when this module is imported
(:mod:`memprof.anatomy` imports it).

Each is a pair of functions: the persistent state of a parameter group, and the temporaries its step
allocates, replayed from the foreach function's local variables (:class:`_ListSim`) or bounded for the
for-loop. Derivations: ``docs/anatomy.md#how-torch-optimizers-allocate-state``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
import torch

from .optimizers import OptimizerFormula, OptimizerLike, ParamGroup, register_optimizer_formula

__all__ = ["bitsandbytes_formula", "BNB_BLOCKSIZE", "BNB_MIN_8BIT_SIZE"]

#: ``step`` counters: 0-dim tensors of torch's scalar dtype, fp32 unless the default dtype is fp64
#: (``torch/optim/optimizer.py::_get_scalar_dtype``); fused always fp32. On the CPU unless capturable/fused.
_STEP_DTYPE_FUSED = torch.float32


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _scalar_step_bytes(fused: bool) -> int:
    """Bytes of one 0-dim ``step`` tensor (torch/optim/optimizer.py ``_get_scalar_dtype``)."""
    if fused:
        return torch.empty((), dtype=_STEP_DTYPE_FUSED).element_size()
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------- foreach simulation


class _ListSim:
    """Live-byte bookkeeping for the temporaries a foreach function holds in local variables.

    ``new(var, n)`` allocates ``n`` bytes, then drops the variable's previous
    value (Python assigns after evaluating); ``rebind``/``delete`` drop a value;
    ``alias`` makes two variables hold one value; ``blip`` is an allocation
    freed at once. Values are freed when no variable holds them.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._vars: dict[str, int] = {}
        self._size: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        self._next = 0

    def _drop(self, var: str) -> None:
        vid = self._vars.pop(var, None)
        if vid is None:
            return
        self._refs[vid] -= 1
        if self._refs[vid] == 0:
            self.live -= self._size.pop(vid)
            del self._refs[vid]

    def new(self, var: str, nbytes: int) -> None:
        self._next += 1
        vid = self._next
        self._size[vid] = nbytes
        self._refs[vid] = 1
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._drop(var)
        self._vars[var] = vid

    def rebind(self, var: str) -> None:
        self._drop(var)

    delete = rebind

    def alias(self, dst: str, src: str) -> None:
        vid = self._vars.get(src)
        self._drop(dst)
        if vid is not None:
            self._refs[vid] += 1
            self._vars[dst] = vid

    def blip(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.live + nbytes)


def _device_dtype_groups(params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters split by (device, dtype) in the order torch's foreach functions visit them."""
    grouped = torch.optim.Optimizer._group_tensors_by_device_and_dtype([list(params)])
    # torch types the grouped lists as list[Tensor | None]; the parameters hold no None
    return [list(tensors[0]) for tensors, _ in grouped.values()]  # type: ignore[arg-type]


def _bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(_tensor_bytes(p) for p in params)


def _largest(params: Sequence[torch.Tensor]) -> int:
    return max((_tensor_bytes(p) for p in params), default=0)


# --------------------------------------------------------------------------- torch.optim formulas


def _steps(group: ParamGroup, params: Sequence[torch.Tensor]) -> int:
    return len(params) * _scalar_step_bytes(bool(group.get("fused")))


def _adam_state(opt: OptimizerLike, group: ParamGroup, params: Sequence[torch.Tensor]) -> int:
    # adam.py _init_group: step + exp_avg + exp_avg_sq (+ max_exp_avg_sq if amsgrad), zeros_like(p).
    n_full = 3 if group.get("amsgrad") else 2
    return n_full * _bytes(params) + _steps(group, params)


def _adam_transient(opt: OptimizerLike, group: ParamGroup, params: Sequence[torch.Tensor], impl: str) -> int:
    if impl == "fused":
        return 0  # fused kernels keep no temporaries (AdamW fused measured 0.00 B/param with torch 2.13)
    maximize = bool(group.get("maximize"))
    l2 = group.get("weight_decay", 0) != 0 and not group.get("decoupled_weight_decay", False)
    if impl == "for-loop":
        # Upper bound (measured with torch 2.13, see docs/anatomy.md#measured-optimizer-state-and-step-transients:
        # 8 equal tensors, 3x the largest = sqrt + div + the previous iteration's denom; +1 for the grad copy of
        # maximize or L2 weight decay, measured 4x).
        return (3 + (1 if maximize or l2 else 0)) * _largest(params)
    sim = _ListSim()
    for sub in _device_dtype_groups(params):  # adam.py::_multi_tensor_adam
        c = _bytes(sub)
        sim.rebind("grads")  # device_grads = cast(...) at loop start
        if maximize:
            sim.new("grads", c)  # _foreach_neg
        if l2 and not maximize:
            sim.new("grads", c)  # _foreach_add(grads, params) (reuses the maximize copy otherwise)
        sim.delete("grads")  # "del device_grads" before the sqrt
        sim.new("sqrt", c)  # exp_avg_sq_sqrt = _foreach_sqrt(...); lives until the next group's
    return sim.peak


def _sgd_state(opt: OptimizerLike, group: ParamGroup, params: Sequence[torch.Tensor]) -> int:
    # sgd.py: momentum_buffer = grad.detach().clone() only when momentum != 0; no step counter.
    return _bytes(params) if group.get("momentum", 0) != 0 else 0


def _sgd_transient(opt: OptimizerLike, group: ParamGroup, params: Sequence[torch.Tensor], impl: str) -> int:
    if impl == "fused":
        return 0
    maximize = bool(group.get("maximize"))
    wd = group.get("weight_decay", 0) != 0
    nesterov = bool(group.get("nesterov"))
    if impl == "for-loop":
        # sgd.py::_single_tensor_sgd: -grad, grad.add(param), grad.add(buf) each copy one parameter;
        # upper bound: all three alive at once (measured at most 2x the largest with all three).
        return (int(maximize) + int(wd) + int(nesterov)) * _largest(params)
    sim = _ListSim()
    for sub in _device_dtype_groups(params):  # sgd.py::_multi_tensor_sgd
        c = _bytes(sub)
        sim.rebind("grads")
        if maximize:
            sim.new("grads", c)
        if wd and not maximize:
            sim.new("grads", c)
        # momentum: in place on the buffers; nesterov: in place on device_grads; else device_grads = bufs
        if group.get("momentum", 0) != 0 and not nesterov:
            sim.rebind("grads")
    return sim.peak


def _grad_copy(sim: "_ListSim", nbytes: int, *, maximize: bool, weight_decay: bool) -> None:
    # Adagrad and RMSprop foreach: the grads list is rebound per group; maximize
    # (_foreach_neg) or weight decay (_foreach_add) makes one copy of it.
    sim.rebind("grads")
    if maximize or weight_decay:
        sim.new("grads", nbytes)


def _adagrad_state(opt: OptimizerLike, group: ParamGroup, params: Sequence[torch.Tensor]) -> int:
    # adagrad.py __init__: step + sum = full_like(p) for every parameter, grads or not.
    return _bytes(params) + _steps(group, params)


def _adagrad_transient(opt: OptimizerLike, group: ParamGroup, params: Sequence[torch.Tensor], impl: str) -> int:
    if impl == "fused":
        return 0
    maximize = bool(group.get("maximize"))
    wd = group.get("weight_decay", 0) != 0
    if impl == "for-loop":
        # std of this and the previous iteration, +1 for a grad copy (measured 2x / 3x with equal tensors).
        return (2 + (1 if maximize or wd else 0)) * _largest(params)
    sim = _ListSim()
    for sub in _device_dtype_groups(params):  # adagrad.py::_multi_tensor_adagrad
        c = _bytes(sub)
        _grad_copy(sim, c, maximize=maximize, weight_decay=wd)
        sim.new("std", c)  # _foreach_sqrt(state_sums)
        if wd or maximize:
            sim.alias("numerator", "grads")  # reuses device_grads
        else:
            sim.new("numerator", c)  # _foreach_mul(grads, minus_clr)
    return sim.peak


def _rmsprop_state(opt: OptimizerLike, group: ParamGroup, params: Sequence[torch.Tensor]) -> int:
    # rmsprop.py _init_group: step + square_avg (+ momentum_buffer if momentum > 0) (+ grad_avg if centered).
    n_full = 1 + (1 if group.get("momentum", 0) > 0 else 0) + (1 if group.get("centered") else 0)
    return n_full * _bytes(params) + _steps(group, params)


def _rmsprop_transient(opt: OptimizerLike, group: ParamGroup, params: Sequence[torch.Tensor], impl: str) -> int:
    maximize = bool(group.get("maximize"))
    wd = group.get("weight_decay", 0) != 0
    if impl == "for-loop":
        # avg of this and the previous iteration, +1 for a grad copy (measured 2x / 3x with equal tensors).
        return (2 + (1 if maximize or wd else 0)) * _largest(params)
    sim = _ListSim()
    for sub in _device_dtype_groups(params):  # rmsprop.py::_multi_tensor_rmsprop
        c = _bytes(sub)
        _grad_copy(sim, c, maximize=maximize, weight_decay=wd)
        sim.new("avg", c)  # _foreach_addcmul (centered) or _foreach_sqrt
    return sim.peak


def _adafactor_state(opt: OptimizerLike, group: ParamGroup, params: Sequence[torch.Tensor]) -> int:
    # _adafactor.py _init_group: step (CPU fp32) + for dim > 1: row_var shape[..., -1] = 1 and
    # col_var shape[..., -2, :] = 1 (grad.new_zeros: grad dtype); for 1-D: variance = zeros_like(grad).
    total = 0
    for p in params:
        item = p.element_size()
        if p.dim() > 1:
            n = p.numel()
            rows = n // p.shape[-1] if p.shape[-1] else _prod(p.shape[:-1])
            cols = n // p.shape[-2] if p.shape[-2] else _prod(p.shape[:-2]) * p.shape[-1]
            total += (rows + cols) * item
        else:
            total += _tensor_bytes(p)
        total += _scalar_step_bytes(False)  # torch.tensor(0.0, dtype=_get_scalar_dtype())
    return total


def _prod(shape: Iterable[int]) -> int:
    return math.prod(shape)


def _adafactor_transient(opt: OptimizerLike, group: ParamGroup, params: Sequence[torch.Tensor], impl: str) -> int:
    maximize = bool(group.get("maximize"))
    if impl == "for-loop":
        # _single_tensor_adafactor: var_estimate, its rsqrt/mul products and the previous iteration's update;
        # measured 3x the largest for 1-D parameters, about 2x for matrices; +1 for maximize's -grad.
        return (3 + (1 if maximize else 0)) * _largest(params)
    from torch.optim._adafactor import _group_tensors_by_device_dtype_and_is_multidim

    grouped = _group_tensors_by_device_dtype_and_is_multidim([list(params), list(params)])  # grads share shapes
    sim = _ListSim()
    for (_, _, is_multidim), tensors in grouped.items():  # _adafactor.py::_multi_tensor_adafactor
        sub = [t for t in tensors[0] if t is not None]
        c = _bytes(sub)
        item = sub[0].element_size()
        sim.rebind("grads")
        for _ in sub:
            sim.blip(item)  # p.norm(2).item() for alphas
        if maximize:
            sim.new("grads", c)
        if is_multidim:
            sim.new("row_means", sum(p.numel() // p.shape[-1] for p in sub) * item)
            sim.delete("row_means")
            sim.new("col_means", sum(p.numel() // p.shape[-2] for p in sub) * item)
            sim.delete("col_means")
            sim.new("var_estimates", c)  # row_var @ col_var
            sim.new("row_var_means", sum(p.numel() // (p.shape[-1] * p.shape[-2]) for p in sub) * item)
            sim.delete("row_var_means")
        else:
            sim.new("grads_squared", c)
            sim.delete("grads_squared")
            sim.new("var_estimates", c)  # [v.clone() for v in variances]
        sim.alias("updates", "var_estimates")  # updates = var_estimates
        sim.blip(item)  # update.norm(2).item() per parameter
    return sim.peak


def _register_torch() -> None:
    optim = torch.optim
    src = "torch 2.13 torch/optim/{}.py"
    adam = OptimizerFormula("Adam", src.format("adam"), _adam_state, _adam_transient)
    register_optimizer_formula(optim.Adam, adam)
    # AdamW is Adam with decoupled_weight_decay=True in torch 2.13 (adamw.py subclasses Adam).
    register_optimizer_formula(
        optim.AdamW, OptimizerFormula("AdamW", src.format("adamw"), _adam_state, _adam_transient)
    )
    register_optimizer_formula(optim.SGD, OptimizerFormula("SGD", src.format("sgd"), _sgd_state, _sgd_transient))
    register_optimizer_formula(
        optim.Adagrad,
        OptimizerFormula("Adagrad", src.format("adagrad"), _adagrad_state, _adagrad_transient,
                         state_for_all_params=True),
    )
    register_optimizer_formula(
        optim.RMSprop, OptimizerFormula("RMSprop", src.format("rmsprop"), _rmsprop_state, _rmsprop_transient)
    )
    adafactor = getattr(optim, "Adafactor", None)
    if adafactor is not None:
        register_optimizer_formula(
            adafactor,
            OptimizerFormula(
                "Adafactor",
                src.format("_adafactor"),
                _adafactor_state,
                _adafactor_transient,
                foreach_none="loop",  # _adafactor.py: ``if foreach:`` -- None means the for-loop
                exact_transient=("foreach",),
            ),
        )


# --------------------------------------------------------------------------- bitsandbytes (not imported)

#: bitsandbytes block size for block-wise 8-bit states: 256 in current code (commit 51294d9…), 2048 in older
#: releases (commit 06029dd…) (bitsandbytes ``bitsandbytes/optim/optimizer.py``, ``init_state``).
BNB_BLOCKSIZE = 256
#: Tensors with fewer elements keep fp32 states (bitsandbytes ``optim/optimizer.py``, ``min_8bit_size`` default).
BNB_MIN_8BIT_SIZE = 4096


def bitsandbytes_formula(name: str, n_states: int, *, blocksize: int = BNB_BLOCKSIZE) -> OptimizerFormula:
    """Formula for a bitsandbytes 8-bit optimizer with ``n_states`` states (2: Adam/AdamW, 1: Lion/Momentum).

    Per parameter with ``numel >= min_8bit_size`` (read from ``optimizer.args``
    if present, else 4096): ``n_states`` uint8 tensors of ``numel`` bytes plus
    fp32 ``absmax`` of ``ceil(numel / blocksize)`` elements each; smaller
    parameters keep ``n_states`` fp32 tensors. The shared 256-entry fp32
    quantization maps (``qmap1``/``qmap2``) are counted once per optimizer. The
    step counter is a Python int (no tensor). Step transients: ``None``.
    """

    def state(opt: OptimizerLike, group: ParamGroup, params: Sequence[torch.Tensor]) -> int:
        min_size = getattr(getattr(opt, "args", None), "min_8bit_size", BNB_MIN_8BIT_SIZE)
        total = 0
        for p in params:
            n = p.numel()
            if n >= min_size:
                total += n_states * (n + 4 * math.ceil(n / blocksize))
            else:
                total += n_states * 4 * n  # torch.zeros_like(p, dtype=torch.float32)
        return total

    def shared(opt: OptimizerLike, params: Sequence[torch.Tensor]) -> int:
        min_size = getattr(getattr(opt, "args", None), "min_8bit_size", BNB_MIN_8BIT_SIZE)
        if any(p.numel() >= min_size for p in params):
            # qmap1 ("dynamic") and qmap2 ("udynamic"): 256 fp32 each, shared (bitsandbytes optim/optimizer.py,
            # fill_qmap / init_state; a 1-state optimizer moves only "dynamic" to the device)
            return n_states * 256 * 4
        return 0

    return OptimizerFormula(
        name,
        "bitsandbytes optim/optimizer.py (Optimizer2State/Optimizer1State)",
        state,
        None,
        shared_state_bytes=shared,
        exact_transient=(),
    )


def _register_bitsandbytes() -> None:
    two = ["adam.Adam8bit", "adam.PagedAdam8bit", "adamw.AdamW8bit", "adamw.PagedAdamW8bit"]
    one = ["lion.Lion8bit", "lion.PagedLion8bit"]
    for suffix in two:
        register_optimizer_formula(f"bitsandbytes.optim.{suffix}", bitsandbytes_formula(suffix.split(".")[1], 2))
    for suffix in one:
        register_optimizer_formula(f"bitsandbytes.optim.{suffix}", bitsandbytes_formula(suffix.split(".")[1], 1))


_register_torch()
_register_bitsandbytes()
