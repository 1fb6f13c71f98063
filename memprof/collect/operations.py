"""Operator anatomy: each op classed as Ivanov et al. class them, with flops and bytes moved.

"Data Movement Is All You Need" (Ivanov et al. 2020, arXiv 2007.00072; as
summarised in the HF Transformers docs, "Model training anatomy")
sorts a transformer's operators into tensor contractions (matmuls,
convolutions: most of the flops), statistical normalisations (softmax,
layer norm: a reduction then a map) and element-wise ops (bias, dropout,
activations, residuals: bandwidth-bound). Flops come from torch's own
formulas (``torch.utils.flop_counter``); bytes read and written are the
sizes of the op's tensor arguments and results (views counted at their own
size; an in-place result counts as written).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import is_interrupt

if TYPE_CHECKING:
    from .aliases import Kwargs, Op

__all__ = ["CONTRACTION", "NORMALIZATION", "ELEMENTWISE", "OTHER", "classify", "OperationLog"]

CONTRACTION = "tensor contraction"
NORMALIZATION = "statistical normalization"
ELEMENTWISE = "element-wise"
OTHER = "other"

# Base names (overload packet, with any backward suffix removed) of each class.
_CONTRACTIONS = {
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "einsum", "dot", "mv", "addmv",
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "convolution_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math", "_efficient_attention", "_flash_attention",
    "mkldnn_rnn_layer", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
}
_NORMALIZATIONS = {
    "_softmax", "softmax", "_log_softmax", "log_softmax", "native_layer_norm", "layer_norm", "native_batch_norm",
    "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
    "native_group_norm", "rms_norm", "_fused_rms_norm", "batch_norm", "cudnn_batch_norm", "nll_loss_forward",
    "nll_loss", "nll_loss2d_forward", "_softmax_backward_data", "_log_softmax_backward_data",
}
_SUFFIXES = ("_backward_data", "_backward_input", "_backward_weight", "_backward")

_CLASS_CACHE: "dict[Op, str]" = {}


def classify(func: "Op") -> str:
    """The Ivanov class of an aten op (cached per op)."""
    cls = _CLASS_CACHE.get(func)
    if cls is not None:
        return cls
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    base = name
    for suffix in _SUFFIXES:
        if base.endswith(suffix) and base not in _NORMALIZATIONS and base not in _CONTRACTIONS:
            base = base[: -len(suffix)]
            break
    tags = getattr(func, "tags", ())
    if name in _CONTRACTIONS or base in _CONTRACTIONS:
        cls = CONTRACTION
    elif name in _NORMALIZATIONS or base in _NORMALIZATIONS:
        cls = NORMALIZATION
    elif torch.Tag.pointwise in tags or base.startswith("_foreach_") or base in (
            "gelu", "silu", "relu", "threshold", "native_dropout", "bernoulli", "where", "masked_fill", "clamp",
            "hardtanh", "leaky_relu", "sigmoid", "tanh", "mish", "elu"):
        cls = ELEMENTWISE
    else:
        cls = OTHER
    _CLASS_CACHE[func] = cls
    return cls


def _nbytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        try:
            return obj.numel() * obj.element_size()
        except RuntimeError as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            return 0
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


class OperationLog:
    """Running totals per (phase, class, op): count, flops, bytes read and written."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, str], list[int]] = {}
        try:
            from torch.utils.flop_counter import flop_registry

            self._flops = flop_registry
        except Exception as failure:  # pragma: no cover - flop counter missing in this torch
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            self._flops = {}

    def record(self, phase: str, func: "Op", args: "tuple[object, ...]", kwargs: "Kwargs | None", out: object
               ) -> None:
        cls = classify(func)
        packet = getattr(func, "overloadpacket", func)
        flops = 0
        formula = self._flops.get(packet)
        if formula is not None:
            try:
                flops = int(formula(*args, **(kwargs or {}), out_val=out))
            except Exception as failure:
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                flops = 0
        read = _nbytes(args) + _nbytes(list((kwargs or {}).values()))
        written = _nbytes(out)
        key = (phase, cls, f"aten.{packet.__name__}" if hasattr(packet, "__name__") else str(packet))
        row = self.rows.get(key)
        if row is None:
            self.rows[key] = [1, flops, read, written]
        else:
            row[0] += 1
            row[1] += flops
            row[2] += read
            row[3] += written
