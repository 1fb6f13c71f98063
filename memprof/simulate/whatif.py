"""What if a measured run changed one thing: the changed run simulated, and what it saves at the peak.

A Trace records the module calls, the optimizer's specs and the peak, not the model: a simulation needs the
module itself (its code decides which tensors autograd saves). So :func:`what_if` takes the model and the
optimizer again, with the inputs, and the change: activation checkpointing (transformers' own, on a
data-less copy: the user's model is not touched), a precision, a data-parallel layout, a batch size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from typing_extensions import Unpack

import torch
from torch import nn

from ..errors import InvalidArgumentError
from ..record.estimate import WhatIf
from ..record.trace import Trace
from ..vocabulary import Category
from .held_signals import deepcopy_held
from .run import EstimateSettings

if TYPE_CHECKING:
    from .aliases import Option, UserValue

__all__ = ["WhatIf", "WhatIfOptions", "what_if"]


class WhatIfOptions(EstimateSettings, total=False):
    """The changes :func:`what_if` takes beside :func:`memprof.estimate`'s keyword arguments."""

    checkpointing: "bool | None"
    batch_size: "int | None"


def what_if(trace: Trace, model: nn.Module,
            optimizer: "torch.optim.Optimizer | Callable[..., object] | None" = None, *, inputs: UserValue,
            targets: UserValue = None, loss_fn: "Callable[..., torch.Tensor] | None" = None,
            **changes: Unpack[WhatIfOptions]) -> WhatIf:
    """The run ``trace`` recorded, with one or more things changed, simulated (:func:`memprof.estimate`).

    ``model``, ``optimizer``, ``inputs``, ``targets`` and ``loss_fn`` are the run's, as it was profiled (the
    trace does not hold the model's code, which decides what autograd saves). ``checkpointing=True`` enables
    transformers' activation checkpointing on every layer of a copy of the model (a transformers model only;
    others: enable it in the model and pass that); ``precision``, ``parallel`` and ``world_size`` are
    :func:`memprof.estimate`'s; ``batch_size`` resizes dimension 0 of every input and target tensor whose
    dimension 0 is the run's batch (that of the first input tensor). The figures are for ``device``, by
    default the run's device type.
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"what_if() needs the run's model (a torch.nn.Module), got {type(model).__name__}")
    from .estimate import estimate

    options: "dict[str, Option]" = dict(changes)
    checkpointing, batch_size = options.pop("checkpointing", None), options.pop("batch_size", None)
    precision, parallel = options.pop("precision", None), options.pop("parallel", None)
    world_size, device = options.pop("world_size", None), options.pop("device", None)

    changed = [(k, v) for k, v in (("checkpointing", checkpointing), ("precision", precision),
                                   ("parallel", parallel), ("world_size", world_size),
                                   ("batch_size", batch_size)) if v is not None]
    if not changed:
        raise InvalidArgumentError("what_if() needs a change: checkpointing=, precision=, parallel=, world_size= or "
                                   "batch_size=")
    run = trace.distributed
    if parallel is None and run is not None and run.layout in ("ddp", "fsdp", "zero1", "zero2", "zero3"):
        parallel = run.layout
    if world_size is None:
        world_size = run.world_size if run is not None and parallel is not None else (2 if parallel else 1)
    target = device if device is not None else trace.device.type
    if batch_size is not None:
        inputs, targets = _resized(inputs, targets, batch_size)
    simulated = model
    if checkpointing:
        simulated = _checkpointed(model)
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer = _rebuilt(optimizer, model, simulated)
    est = estimate(simulated, optimizer, inputs=inputs, targets=targets, loss_fn=loss_fn, precision=precision,
                   device=target, world_size=world_size, parallel=parallel, **options)
    base = trace.peak
    base_bytes = None if any(base[c] is None for c in _TENSORS) else sum(base[c] or 0 for c in _TENSORS)
    return WhatIf(trace=est.trace, precision=est.precision, device=est.device, notes=est.notes,
                  device_memory=est.device_memory, baseline=base, baseline_peak_bytes=base_bytes,
                  changes=tuple(changed))


_TENSORS = tuple(c for c in Category if c not in (Category.ALLOCATOR_OVERHEAD, Category.OUTSIDE_TORCH))


def _checkpointed(model: nn.Module) -> nn.Module:
    """A data-less (meta) copy of ``model`` with transformers' activation checkpointing enabled."""
    from .hf import enable_checkpointing

    if not hasattr(model, "supports_gradient_checkpointing"):
        raise InvalidArgumentError(f"checkpointing=True enables transformers' activation checkpointing, and "
                                   f"{type(model).__name__} is not a transformers model: wrap its blocks in "
                                   "torch.utils.checkpoint.checkpoint yourself and pass that model")
    memo: dict[int, object] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in memo:
            twin = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(twin, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else twin
    clone = deepcopy_held(model, memo)  # a Ctrl-C in it could be dropped (held_signals)
    enable_checkpointing(clone)
    return clone


def _rebuilt(optimizer: torch.optim.Optimizer, model: nn.Module, clone: nn.Module) -> torch.optim.Optimizer:
    """``optimizer``'s class and parameter groups on ``clone``'s parameters."""
    twin = {id(p): q for p, q in zip(model.parameters(), clone.parameters())}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [twin[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    # The optimizer's own class, built as a user builds it: its constructor (not Optimizer's) gives the defaults.
    rebuilt: Callable[..., torch.optim.Optimizer] = type(optimizer)
    return rebuilt(groups)


def _resized(inputs: UserValue, targets: UserValue, batch_size: int) -> tuple[UserValue, UserValue]:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    first = _first_tensor(inputs)
    if first is None or first.dim() == 0:
        raise InvalidArgumentError("batch_size= resizes the inputs' dimension 0, and the inputs hold no batched "
                                   "tensor; pass inputs of the batch you want instead")
    old = first.shape[0]
    made: dict[int, torch.Tensor] = {}  # one resized tensor per tensor: labels may be the inputs themselves

    def resize(obj: UserValue) -> UserValue:
        if isinstance(obj, torch.Tensor):
            if obj.dim() and obj.shape[0] == old:
                if id(obj) not in made:
                    made[id(obj)] = torch.empty((batch_size, *obj.shape[1:]), dtype=obj.dtype, device="meta")
                return made[id(obj)]
            return obj
        if isinstance(obj, (tuple, list)):
            return type(obj)(resize(o) for o in obj)
        if isinstance(obj, dict):
            return {k: resize(v) for k, v in obj.items()}
        return obj

    return resize(inputs), resize(targets)


def _first_tensor(obj: object) -> "torch.Tensor | None":
    if isinstance(obj, torch.Tensor):
        return obj
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for v in values:
        found = _first_tensor(v)
        if found is not None:
            return found
    return None
