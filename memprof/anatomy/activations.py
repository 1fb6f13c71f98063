"""Saved-activation formulas: transformer closed forms and per-module rules.

Closed forms follow Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models" (arXiv 2205.05198), §4, §4.1 (Eq. 1) and Table 2,
generalised term by term so the variants compose (dropout on or off, eager or
flash attention, element size, GELU or SwiGLU, GQA, tensor and sequence
parallelism, recomputation); the derivations are in
``docs/anatomy.md#korthikanti-per-layer-terms`` and
``docs/anatomy.md#variants-memprof-uses``.

Per-module rules give the bytes autograd saves for backward that are not
parameters or buffers, from the saved fields of the autograd nodes
(``torch._C._functions`` in torch 2.13) and per-op measurements with torch 2.13
(CPU), see ``docs/anatomy.md#per-module-saved-tensors``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

import torch
from torch import nn

from ..errors import InvalidArgumentError, RegistryError, UnknownNameError
from ..units import as_count, round_half_away
from .shapes import LayerShape, Parallelism

__all__ = [
    "MASK_BYTES",
    "LOGSUMEXP_BYTES",
    "LayerShape",
    "Parallelism",
    "TensorMeta",
    "ModuleLike",
    "RuleOutput",
    "SavedRule",
    "transformer_layer_terms",
    "transformer_layer_activations",
    "transformer_activations_total",
    "register_saved_rule",
    "saved_bytes_rule",
    "module_saved_bytes",
    "rule_for_classes",
    "cross_entropy_saved_bytes",
]

#: Dropout masks are 1 byte per element (bool) on the CUDA path (Korthikanti et al. 2022, §4;
#: ``native_dropout`` in aten/src/ATen/native/Dropout.cpp).
MASK_BYTES = 1
#: Flash / fused attention saves a logsumexp in fp32 (the logsumexp field of torch's ScaledDotProductFlashAttention /
#: EfficientAttention autograd nodes; docs/anatomy.md#variants-memprof-uses).
LOGSUMEXP_BYTES = 4
# Options of transformer_layer_terms: attention and MLP variants (derived in docs/anatomy.md#variants-memprof-uses)
# and the recomputation rows of Korthikanti et al. 2022, Table 2.
_ATTENTION = ("eager", "flash")
_MLP = ("gelu", "swiglu")
_RECOMPUTE = (None, "selective", "full")
_ONE = Parallelism()  # no parallelism: the defaults of the closed forms


def _check_int(name: str, value: object, minimum: int = 1) -> int:
    # Whole-number floats are counts too (seq_len=2048.0 from a config).
    return as_count(name, value, minimum)


def transformer_layer_terms(
    shape: LayerShape,
    *,
    dropout: bool = True,
    attention: str = "eager",
    bytes_per_element: int = 2,
    mlp: str = "gelu",
    recompute: str | None = None,
    parallel: Parallelism = _ONE,
) -> dict[str, Fraction]:
    """The per-layer saved bytes term by term (exact ``Fraction`` s); see :func:`transformer_layer_activations`.

    With ``e = bytes_per_element``, masks 1 B, ``g = kv_heads/heads``, ``F = ffn_hidden``
    (default 4h), ``t = parallel.tp`` (Korthikanti et al. 2022, §4.1 and Table 2; the
    variants are derived in ``docs/anatomy.md#variants-memprof-uses``):

    ========================  ================  ==========================================
    term                      bytes             sharded by t
    ========================  ================  ==========================================
    layernorm_inputs          2·e·sbh           only with sequence parallelism
    qkv_input                 e·sbh             only with sequence parallelism
    query_key                 e·sbh(1+g)        yes (Q and K inputs of QKᵀ)
    value                     e·sbh·g           yes
    softmax_output            e·as²b            yes (eager only)
    softmax_dropout_mask      as²b              yes (eager, dropout)
    softmax_dropout_output    e·as²b            yes (eager, dropout)
    logsumexp                 4·asb             yes (flash only, fp32)
    out_proj_input            e·sbh             yes (for flash: the attention output)
    attention_dropout_mask    sbh               only with sequence parallelism (dropout)
    mlp_input                 e·sbh             only with sequence parallelism
    mlp_hidden                2·e·sbF, 4·e·sbF  yes (GELU: fc2 input + GELU input; SwiGLU:
                                                gate, up, silu(gate), product)
    mlp_dropout_mask          sbh               only with sequence parallelism (dropout)
    ========================  ================  ==========================================

    ``recompute="selective"`` drops the s² attention terms; ``"full"`` keeps only
    the layer input ``e·sbh`` (Table 2, "Full recompute 2sbh").
    """
    s, b, h, a = (_check_int(name, getattr(shape, name)) for name in ("seq_len", "batch", "hidden", "heads"))
    e = _check_int("bytes_per_element", bytes_per_element)
    tensor_parallel = _check_int("tp", parallel.tp)
    if attention not in _ATTENTION:
        raise UnknownNameError(f"unknown attention {attention!r}; use one of: {', '.join(_ATTENTION)}")
    if mlp not in _MLP:
        raise UnknownNameError(f"unknown mlp {mlp!r}; use one of: {', '.join(_MLP)}")
    if recompute not in _RECOMPUTE:
        raise UnknownNameError(f"unknown recompute {recompute!r}; use one of: None, 'selective', 'full'")
    sbh = Fraction(s * b * h)
    t = Fraction(tensor_parallel)
    sp = t if parallel.sequence_parallel else Fraction(1)
    if recompute == "full":
        return {"layer_input": e * sbh}
    f = Fraction(4 * h if shape.ffn_hidden is None else shape.ffn_hidden)
    g = Fraction(1) if shape.kv_heads is None else Fraction(shape.kv_heads, a)
    as2b = Fraction(a * s * s * b)
    terms: dict[str, Fraction] = {
        "layernorm_inputs": 2 * e * sbh / sp,
        "qkv_input": e * sbh / sp,
        "query_key": e * sbh * (1 + g) / t,
        "value": e * sbh * g / t,
    }
    if attention == "eager" and recompute != "selective":
        terms["softmax_output"] = e * as2b / t
        if dropout:
            terms["softmax_dropout_mask"] = MASK_BYTES * as2b / t
            terms["softmax_dropout_output"] = e * as2b / t
    if attention == "flash":
        terms["logsumexp"] = LOGSUMEXP_BYTES * Fraction(a * s * b) / t
    terms["out_proj_input"] = e * sbh / t
    if dropout:
        terms["attention_dropout_mask"] = MASK_BYTES * sbh / sp
    terms["mlp_input"] = e * sbh / sp
    sbf = Fraction(s * b) * f
    terms["mlp_hidden"] = (2 if mlp == "gelu" else 4) * e * sbf / t
    if dropout:
        terms["mlp_dropout_mask"] = MASK_BYTES * sbh / sp
    return terms


def transformer_layer_activations(
    shape: LayerShape,
    *,
    dropout: bool = True,
    attention: str = "eager",
    bytes_per_element: int = 2,
    mlp: str = "gelu",
    recompute: str | None = None,
    parallel: Parallelism = _ONE,
) -> int:
    """Bytes saved for backward by one transformer layer (Korthikanti Eq. 1 and its variants).

    Defaults give ``sbh(34 + 5as/h)``. ``dropout=False``: ``sbh(32 + 2as/h)``;
    ``attention="flash"``: ``34sbh + 4asb`` (``32sbh`` without dropout); fp32
    (``bytes_per_element=4``): ``sbh(66 + 9as/h)``; ``mlp="swiglu"`` with the
    shape's ``ffn_hidden``; its ``kv_heads`` for GQA; Table 2 rows through the
    ``parallel`` degrees (``tp``, ``sequence_parallel``) and ``recompute``. LayerNorm
    statistics (2sb per LN) are ignored, as in the paper. Rounded half up to
    whole bytes at the end only.
    """
    terms = transformer_layer_terms(shape, dropout=dropout, attention=attention, bytes_per_element=bytes_per_element,
                                    mlp=mlp, recompute=recompute, parallel=parallel)
    return round_half_away(sum(terms.values(), Fraction(0)))


def transformer_activations_total(
    shape: LayerShape,
    num_layers: int,
    *,
    dropout: bool = True,
    attention: str = "eager",
    bytes_per_element: int = 2,
    mlp: str = "gelu",
    recompute: str | None = None,
    parallel: Parallelism = _ONE,
    interleave_stages: int | None = None,
    vocab_size: int | None = None,
    outside_layers: bool = False,
) -> int:
    """Activation bytes on the first pipeline stage (Korthikanti Eq. 5 and §4.3).

    The first stage of ``p = parallel.pp`` holds ``p`` micro-batches of ``L/p``
    layers, i.e. ``L`` layers' worth: ``L × per-layer``. ``interleave_stages=m``
    multiplies by ``1 + (p-1)/(p·m)``. ``outside_layers=True`` adds the embedding
    dropout mask ``sbhp/t`` and, with ``p == 1``, the final LN input ``2sbh/t``, the
    output layer input ``2sbh/t`` and fp32 logits ``4sbv/t`` (needs ``vocab_size``).
    The layer's keywords are :func:`transformer_layer_terms`'.
    """
    num_layers = _check_int("num_layers", num_layers)
    p = _check_int("pp", parallel.pp)
    terms = transformer_layer_terms(shape, dropout=dropout, attention=attention, bytes_per_element=bytes_per_element,
                                    mlp=mlp, recompute=recompute, parallel=parallel)
    total = num_layers * sum(terms.values(), Fraction(0))
    if interleave_stages is not None:
        interleave_stages = _check_int("interleave_stages", interleave_stages)
        total *= 1 + Fraction(p - 1, p * interleave_stages)
    if outside_layers:
        t = Fraction(parallel.tp)
        sbh = Fraction(shape.seq_len * shape.batch * shape.hidden)
        total += MASK_BYTES * sbh * p / t  # embedding dropout masks of p micro-batches
        if p == 1:
            if vocab_size is None:
                raise InvalidArgumentError("outside_layers=True with one pipeline stage (parallel.pp=1) needs "
                                           "vocab_size (the logits)")
            # final LN, output input, fp32 logits
            total += (2 * bytes_per_element * sbh + 4 * Fraction(shape.seq_len * shape.batch * vocab_size)) / t
    return round_half_away(total)


# --------------------------------------------------------------------------- per-module rules


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor, enough to size it."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        return cls(tuple(tensor.shape), tensor.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


class _NeedsGrad(Protocol):
    @property
    def requires_grad(self) -> bool: ...


class ModuleLike(Protocol):
    """What a saved-bytes rule is handed as its module: a live ``nn.Module``, or a recorded call's stand-in
    (:class:`memprof.anatomy.predict.ModuleView`). Its configuration (``normalized_shape``, ``p``,
    ``kernel_size`` ...) is read by name (:func:`config_value`): torch types a module's other attributes as
    ``Tensor | Module``, and a recorded call holds what was recorded."""

    @property
    def training(self) -> bool: ...

    def parameters(self, recurse: bool = ...) -> Iterator[_NeedsGrad]: ...


#: What a rule is handed as the module's output: its shape and dtype, the first of several, or None when the
#: output was not recorded.
RuleOutput = TensorMeta | Sequence[TensorMeta] | None

#: ``rule(module, inputs, output, device, requires_input_grad) -> bytes`` saved that are not parameters/buffers.
SavedRule = Callable[[ModuleLike, Sequence[TensorMeta], RuleOutput, str, bool], int]

_RULES: dict[type, SavedRule] = {}
#: Rules of classes known by their qualified name (``module.QualName``), for libraries memprof does not
#: import (transformers): :mod:`memprof.anatomy.hf_rules`.
_NAMED_RULES: dict[str, SavedRule] = {}


#: Functions from a class to the names of classes it computes like (copies under another name), consulted
#: when neither the class nor its bases have a rule: :func:`memprof.anatomy.hf_rules.computes_like`.
_ALIASES: list[Callable[[type], Sequence[str]]] = []


def register_saved_rule_by_name(qualname: str, rule: SavedRule) -> None:
    """Register the rule of a class by its ``module.QualName``, without importing it."""
    if qualname in _NAMED_RULES:
        raise RegistryError(f"a saved-bytes rule for {qualname} is already registered; register once")
    _NAMED_RULES[qualname] = rule


def register_saved_rule(module_cls: type, rule: SavedRule) -> None:
    """Register the saved-bytes rule of a module class; a second registration raises :class:`RegistryError`."""
    if module_cls in _RULES:
        raise RegistryError(f"a saved-bytes rule for {module_cls.__qualname__} is already registered; register once")
    _RULES[module_cls] = rule


def saved_bytes_rule(module: ModuleLike | type) -> SavedRule | None:
    """The rule for a module (or class): exact class first, then the MRO; ``None`` if there is none."""
    cls = module if isinstance(module, type) else type(module)
    for klass in cls.__mro__:
        if klass in _RULES:
            return _RULES[klass]
        named = _NAMED_RULES.get(f"{klass.__module__}.{klass.__qualname__}")
        if named is not None:
            return named
    for alias in _ALIASES:  # a class that computes what a class with a rule computes
        for name in alias(cls):
            if name in _NAMED_RULES:
                return _NAMED_RULES[name]
    return None


def rule_for_classes(names: Sequence[str]) -> SavedRule | None:
    """The rule for a module recorded by its classes' ``module.QualName`` (most specific first)."""
    by_name = {f"{k.__module__}.{k.__qualname__}": rule for k, rule in _RULES.items()}
    by_name.update(_NAMED_RULES)
    for name in names:
        rule = by_name.get(name)
        if rule is not None:
            return rule
    return None


def module_saved_bytes(
    module: ModuleLike,
    inputs: Sequence[TensorMeta] | TensorMeta,
    output: RuleOutput = None,
    *,
    device: str = "cpu",
    requires_input_grad: bool = True,
) -> int | None:
    """Apply the registered rule of ``module``; ``None`` if no rule is registered."""
    rule = saved_bytes_rule(module)
    if rule is None:
        return None
    metas = [inputs] if isinstance(inputs, TensorMeta) else list(inputs)
    return rule(module, metas, output, device, requires_input_grad)


def config_value(module: ModuleLike, name: str) -> object:
    """The configuration attribute ``name`` of a live module or of a recorded call's stand-in."""
    return getattr(module, name)


def _flag(module: ModuleLike, name: str) -> bool:
    return bool(config_value(module, name))


def _number(module: ModuleLike, name: str) -> float:
    value = config_value(module, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{type(module).__name__}.{name} is {value!r}, not a number")
    return value


def _count(module: ModuleLike, name: str) -> int:
    value = config_value(module, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{type(module).__name__}.{name} is {value!r}, not an int")
    return value


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) for v in value):
        raise TypeError(f"{what} is {value!r}, not a sequence of ints")
    return tuple(value)


def _weight_grad(module: ModuleLike) -> bool:
    # Duck-typed: a live module's weight, or a recorded one (memprof.anatomy.predict.ModuleView).
    w = getattr(module, "weight", None)
    return w is not None and getattr(w, "requires_grad", False) is True


def _any_param_grad(module: ModuleLike) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def _input_saving(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str, grad: bool) -> int:
    # Linear (Addmm/Mm saves mat1 for dW), Conv (input for dW), when the weight needs a grad (autograd node fields and
    # measured with torch 2.13, see docs/anatomy.md#per-module-saved-tensors).
    return inputs[0].nbytes if _weight_grad(module) else 0


def _saves_input(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str, grad: bool) -> int:
    # Gelu / Silu save self (autograd node fields, docs/anatomy.md#per-module-saved-tensors).
    return inputs[0].nbytes if grad else 0


def _saves_output(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str, grad: bool) -> int:
    # Relu / Tanh / Sigmoid / Softmax / LogSoftmax save result (autograd node fields,
    # docs/anatomy.md#per-module-saved-tensors); the output has the input's shape/dtype.
    return inputs[0].nbytes if grad else 0


def _stat_dtype(meta: TensorMeta, device: str) -> torch.dtype:
    # CPU keeps norm statistics in the input dtype (measured with torch 2.13, see
    # docs/anatomy.md#measured-saved-tensors-per-block); CUDA uses fp32 accumulators for 16-bit inputs (unverified).
    if device != "cpu" and meta.itemsize < 4:
        return torch.float32
    return meta.dtype


def _layer_norm(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str, grad: bool) -> int:
    # NativeLayerNorm saves input, weight, bias, mean, rstd; mean/rstd have one element per normalised row.
    x = inputs[0]
    if not (grad or _any_param_grad(module)):
        return 0
    rows = x.numel // math.prod(_ints(config_value(module, "normalized_shape"), "normalized_shape"))
    return x.nbytes + 2 * rows * TensorMeta((), _stat_dtype(x, device)).itemsize


def _rms_norm(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str, grad: bool) -> int:
    x = inputs[0]
    if not (grad or _any_param_grad(module)):
        return 0
    rows = x.numel // math.prod(_ints(config_value(module, "normalized_shape"), "normalized_shape"))
    if device == "cpu":
        # torch 2.13 CPU composite (measured, docs/anatomy.md#per-module-saved-tensors): x upcast to fp32 (the input
        # itself when fp32), the fp32 rsqrt per row, and the normalised fp32 x saved by the weight multiply.
        item = max(x.itemsize, 4)
        return 2 * x.numel * item + rows * item
    # FusedRmsNorm (autograd node fields, docs/anatomy.md#per-module-saved-tensors): input + fp32 rstd per row
    # (unverified on GPU).
    return x.nbytes + rows * 4


def _batch_norm(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str, grad: bool) -> int:
    # NativeBatchNorm saves input, weight, running stats (buffers), save_mean, save_invstd (C each, training);
    # in eval mode with running stats save_mean/save_invstd are empty (measured with torch 2.13, CPU).
    # fp32 statistics for 16-bit inputs are unverified.
    x = inputs[0]
    if not (grad or _any_param_grad(module)):
        return 0
    uses_batch_stats = module.training or not _flag(module, "track_running_stats")
    stats = 2 * x.shape[1] * max(x.itemsize, 4) if uses_batch_stats else 0
    return x.nbytes + stats


def _group_norm(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str, grad: bool) -> int:
    # NativeGroupNorm saves input, weight, mean, rstd ((N, G) each, input dtype on CPU; measured with torch 2.13).
    x = inputs[0]
    if not (grad or _any_param_grad(module)):
        return 0
    return x.nbytes + 2 * x.shape[0] * _count(module, "num_groups") * TensorMeta((), _stat_dtype(x, device)).itemsize


def _dropout(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str, grad: bool) -> int:
    # CPU F.dropout: a float noise mask in the input dtype; CUDA native_dropout: a bool mask, 1 B/element
    # (aten/src/ATen/native/Dropout.cpp; measured with torch 2.13, docs/anatomy.md#per-module-saved-tensors).
    x = inputs[0]
    if not grad or not module.training or _number(module, "p") == 0:
        return 0
    return x.nbytes if device == "cpu" else x.numel * MASK_BYTES


def _embedding(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str, grad: bool) -> int:
    # Embedding saves the int64 indices only (autograd node fields and measured with torch 2.13,
    # docs/anatomy.md#per-module-saved-tensors).
    return inputs[0].nbytes if _weight_grad(module) else 0


def _max_pool(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str, grad: bool) -> int:
    # MaxPool2DWithIndices saves self and int64 indices shaped like the output (measured with torch 2.13: 1.50x for
    # fp32 k=2, docs/anatomy.md#per-module-saved-tensors).
    x = inputs[0]
    if not grad:
        return 0
    if output is None:
        output = TensorMeta(_pool_output_shape(module, x.shape), x.dtype)
    out = output if isinstance(output, TensorMeta) else output[0]
    return x.nbytes + out.numel * 8


def _pool_output_shape(module: ModuleLike, shape: tuple[int, ...]) -> tuple[int, ...]:
    def pair(name: str) -> tuple[int, ...]:
        v = config_value(module, name)
        if name == "stride" and not v:
            v = config_value(module, "kernel_size")  # stride=None: the kernel's size
        return (v, v) if isinstance(v, int) else _ints(v, name)

    k, st, pad, dil = pair("kernel_size"), pair("stride"), pair("padding"), pair("dilation")
    dims = []
    for i, n in enumerate(shape[-2:]):
        num = n + 2 * pad[i] - dil[i] * (k[i] - 1) - 1
        dims.append((-(-num // st[i]) if _flag(module, "ceil_mode") else num // st[i]) + 1)
    return (*shape[:-2], *dims)


def _multihead_attention(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str,
                         grad: bool) -> int:
    """Eager ``nn.MultiheadAttention`` self-attention called as ``mha(x, x, x)`` (need_weights=True), training.

    Measured on torch 2.13 CPU: the input (X), the packed in-projection output
    (3X, q/k/v are views of one storage), the scaled q (X), the attention
    probabilities (P = N·a·L·S elements), with dropout the mask (P, float on
    CPU; 1 B/element on CUDA) and the dropped probabilities (P), and the
    out-projection input (X). Total ``6X + P`` (+ mask + P with dropout).
    """
    x = inputs[0]
    if _flag(module, "batch_first"):
        n, length = x.shape[0], x.shape[1]
    else:
        length, n = x.shape[0], x.shape[1]
    heads = _count(module, "num_heads")
    probs = n * heads * length * length * x.itemsize
    total = 6 * x.nbytes + probs
    if module.training and _number(module, "dropout") > 0:
        total += probs + (probs if device == "cpu" else n * heads * length * length * MASK_BYTES)
    return total


def cross_entropy_saved_bytes(
    logits: TensorMeta, target: TensorMeta, *, autocast: bool = False, device: str = "cpu"
) -> int:
    """Bytes ``F.cross_entropy(logits, target)`` saves.

    The log-softmax output (fp32 under autocast, since log_softmax autocasts to
    fp32; else the logits' dtype), the integer target and a 0-dim total_weight
    in the log-softmax dtype (NllLoss node). Measured with torch 2.13 (CPU), see
    ``docs/anatomy.md#per-module-saved-tensors``; log_softmax autocasting to
    fp32 is from the PyTorch AMP docs, "CUDA Ops that can autocast to float32".
    """
    dtype = torch.float32 if autocast else logits.dtype
    item = TensorMeta((), dtype).itemsize
    return logits.numel * item + target.nbytes + item


def _register_builtin() -> None:
    rules: list[tuple[tuple[type[nn.Module], ...], SavedRule]] = [
        ((nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d), _input_saving),
        ((nn.LayerNorm,), _layer_norm),
        ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else (), _rms_norm),
        ((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), _batch_norm),
        ((nn.GroupNorm,), _group_norm),
        ((nn.GELU, nn.SiLU), _saves_input),
        ((nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Softmax, nn.LogSoftmax), _saves_output),
        ((nn.Dropout,), _dropout),
        ((nn.Embedding,), _embedding),
        ((nn.MaxPool2d,), _max_pool),
        ((nn.MultiheadAttention,), _multihead_attention),
    ]
    for classes, rule in rules:
        for cls in classes:
            register_saved_rule(cls, rule)


_register_builtin()
