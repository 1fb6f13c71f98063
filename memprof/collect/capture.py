"""The calls of the first grad-enabled forward: each module call's shapes and the module's configuration,
what the per-module formula will need (:mod:`memprof.anatomy.predict`, downstream of the record).

Only one forward is captured: every later forward of a training run calls the same modules with the same
shapes, and a record that grew with each would grow with the run.

Describing runs inside the user's step (the module hooks call it), so it never raises there: a call it
cannot describe (a nested tensor's ragged size, a sparse input, a subclass whose ``shape`` raises, a
configuration that cannot be read) ends the capture with a note, and the formula is not predicted rather
than predicted from the calls before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import is_interrupt
from ..vocabulary import Phase
from ..record.specs import ModuleCall, NotDescribed, TensorSpec, plain_config
from .module_table import class_names, tensors_in_args
from .saved_hooks import under_checkpoint

if TYPE_CHECKING:
    from .aliases import Args, Kwargs
    from .module_table import ModuleTable
    from .state import Run

__all__ = ["Capture"]


class Capture:
    """Records the module calls of the first grad-enabled forward."""

    def __init__(self, table: "ModuleTable", run: "Run") -> None:
        self.table = table
        self.run = run
        #: A forward is being captured now (read by the saved-tensor accounting: what a rule module saves
        #: of the model's inputs counts for the formula only then).
        self.on = False
        self.done = False
        self.pending: dict[int, tuple[TensorSpec, ...]] = {}  # open calls: their inputs
        self.module_calls: list[tuple[int, ModuleCall]] = []

    def begin(self) -> None:
        """The first grad-enabled forward of the model begins: its calls are captured."""
        self.on = True
        self.pending = {}

    def phase_began(self, phase: Phase) -> None:
        """Capturing ends with the forward that began it."""
        if self.on:
            self.on = False
            self.done = True
        if phase is Phase.FORWARD and not self.done and torch.is_grad_enabled():
            self.on = True
            self.pending = {}

    def call_began(self, index: int, args: "Args", kwargs: "Kwargs") -> None:
        """Module ``index`` is called (in forward, while capturing): its inputs."""
        try:
            self.pending[index] = tuple(TensorSpec.of(t) for t in tensors_in_args(args, kwargs)
                                        if t.is_floating_point() or not t.is_complex())
        except Exception as exc:  # whatever the user's objects raise when read, the step runs as without memprof
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            self.give_up(index, "took", exc)

    def call_ended(self, index: int, module: nn.Module, output: object, args: "Args", kwargs: "Kwargs") -> None:
        """Module ``index`` returned: its call's record, if its start was captured."""
        inputs = self.pending.pop(index, None) if self.on else None
        if inputs is None:
            return
        try:
            outs = [TensorSpec.of(t) for t in tensors_in_args((output,), None)]
        except Exception as exc:  # as in call_began
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            self.give_up(index, "returned", exc)
            return
        try:
            call = self._call(index, module, inputs, outs, args, kwargs)
        except Exception as exc:  # its arguments' or its own attributes
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            self.give_up(index, "holds", exc)
            return
        self.module_calls.append((index, call))

    def _call(self, index: int, module: nn.Module, inputs: tuple[TensorSpec, ...], outs: list[TensorSpec],
              args: "Args", kwargs: "Kwargs") -> ModuleCall:
        own = list(module.named_parameters(recurse=False))
        grad = any(t.requires_grad for t in tensors_in_args(args, kwargs)) or any(p.requires_grad for _n, p in own)
        return ModuleCall(
            path=self.table.path(index),
            classes=class_names(type(module)),
            config=plain_config(vars(module)),
            params=tuple((name, bool(p.requires_grad)) for name, p in own),
            inputs=inputs,
            output=outs[0] if outs else None,
            grad=grad and torch.is_grad_enabled(),
            leaf=not any(True for _ in module.children()),
            checkpointed=under_checkpoint(),
        )

    def give_up(self, index: int, verb: str, exc: Exception) -> None:
        """A call that cannot be described ends the capture: the calls captured so far are dropped, since a
        formula summed over part of the model would look like a prediction of all of it."""
        what = str(exc) if isinstance(exc, NotDescribed) else f"something it cannot read ({type(exc).__name__}: " \
            f"{str(exc)[:80]})"
        self.run.note(f"module {self.table.path(index)} {verb} {what}: memprof cannot describe the call, so the "
                      "per-module formula is not predicted")
        self.on = False
        self.done = True
        self.pending = {}
        self.module_calls = []
