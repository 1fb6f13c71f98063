"""Light mode's one hook inside each backward that its queued gradients need.

Light mode's gradient hook is the ledger queue's own ``append`` (:attr:`memprof.collect.params.ParamTracker.hook`):
autograd queues each parameter whose gradient it stored, and the next ``Ledger.settle`` hands it to
``ParamTracker.grad_hook``. The backward phase must still begin and end inside autograd's engine, where a
gradient hook called by autograd began it (``PhaseTracker.backward_started`` queues the engine callback that
ends it). Usually backward's first unpack of a tensor memprof packed does that, and settles the gradients
queued before it, each at its own place. A backward may unpack nothing of memprof's, or only after gradients
arrived (``x + bias`` saves nothing): so each outermost forward call hooks the autograd node of its output,
and when the engine reaches it, an engine callback settles the queue at backward's end if no unpack did; a
gradient queued first then starts the backward at its own place, still inside the engine, and ends it there.

The node hooks go on :attr:`memprof.collect.frames.Frames.node_hooks`: removed at the step's end and with
the profile. At each forward's end it also checks that no hook was registered after memprof's queued one on a
parameter (:meth:`EngineWatch.check_hook_order`): such a hook runs before the queue is settled.
"""

from __future__ import annotations

import operator
import weakref
from typing import TYPE_CHECKING

import torch

from ..errors import is_interrupt
from ..vocabulary import Phase
from .module_table import tensors_in_args
from .torch_compat import graph_task_id as _graph_task_id, is_compiling as _is_compiling, queue_backward_callback

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .ledger import Ledger
    from .params import ParamTracker
    from .phases import PhaseTracker
    from .state import Run

__all__ = ["EngineWatch"]

_PLAIN = torch.Tensor
_POST_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")
_FIRST = operator.itemgetter(0)
_DEREF = weakref.ref.__call__


class EngineWatch:
    """Hooks the autograd nodes of light mode's forward outputs so that every backward runs memprof's code
    inside the engine (see the module's docstring)."""

    def __init__(self, ledger: "Ledger", run: "Run", phases: "PhaseTracker",
                 node_hooks: "list[RemovableHandle]", params: "ParamTracker") -> None:
        self.ledger = ledger
        self.params = params
        self.queued_hooks = -1  # the post-accumulate-grad hooks on params.queued's parameters when last counted
        self.run = run
        self.phases = phases
        self.node_hooks = node_hooks
        self.queued_task = -1  # the graph task whose end is already watched

    def hook_output(self, output: object) -> None:
        """An outermost call of the model returned ``output``: in a forward with grad mode on, hook its tensors'
        autograd nodes."""
        if self.run.phase is not Phase.FORWARD or not torch.is_grad_enabled():
            return  # a checkpointed region recomputed in backward, an evaluation: no backward of it to watch
        self.check_hook_order()
        try:
            for t in (output,) if type(output) is _PLAIN else tensors_in_args((output,), None):
                node = t.grad_fn
                if node is not None:
                    self.node_hooks.append(node.register_prehook(self.entered))
        except Exception as exc:  # an output that cannot be read or hooked: the unpacks still begin backward
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's

    def check_hook_order(self) -> None:
        """A parameter on which a hook was registered after memprof's queued one (an optimizer stepped in
        backward that sets ``.grad`` to None) gets grad_hook itself, called by autograd at the same place among
        its hooks, in place of the queue's append: the later hook may change ``.grad`` before the queue is
        settled. Counted without a Python frame; looked at only when the count of those hooks changed."""
        queued = self.params.queued
        try:
            total = sum(map(len, map(_POST_HOOKS, map(_DEREF, map(_FIRST, queued)))))
        except (AttributeError, TypeError) as failure:  # a parameter gone, or its hooks cleared
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            total = -2
        if total == self.queued_hooks:
            return
        self.queued_hooks = total
        mine, direct = self.ledger.queue_release, self.params.grad_hook
        for ref, handle in queued:
            p = ref()
            hooks = getattr(p, "_post_accumulate_grad_hooks", None) if p is not None else None
            if hooks and hooks.get(handle.id) is mine and next(reversed(hooks)) != handle.id:
                hooks[handle.id] = direct  # memprof's own entry, replaced where it is: the order stays

    def entered(self, _grad_outputs: object) -> None:
        """The engine reached a forward's output: watch this backward's end (once per graph task)."""
        run = self.run
        if not run.active or run.phase is Phase.BACKWARD or _is_compiling():
            return  # (compiled autograd traces node hooks into its graph, where memprof's code must not enter)
        task = _graph_task_id()
        if task == -1 or task == self.queued_task:
            return
        self.queued_task = task
        queue_backward_callback(self.left)

    def left(self) -> None:
        """The engine's end, before memprof's end-of-backward callback: if no unpack began the backward, the
        gradients queued in it do, each at its own place (the backward's end callback is queued from here)."""
        run = self.run
        if run.active and run.phase is not Phase.BACKWARD and self.ledger.released:
            self.ledger.settle()
