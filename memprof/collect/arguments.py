"""What ``memprof.profile()`` and ``memprof.Profiler()`` are given, checked before anything is installed:
each refusal is a MemprofError that names the fix.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InvalidArgumentError, UnknownNameError
from .optimizer import as_optimizers
from .state import EXACT, LIGHT

__all__ = ["checked"]

_MODES = (EXACT, LIGHT, "auto")


def checked(model: object, optimizer: object, mode: object, timeline: object, operations: object, schedule: object,
             on_trace_ready: object, allow_meta: bool) -> "tuple[list[torch.optim.Optimizer], torch.device]":
    """What profile() was given, checked: the optimizers (unwrapped) and the model's device, or a
    MemprofError that names the fix."""
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(
            f"profile() needs a torch.nn.Module as its first argument, got {type(model).__name__}; "
            "pass the model whose training you want to measure"
        )
    optimizers = as_optimizers(optimizer)
    if isinstance(mode, str) and mode == "full":
        # The word of memprof's early versions; its docs and reports always called it exact mode.
        raise UnknownNameError("mode 'full' is now called 'exact' (every storage, exact to the byte); use "
                               "mode='exact', or one of: exact, light, auto")
    if not isinstance(mode, str) or mode not in _MODES:
        raise UnknownNameError(f"unknown mode {mode!r}; use one of: exact, light, auto")
    refuse_foreign_parameters(optimizers, model, "profile")
    if getattr(model, "_compiled_call_impl", None) is not None:
        # nn.Module.compile() compiles the module's own __call__, hooks included: memprof's hooks
        # would be traced into the graph (splitting it) or, added after compilation, never run.
        raise InvalidArgumentError(
            f"{type(model).__name__} was compiled in place with model.compile(), so memprof's hooks on it "
            "would run inside the compiled code; profile the wrapper torch.compile(model) returns instead "
            "(memprof.profile(torch.compile(model), optimizer)), or compile its blocks in place and "
            "profile the model that holds them"
        )
    device = model_device(model)
    if device.type == "meta" and not allow_meta:
        raise InvalidArgumentError(
            "the model is on the meta device, where nothing can be measured; move it to a real device "
            "(model.to('cpu') after materialising), or use memprof.estimate() to simulate it"
        )
    for name, value in (("timeline", timeline), ("operations", operations)):
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be True or False, got {value!r}")
    from .schedule import Schedule

    if schedule is not None and not isinstance(schedule, Schedule):
        raise InvalidArgumentError(
            f"schedule must come from memprof.schedule(wait=, warmup=, active=, repeat=, skip_first=), got "
            f"{type(schedule).__name__}")
    if on_trace_ready is not None and not callable(on_trace_ready):
        raise InvalidArgumentError(
            f"on_trace_ready must be a function taking the profiler, got {type(on_trace_ready).__name__}")
    if on_trace_ready is not None and schedule is None:
        raise InvalidArgumentError(
            "on_trace_ready is called at the end of each window of a schedule; pass schedule=memprof.schedule(...) "
            "too, or read prof.report() after the block")
    return optimizers, device


def model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def refuse_foreign_parameters(optimizers: "list[torch.optim.Optimizer]", model: nn.Module, verb: str) -> None:
    """An InvalidArgumentError where an optimizer holds a parameter that is not ``model``'s (one built over another
    model, a stale copy's, a loss module's): its step and state would be missed. ``verb``: what the user asked
    for (``"profile"``, ``"estimate"``), named in the fix."""
    model_params = {id(p) for p in model.parameters()}
    for opt in optimizers:
        foreign = [p for g in opt.param_groups for p in g["params"] if id(p) not in model_params]
        if foreign:
            raise InvalidArgumentError(
                f"{type(opt).__name__} holds {len(foreign)} parameter(s) that are not the model's; "
                f"pass the optimizer built from model.parameters(), or {verb} the module that owns them"
            )
