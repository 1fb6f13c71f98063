"""Bytes per parameter by precision regime and optimizer (the "textbook" column).

Every figure is per parameter and comes from the HF Transformers docs, "Model
training anatomy" ("Anatomy of Model's Memory"), from Rajbhandari et al. 2019
(ZeRO), §3.1, or from torch's optimizer and autocast sources (``torch/optim/*.py``,
``aten/src/ATen/autocast_mode.cpp``); derivations and measurements are in
``docs/anatomy.md#bytes-per-parameter``. These are the formulas people quote;
:mod:`memprof.anatomy.optimizers` predicts what a real ``torch.optim`` object holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UnknownNameError

if TYPE_CHECKING:
    from ..record.trace import Trace

__all__ = [
    "BytesPerParam",
    "PRECISIONS",
    "OPTIMIZERS",
    "bytes_per_param",
    "bytes_per_param_breakdown",
    "textbook_regime",
    "infer_precision",
]

# Weights and gradients per regime: (weights, gradients, optimizer-state itemsize, transient weights).
# Derivations: docs/anatomy.md#bytes-per-parameter and #mixed-precision-regimes.
_REGIMES: dict[str, tuple[float, float, int, float]] = {
    # HF docs, "Model training anatomy" ("Anatomy of Model's Memory"): fp32 weights 4, fp32 grads 4; states fp32.
    "fp32": (4.0, 4.0, 4, 0.0),
    # HF docs, "Model training anatomy": mixed precision keeps fp32 weights + a 16-bit copy = 6;
    # "gradients are always kept in fp32" = 4.
    "mixed": (6.0, 4.0, 4, 0.0),
    # torch.autocast keeps fp32 params (4) and fp32 grads (4); the 16-bit weight casts add 2 B/param while cached
    # (aten/src/ATen/autocast_mode.cpp) or saved for backward (peak 18, steady 16; measured with torch 2.13,
    # see docs/anatomy.md#mixed-precision-regimes).
    "amp": (4.0, 4.0, 4, 2.0),
    # Pure bf16: torch AdamW states are zeros_like(p) (torch/optim/adam.py), so bf16 too; measured with
    # torch 2.13, see docs/anatomy.md#mixed-precision-regimes.
    "bf16": (2.0, 2.0, 2, 0.0),
    # Same accounting as bf16: states follow the parameter dtype (zeros_like(p), torch/optim/adam.py); not measured.
    "fp16": (2.0, 2.0, 2, 0.0),
    # Rajbhandari et al. 2019 (ZeRO), §3.1: fp16 params 2 + fp16 grads 2; K holds the fp32 master copy too.
    "zero": (2.0, 2.0, 4, 0.0),
}

#: Precision regimes ``bytes_per_param`` knows.
PRECISIONS: tuple[str, ...] = tuple(_REGIMES)

# The regime the literature quotes for a run configured as the key, where torch holds something else. A run under
# torch.autocast over fp32 parameters is what people call mixed precision, and the figure quoted for it is HF's
# (fp32 weights plus a 16-bit copy; the scheme of Micikevicius et al. 2018, "Mixed Precision Training", which keeps an
# fp32 master copy beside 16-bit weights). torch.autocast keeps no such copy: it casts per op
# (aten/src/ATen/autocast_mode.cpp), so the run itself is "amp".
_QUOTED: dict[str, str] = {"amp": "mixed"}

# Number of full-size state tensors per optimizer, in the state dtype (HF "Model training anatomy" table and
# torch 2.13 torch/optim/*.py; measured figures in docs/anatomy.md#measured-optimizer-state-and-step-transients).
_STATES: dict[str | None, float] = {
    "adamw": 2,  # exp_avg, exp_avg_sq (torch/optim/adam.py; HF anatomy: AdamW 8 B in fp32)
    "adam": 2,  # same states as AdamW (torch/optim/adam.py)
    "sgd": 0,  # plain SGD keeps nothing (torch/optim/sgd.py: momentum_buffer only if momentum != 0; measured 0)
    "sgd_momentum": 1,  # momentum_buffer (torch/optim/sgd.py; HF anatomy: 4 B)
    "adagrad": 1,  # sum (torch/optim/adagrad.py; measured 4.00 B/param in fp32 with torch 2.13)
    "rmsprop": 1,  # square_avg (torch/optim/rmsprop.py; measured 4.00 B/param in fp32 with torch 2.13)
    # factored row/col variances: O(m+n) per m×n matrix, ≈0 per param (torch/optim/_adafactor.py;
    # measured 0.01 B/param with torch 2.13)
    "adafactor": 0,
    "lion": 1,  # one momentum (lion-pytorch measured 4.00 B/param in fp32; bitsandbytes Optimizer1State)
    None: 0,  # no optimizer
}
# 8-bit AdamW holds two uint8 states = 2 B/param whatever the regime (HF "Model training anatomy" table;
# bitsandbytes optim/optimizer.py Optimizer2State); the block absmax (8/blocksize B/param) is ignored here, as HF
# does (docs/anatomy.md#bitsandbytes-8-bit-optimizers).
_ADAMW_8BIT_BYTES = 2.0
# ZeRO's K = 12 for mixed-precision Adam: fp32 master params 4 + momentum 4 + variance 4
# (Rajbhandari et al. 2019 (ZeRO), §3.1).
_ZERO_ADAM_K = 12.0

#: Optimizer names ``bytes_per_param`` knows (``None`` means no optimizer).
OPTIMIZERS: tuple[str | None, ...] = (*_STATES, "adamw_8bit")


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter split by category.

    ``transient_weights`` is memory that exists only part of the step (the
    autocast 16-bit weight copies while cached or saved for backward); it is
    not part of :attr:`total`, which is the steady state.
    """

    weights: float
    gradients: float
    optimizer_states: float
    transient_weights: float = 0.0

    @property
    def total(self) -> float:
        """Steady-state bytes per parameter (weights + gradients + optimizer states)."""
        return self.weights + self.gradients + self.optimizer_states

    @property
    def peak(self) -> float:
        """Bytes per parameter including the transient weight copies."""
        return self.total + self.transient_weights


def _names(values: tuple[str | None, ...]) -> str:
    return ", ".join(repr(v) for v in values)


def bytes_per_param_breakdown(precision: str, optimizer: str | None, *, training: bool = True) -> BytesPerParam:
    """Bytes per parameter for a precision regime and optimizer, split by category.

    ``precision`` is one of :data:`PRECISIONS`: ``"fp32"``, ``"mixed"`` (HF:
    fp32 weights plus a 16-bit copy), ``"amp"`` (``torch.autocast`` over fp32
    parameters), ``"bf16"``/``"fp16"`` (pure 16-bit with torch optimizers, whose
    states take the parameter dtype) and ``"zero"`` (ZeRO's 2 + 2 + K with the
    fp32 master copy in K). Optimizer states scale with the regime's state dtype.
    With ``training=False`` only the weights count (HF: mixed inference = 6).
    Unknown names raise :class:`~memprof.errors.UnknownNameError`.
    """
    if precision not in _REGIMES:
        raise UnknownNameError(f"unknown precision {precision!r}; use one of: {_names(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise UnknownNameError(f"unknown optimizer {optimizer!r}; use one of: {_names(OPTIMIZERS)}")
    weights, grads, state_itemsize, transient = _REGIMES[precision]
    if not training:
        return BytesPerParam(weights=weights, gradients=0.0, optimizer_states=0.0)
    if optimizer == "adamw_8bit":
        states = _ADAMW_8BIT_BYTES
    elif precision == "zero" and optimizer in ("adam", "adamw"):
        states = _ZERO_ADAM_K
    elif precision == "zero":
        # An fp32 master copy (4) beside fp32 states for any optimizer: memprof's extension of the Adam accounting
        # in Rajbhandari et al. 2019 (ZeRO), §3.1 (the paper gives K only for Adam).
        states = 4.0 + _STATES[optimizer] * state_itemsize if optimizer is not None else 0.0
    else:
        states = _STATES[optimizer] * state_itemsize
    return BytesPerParam(weights=weights, gradients=grads, optimizer_states=float(states), transient_weights=transient)


def textbook_regime(precision: str) -> str:
    """The regime whose figure the literature quotes for a run in ``precision``: ``"mixed"`` (HF, 18 B/param with
    AdamW) for ``"amp"`` (torch.autocast over fp32 parameters, 16 B/param of model states), else ``precision``
    itself. Unknown names raise :class:`~memprof.errors.UnknownNameError`."""
    if precision not in _REGIMES:
        raise UnknownNameError(f"unknown precision {precision!r}; use one of: {_names(PRECISIONS)}")
    return _QUOTED.get(precision, precision)


def bytes_per_param(precision: str, optimizer: str | None, *, training: bool = True) -> float:
    """Steady-state bytes per parameter (the total of :func:`bytes_per_param_breakdown`).

    ``bytes_per_param("mixed", "adamw") == 18`` (HF), ``("fp32", "adamw") == 16``,
    ``("zero", "adam") == 16`` (ZeRO), ``("mixed", None, training=False) == 6``.
    """
    return bytes_per_param_breakdown(precision, optimizer, training=training).total


def infer_precision(trace: "Trace") -> str:
    """The precision regime a recorded run used, read from its parameters' dtypes and its autocast dtype:
    ``fp32``, ``amp`` (fp32 parameters under 16-bit autocast), ``bf16``, ``fp16``."""
    dtypes = set(trace.param_dtypes)
    if dtypes <= {"float32"} and trace.autocast_dtype in ("bfloat16", "float16"):
        return "amp"
    if dtypes == {"bfloat16"}:
        return "bf16"
    if dtypes == {"float16"}:
        return "fp16"
    return "fp32"
