"""The training loop a simulation runs, one step at a time: forward and loss (under autocast for mixed
precision), backward (through a GradScaler's steps for mixed-fp16), the optimizer step, with the loss held as a
loop that logs it holds it."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ..errors import InvalidArgumentError, is_interrupt

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from torch.distributed.device_mesh import DeviceMesh

    from .aliases import UserValue
    from .autocast import AutocastFactory, CudaAutocast
    from .user_step import LoopValues

    #: A ``step_context`` as :func:`check_step_context` gives it: the context around one step's forward, loss and
    #: backward, made from the step's parts.
    StepContext = Callable[["StepParts"], AbstractContextManager[object]]

__all__ = ["TrainingStep", "ScalerSteps", "StepParts", "check_step_context"]


class StepParts:
    """What a ``step_context`` is handed at each simulated step: the simulated ``model`` (after your parallelize
    function), the device ``mesh`` (None without ``parallelize=``), the step's ``inputs`` and ``targets`` (the
    very tensors the model is called with, so that a context may shard them in place, as
    ``context_parallel(mesh, buffers=...)`` does) and the ``optimizer``."""

    __slots__ = ("model", "mesh", "inputs", "targets", "optimizer")

    def __init__(self, model: nn.Module, mesh: "DeviceMesh | None", inputs: UserValue, targets: UserValue,
                 optimizer: "torch.optim.Optimizer | None") -> None:
        self.model, self.mesh, self.inputs, self.targets, self.optimizer = model, mesh, inputs, targets, optimizer


def check_step_context(fn: object) -> "StepContext | None":
    """``fn`` as a function of a :class:`StepParts` returning a context manager (one that takes no argument, as
    ``torch.distributed.tensor.parallel.loss_parallel`` does, is called without); None stays None."""
    if fn is None:
        return None
    if not callable(fn) or (hasattr(fn, "__enter__") and not isinstance(fn, type)):  # a class is a function of it
        raise InvalidArgumentError(
            f"step_context must be a function returning a context manager (step_context=loss_parallel, or "
            f"lambda step: context_parallel(step.mesh, buffers=[step.inputs], buffer_seq_dims=[1])), got "
            f"{type(fn).__name__}; pass the function, not an entered or built context")
    import inspect

    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                  and (p.default is p.empty or p.kind is p.VAR_POSITIONAL)]
    except (TypeError, ValueError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        params = [None]  # type: ignore[list-item]
    takes_parts = bool(params)

    def context(parts: StepParts) -> AbstractContextManager[object]:
        made: object = fn(parts) if takes_parts else fn()
        if not (hasattr(made, "__enter__") and hasattr(made, "__exit__")):
            raise InvalidArgumentError(f"step_context returned {type(made).__name__}, not a context manager; "
                                       "return the context (loss_parallel()), not what entering it gives")
        return made
    return context


def _call(model: nn.Module, inputs: UserValue) -> object:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _loss(out: object, targets: UserValue, loss_fn: "Callable[..., object] | None") -> object:
    """The step's loss: ``loss_fn``'s result (the user's function's, checked by the caller), or the sum of the
    model's first output tensor."""
    if loss_fn is not None:
        return loss_fn(out, targets) if targets is not None else loss_fn(out)
    first = out
    while isinstance(first, (tuple, list)) and first:
        first = first[0]
    if isinstance(first, dict):
        first = next(v for v in first.values() if isinstance(v, torch.Tensor))
    if not isinstance(first, torch.Tensor):
        raise InvalidArgumentError("the model returned no tensor; pass loss_fn= to build the loss")
    return first.sum()


class TrainingStep:
    """One simulated training step: forward and loss (under autocast for mixed precision), backward
    (through a GradScaler for mixed-fp16), the optimizer step.

    The loss lives as in a training loop that logs it after the step (``loss = ...; loss.backward();
    opt.step(); opt.zero_grad(); log(loss)``): bound through backward, ``optimizer.step()`` and ``zero_grad()``
    and the next step's forward, released when the next step's loss rebinds the name, and the last one when the
    loop ends (:func:`estimate` drops it after the last step). A 0-dim loss can keep a larger storage alive (on
    CPU ``mse_loss``'s result is a view of its elementwise buffer), which an optimizer phase then holds."""

    #: The current step's loss, bound until the next step's replaces it (None before the first and after the last).
    loss: "torch.Tensor | None" = None
    #: The optimizer step's value reads answered (entered by the run around the steps), for the notes.
    values: "LoopValues | None" = None

    def __init__(self, model: nn.Module, inputs: UserValue, targets: UserValue,
                 loss_fn: "Callable[..., object] | None", optimizer: "torch.optim.Optimizer | None",
                 autocast: "AutocastFactory | None", emulated: "CudaAutocast | None", scaler: "ScalerSteps | None",
                 context: "StepContext | None" = None, mesh: "DeviceMesh | None" = None,
                 inside: "Callable[[], None] | None" = None) -> None:
        self.model, self.inputs, self.targets, self.loss_fn = model, inputs, targets, loss_fn
        self.optimizer, self.autocast, self.emulated, self.scaler = optimizer, autocast, emulated, scaler
        #: A function of :class:`StepParts` making the context around forward, loss and backward (``step_context``).
        self.context, self.mesh = context, mesh
        #: Called inside the context after backward: what the context switched on can be read there.
        self.inside = inside

    def run(self) -> None:
        if self.context is None:
            self._forward_backward()
        else:
            # A fresh context each step, around forward, loss and backward, as a training loop enters
            # loss_parallel() or context_parallel(...) (torchtitan's train context); the optimizer step is outside.
            with self.context(StepParts(self.model, self.mesh, self.inputs, self.targets, self.optimizer)):
                self._forward_backward()
                if self.inside is not None:
                    self.inside()
        if self.optimizer is not None:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
            else:
                self.optimizer.step()
            self.optimizer.zero_grad()

    def _forward_backward(self) -> None:
        # The output is not kept in a variable, as in a usual training loop: the loss
        # function's saved tensors keep what backward needs and the rest is freed.
        if self.emulated is not None:
            self.emulated.begin_forward()
        try:
            with (self.autocast() if self.autocast is not None else contextlib.nullcontext()):
                loss = _loss(_call(self.model, self.inputs), self.targets, self.loss_fn)
        finally:  # also when the model raises: the emulated autocast must not outlive the forward
            if self.emulated is not None:
                self.emulated.end_forward()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise InvalidArgumentError(f"the loss must be a scalar tensor to call backward() on, got {shape}; "
                                       "reduce it in loss_fn (for example .mean())")
        self.loss = loss  # the previous step's loss is released here, as a loop's rebinding of the name releases it
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()  # type: ignore[no-untyped-call]  # Tensor's is untyped
        del loss  # self.loss holds it through the optimizer step



class ScalerSteps:
    """What ``torch.amp.GradScaler`` allocates and does around a step (torch/amp/grad_scaler.py), on
    shape-only tensors: a 4-byte scale and growth tracker made at the first ``scale``, the loss times the
    scale, and before the optimizer step an inf flag, the inverse scale and the in-place unscale of the
    gradients. Its ``found_inf.item()`` cannot run without data: every step is taken."""

    def __init__(self) -> None:
        self._scale: "torch.Tensor | None" = None
        self._growth: "torch.Tensor | None" = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        if self._scale is None:
            self._scale = torch.full((), 65536.0, dtype=torch.float32, device=loss.device)
            self._growth = torch.full((), 0, dtype=torch.int32, device=loss.device)
        return loss * self._scale

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        assert self._scale is not None and self._growth is not None
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        del by_dtype, inv_scale
        optimizer.step()
        torch._amp_update_scale_(self._scale, self._growth, found_inf, 2.0, 0.5, 2000)
