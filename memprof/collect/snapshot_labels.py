"""memprof's phase, step and module in the allocator's snapshot: labels that pytorch.org/memory_viz shows.

While the CUDA caching allocator records its history (the user's ``_record_memory_history``, or memprof's own
for ``source="allocator"``), ``torch.cuda.memory._set_memory_metadata(text)`` attaches ``text`` to every entry
it records from then on (its ``user_metadata``). memprof sets it to where the run is::

    memprof phase=forward step=3 module=layers.0.attn

when a phase begins, a step ends, and a module of the model begins or ends its forward (never per op), and
puts back the string that was there before when the profile ends, also when the block raises.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

from torch import nn
from torch.nn.modules import module as _module_mod

from ..vocabulary import Phase
from .torch_compat import is_compiling

if TYPE_CHECKING:
    from .module_table import ModuleTable
    from .state import Run
    from .undo import UndoStack

__all__ = ["SnapshotLabels", "label"]


def label(phase: str, step: int, module: "str | None" = None) -> str:
    """The text memprof attaches: ``memprof phase=<phase> step=<step>`` and `` module=<path>`` inside a call."""
    text = f"memprof phase={phase} step={step}"
    return text if module is None else f"{text} module={module}"


class SnapshotLabels:
    """Keeps the allocator's metadata string on memprof's phase, step and innermost module."""

    def __init__(self, run: "Run", table: "ModuleTable", get: Callable[[], str], put: Callable[[str], None]) -> None:
        self.run = run
        self.table = table
        self.get = get
        self.put = put
        self.previous: "str | None" = None
        self.current = ""
        self.calls: list[int] = []  # the model's forward calls in progress, innermost last

    def start(self, stack: "UndoStack") -> None:
        """Label from now on; the string there now comes back when the profile ends."""
        self.previous = self.get()
        stack.callback(self.stop)
        self.show()
        stack.callback(_module_mod.register_module_forward_pre_hook(self.entered).remove)
        # always_call: a forward that raises still ends its label.
        stack.callback(_module_mod.register_module_forward_hook(self.left, always_call=True).remove)

    def show(self) -> None:
        run = self.run
        module = self.table.path(self.calls[-1]) if self.calls else None
        text = label(run.phase.value, run.step, module)
        if text != self.current:
            self.current = text
            self.put(text)

    def phase_began(self, phase: Phase) -> None:
        """A phase begins (the run state still holds the one that ended)."""
        if self.run.active:
            self.current = label(phase.value, self.run.step, self.table.path(self.calls[-1]) if self.calls else None)
            self.put(self.current)

    def step_ended(self) -> None:
        """A step ends: what follows is the next step's "other" phase."""
        if self.run.active:
            self.current = label(Phase.OTHER.value, self.run.step + 1)
            self.put(self.current)

    def _watched(self, module: nn.Module) -> "int | None":
        """The module's row when it is the model's, called in the profile's thread outside dynamo's tracing (where
        memprof's code must not enter a graph); None otherwise. The label is the process's, so only the profiled
        thread sets it."""
        row = self.table.index.get(id(module))
        if row is None or is_compiling() or threading.get_ident() != self.run.thread:
            return None
        return row

    def entered(self, module: nn.Module, _args: object) -> None:
        row = self._watched(module)
        if row is None or not self.run.active:
            return
        self.calls.append(row)
        self.show()

    def left(self, module: nn.Module, _args: object, _out: object) -> None:
        row = self._watched(module)
        if row is None or not self.calls or self.calls[-1] != row:
            return
        self.calls.pop()
        if self.run.active:
            self.show()

    def stop(self) -> None:
        """Put back the string that was there when the profile began."""
        if self.previous is not None:
            previous, self.previous = self.previous, None
            self.put(previous)
