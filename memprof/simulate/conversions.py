"""A fake twin's modules convert their tensors as real modules do.

``module.to(dtype)``, ``.half()``, ``.float()`` call ``nn.Module._apply``, which swaps every parameter of a module of
fake tensors with its converted copy (``torch.utils.swap_tensors``, torch/nn/modules/module.py) where a real module's
sets the parameter's data; the fake mode keeps weak references to its tensors, and a swap refuses a tensor with
any. A model whose forward converts a submodule failed to simulate. Each module of a fake twin gets
:func:`_apply_as_real` as its ``_apply`` (an attribute of the twin's own modules, not of their classes).
"""

from __future__ import annotations

import types
from typing import Callable

import torch
from torch import nn

__all__ = ["convert_as_real_modules"]


def _apply_as_real(module: nn.Module, fn: "Callable[[torch.Tensor], torch.Tensor]", recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` for a module of a fake twin, as a real module's runs: a forward that casts a submodule
    (transformers' SwitchTransformers router, ``self.classifier.to(self.dtype)``; ``self.b.half()``) failed on the
    twin ("Couldn't swap", a new user's sweep and a review), where a real module's ``_apply`` leaves what it does
    not change as it is and sets the rest's data (``param.data =``). So does this one. A class with an ``_apply`` of
    its own gets it where a tensor changes, but an RNN, whose own flattens its weights after torch's: that is done
    here once the data is set (torch's would swap). The test for a change stops at the first one: one converted
    copy, let go at once."""
    tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    with torch.no_grad():
        if all(fn(t) is t for t in tensors):
            return module
    own = type(module)._apply is not nn.Module._apply
    if own and not isinstance(module, nn.RNNBase):
        applied: nn.Module = type(module)._apply(module, fn, recurse)  # type: ignore[no-untyped-call]  # untyped
        return applied
    if recurse:
        for child in module.children():
            child._apply(fn)  # type: ignore[no-untyped-call]  # its own: this function, bound to it
    with torch.no_grad():
        for param in module._parameters.values():
            if param is None:
                continue
            made = fn(param)
            if made is not param:
                param.data = made
            grad = param.grad
            grad_made = fn(grad) if grad is not None else None
            if grad_made is not None and grad_made is not grad:
                param.grad = grad_made
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = fn(buffer)
    if own:  # an RNN: what its own _apply does after torch's (torch/nn/modules/rnn.py), whose swap fails here
        module._init_flat_weights()  # type: ignore[operator]  # RNNBase's, untyped
    return module


def convert_as_real_modules(model: nn.Module) -> None:
    """Each module of the fake twin ``model`` applies a conversion as :func:`_apply_as_real` does (an
    attribute of the twin's own modules: torch's class is not changed)."""
    for module in model.modules():
        module._apply = types.MethodType(_apply_as_real, module)  # type: ignore[method-assign]
