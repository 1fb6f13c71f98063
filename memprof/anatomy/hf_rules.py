"""Saved-bytes rules for the layer types of Hugging Face transformers that are not torch modules.

Registered by qualified name, so transformers is never imported. Each rule counts what autograd saves
when the layer's forward runs (its code in the transformers source; measured with transformers 5.24
and torch 2.13 on CPU, `tests/integration/test_hf_rules.py`), with n the input's elements:

* ``Conv1D`` (GPT-2's transposed linear, ``addmm(bias, x, weight)``): the input, when the weight needs
  a gradient, as ``nn.Linear``.
* ``NewGELUActivation`` (the tanh approximation written out: ``0.5 x (1 + tanh(c (x + 0.044715 x^3))``):
  the input (saved by ``pow``), ``tanh``'s output, and both operands of the last product: 4 tensors of
  the input's size and dtype.
* ``GELUActivation`` (``F.gelu``): the input, as ``nn.GELU``.
* ``SiLUActivation`` (``F.silu``, Llama's MLP): the input, as ``nn.SiLU``.
* ``LlamaRMSNorm`` (upcast to fp32, ``x * rsqrt(mean(x^2))``, cast back, times the weight): the fp32
  input (a copy when the input is 16-bit), the fp32 rsqrt per row, and the normalised output in the
  input's dtype: 4n + 4 rows + n x itemsize bytes.
* ``T5LayerNorm`` (the variance from an fp32 copy, the product taken with the input, cast to a 16-bit
  weight's dtype): the fp32 copy (the input itself in fp32), the rsqrt per row, the 16-bit input, and
  the product (fp32) or its 16-bit cast: 8n + 4 rows bytes in fp32 and in bf16 alike.

Most transformers models copy these layers under their own names ("Copied from ... LlamaRMSNorm": 138
RMSNorm classes in transformers 5.24 have LlamaRMSNorm's forward verbatim). :func:`computes_like` finds
them by what they compute, not by name: a class whose ``forward`` compiles to the same code as a
class above takes its rule.
"""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

from ..errors import is_interrupt
from .activations import (
    _ALIASES,
    ModuleLike,
    RuleOutput,
    TensorMeta,
    _any_param_grad,
    _input_saving,
    _saves_input,
    register_saved_rule_by_name,
)

__all__: list[str] = []


def _new_gelu(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str, grad: bool) -> int:
    return 4 * inputs[0].nbytes if grad else 0


def _rows(x: TensorMeta) -> int:
    return x.numel // x.shape[-1] if x.shape else 1


def _llama_rms_norm(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str,
                    grad: bool) -> int:
    x = inputs[0]
    if not (grad or _any_param_grad(module)):
        return 0
    return 4 * x.numel + 4 * _rows(x) + x.nbytes


def _t5_layer_norm(module: ModuleLike, inputs: Sequence[TensorMeta], output: RuleOutput, device: str,
                   grad: bool) -> int:
    x = inputs[0]
    if not (grad or _any_param_grad(module)):
        return 0
    if x.itemsize == 4:  # the fp32 "copy" is the input; the product is fp32
        return 8 * x.numel + 4 * _rows(x)
    return 4 * x.numel + 4 * _rows(x) + 2 * x.nbytes  # fp32 copy, rows, 16-bit input, 16-bit cast


_REFERENCES = (
    ("transformers.pytorch_utils.Conv1D", _input_saving),
    ("transformers.activations.NewGELUActivation", _new_gelu),
    ("transformers.activations.GELUActivation", _saves_input),
    ("transformers.activations.SiLUActivation", _saves_input),
    ("transformers.models.llama.modeling_llama.LlamaRMSNorm", _llama_rms_norm),
    ("transformers.models.t5.modeling_t5.T5LayerNorm", _t5_layer_norm),
)
for _name, _rule in _REFERENCES:
    register_saved_rule_by_name(_name, _rule)

_LIKE: dict[type, tuple[str, ...]] = {}


def computes_like(cls: type) -> tuple[str, ...]:
    """Names of the classes above whose ``forward`` is ``cls``'s, compiled (same bytecode, constants and
    names): a transformers layer copied under another name. Empty for anything else."""
    if not cls.__module__.startswith("transformers.") or "forward" not in vars(cls):
        return ()
    if cls not in _LIKE:
        _LIKE[cls] = tuple(name for name, _ in _REFERENCES if _same_code(cls, name))
    return _LIKE[cls]


def _same_code(cls: type, qualname: str) -> bool:
    module_name, _, class_name = qualname.rpartition(".")
    if f"{cls.__module__}.{cls.__qualname__}" == qualname:
        return False  # the reference itself: its own name already finds the rule
    try:  # transformers is imported (the model is one of its classes); the reference's module may not be yet
        ref = getattr(sys.modules.get(module_name) or importlib.import_module(module_name), class_name)
    except Exception as failure:  # another transformers version without it
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return False
    a, b = getattr(vars(cls)["forward"], "__code__", None), getattr(getattr(ref, "forward", None), "__code__", None)
    if a is None or b is None:
        return False
    return (a.co_code, a.co_consts, a.co_names, a.co_varnames) == (b.co_code, b.co_consts, b.co_names, b.co_varnames)


_ALIASES.append(computes_like)
