"""What autograd saves outside memprof's pushes: found on the graph when backward starts, and while
checkpointed regions are recomputed in backward.

memprof pushes its saved-tensor pair only around the model's module calls (:mod:`.saved_hooks` says why),
so what code outside them saves (the loss above all) reaches no pack of memprof's. In exact mode, when
backward starts, the autograd graph is walked from the node the engine runs first: a saved tensor that no
pair packed is such a save, and its storage becomes an activation until its node has run.

Activation checkpointing saves nothing in forward; in backward, torch's own pair stores what a
non-reentrant region recomputes out of sight, so what is created while that pair is on top and still
alive when it leaves is what checkpoint keeps for this backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ..errors import is_interrupt
from .ledger import ACTIVATIONS, TAGS, TEMPORARIES, storage_of
from .moves import move, set_tag
from .saved_hooks import _Chain, is_checkpoint_pair, tensors_in
from .torch_compat import current_autograd_node, graph_task_id as _graph_task_id
from .torch_compat import top_saved_hooks as _top_saved_hooks

if TYPE_CHECKING:
    from torch.autograd.graph import Node
    from torch.utils.hooks import RemovableHandle

    from .ledger import Ledger
    from .saved import SavedTracker
    from .state import Run

__all__ = ["GraphSaves"]

_RECOMPUTED = TAGS.index("recomputed_for_backward")
_TAG_SAVED_OUTSIDE = TAGS.index("saved_outside_modules")
_TAG_WEIGHT_COPY = TAGS.index("autocast_weight_copy")
# The graph walk stops after this many nodes (a safety bound far above real graphs).
_MAX_NODES = 1_000_000


class GraphSaves:
    """Saves outside memprof's pushes, found on the autograd graph; checkpoint's recomputation in backward.

    ``saved`` is the accounting whose pairs packed what is *not* to be counted again here; the hooks this
    registers on graph nodes go on ``node_hooks``, removed when the step ends (its backward has run) or
    with the profile.
    """

    def __init__(self, ledger: "Ledger", run: "Run", saved: "SavedTracker", node_hooks: "list[RemovableHandle]"
                 ) -> None:
        self.ledger = ledger
        self.run = run
        self.saved = saved
        self.node_hooks = node_hooks
        self.device = run.device
        self.on_cpu = run.on_cpu
        self.recomputing = False
        self.recompute_start = 0
        # Storages the graph holds that were saved outside memprof's pushes: key -> nodes holding it.
        self.graph_saved: dict[int, int] = {}
        # Graph tasks whose graph was searched, the most recent few (a task id is not reused while
        # its backward runs, and a run has millions of them).
        self.walked_tasks: dict[int, None] = {}

    # -- checkpoint recomputation in backward ------------------------------------------------

    def watch_recompute(self) -> None:
        """Every op in backward (exact mode). A graph task not seen before (a nested backward, such as a
        reentrant checkpoint's over its recomputed block) gets its outside saves found; torch.utils.
        checkpoint's pair on top of the stack means a checkpointed region is being recomputed under its
        hooks (which store what it saves out of our sight)."""
        task = _graph_task_id()
        if task != -1 and task not in self.walked_tasks:
            self.find_outside_saves()
        foreign = is_checkpoint_pair(_top_saved_hooks(False))
        if foreign and not self.recomputing:
            self.recomputing = True
            self.recompute_start = self.ledger.seq
        elif not foreign and self.recomputing:
            self.recomputing = False
            self.flush_recompute()

    def flush_recompute(self) -> None:
        # Storages created while a checkpointed region was recomputed in
        # backward under checkpoint's own saved-tensor hooks, still alive
        # now, are what checkpoint saved for this backward.
        start = self.recompute_start
        led = self.ledger
        led.settle()
        for entry in list(led.entries.values()):
            if entry.created > start and entry.cat == TEMPORARIES:
                move(led, entry, ACTIVATIONS)
                set_tag(led, entry, _RECOMPUTED)
                entry.saved = -1  # held by checkpoint, released as backward unpacks it

    # -- what code outside the model saved ------------------------------------------------------

    def find_outside_saves(self) -> None:
        """Backward is starting (exact mode): what autograd saved outside memprof's pushes, the loss
        above all, becomes activations before the forward's record closes.

        From the node the engine runs first, every node of the graph is visited once; a saved
        tensor without an unpack hook was saved with no pair on the stack, i.e. outside the
        model's calls. Only storages memprof made a temporary move; storages from before the
        profile, and anything packed by a pair, are left as they are.
        """
        node = current_autograd_node()
        task = _graph_task_id()
        if node is None or task in self.walked_tasks:
            return
        self.walked_tasks[task] = None
        if len(self.walked_tasks) > 16:
            del self.walked_tasks[next(iter(self.walked_tasks))]
        led = self.ledger
        led.settle()
        found: list[int] = []
        seen: set[int] = set()
        todo: "list[Node | None]" = [node]
        saved = self.saved
        names_of = _SAVED_NAMES
        # Once per backward, over every node of the graph: the per-node work is inlined and the next nodes
        # pushed by a loop, not a generator (each would be a Python frame per node).
        while todo and len(seen) < _MAX_NODES:
            n = todo.pop()
            if n is None or id(n) in seen:
                continue
            seen.add(id(n))
            keys = []
            names = names_of.get(type(n))
            if names is None:
                names = _saved_names(type(n))
            for name in names:
                try:
                    value = getattr(n, name)
                except RuntimeError as failure:  # released already
                    if is_interrupt(failure):
                        raise  # a signal handler's exception (errors.is_interrupt) is the user's
                    continue
                for raw in value if isinstance(value, (list, tuple)) else (value,):
                    if raw is None:
                        continue
                    # Went through one of memprof's pairs (counted when it was packed)?
                    hook = getattr(raw, "unpack_hook", None)
                    if hook is not None:
                        owner = getattr(hook, "__self__", None)
                        if owner is saved or (type(owner) is _Chain and owner.owner is saved):
                            continue
                    try:
                        # With no pair, the tensor itself; under a pair of the user's, what its pack
                        # returned, which the graph keeps (memprof counts the tensors in it).
                        data = raw.data
                    except RuntimeError as failure:
                        if is_interrupt(failure):
                            raise  # a signal handler's exception (errors.is_interrupt) is the user's
                        continue
                    held: list[torch.Tensor] = []
                    tensors_in(data, held)
                    for t in held:
                        st = storage_of(t) if (t.is_cpu if self.on_cpu else t.device == self.device) else None
                        entry = led.entries.get(st._cdata) if st is not None else None
                        if entry is not None and entry.cat in (TEMPORARIES, ACTIVATIONS) and entry.saved <= 0:
                            if entry.cat == TEMPORARIES:
                                move(led, entry, ACTIVATIONS, retro=True)
                                if entry.where < 0 and entry.tag != _TAG_WEIGHT_COPY:
                                    set_tag(led, entry, _TAG_SAVED_OUTSIDE)
                            entry.saved = -1  # held by the graph; released when its node has run
                            self.graph_saved[entry.key] = self.graph_saved.get(entry.key, 0) + 1
                            keys.append(entry.key)
            if keys:
                found.extend(keys)
                # When the node has run, the engine releases what it saved (unless retain_graph).
                self.node_hooks.append(n.register_hook(_released(self, tuple(keys))))
            for nxt, _i in n.next_functions:
                todo.append(nxt)

    def graph_released(self, keys: tuple[int, ...]) -> None:
        if not self.run.active:
            return
        led = self.ledger
        led.settle()
        for key in keys:
            left = self.graph_saved.get(key, 0) - 1
            if left > 0:
                self.graph_saved[key] = left
                continue
            self.graph_saved.pop(key, None)
            entry = led.entries.get(key)
            if entry is not None and entry.cat == ACTIVATIONS and entry.saved < 0:
                move(led, entry, TEMPORARIES)  # someone else still holds it (the model's output, say)


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(cls: type) -> tuple[str, ...]:
    """The attributes of an autograd node class that give its raw saved tensors (no unpacking)."""
    names = _SAVED_NAMES.get(cls)
    if names is None:
        names = _SAVED_NAMES[cls] = tuple(a for a in dir(cls) if a.startswith("_raw_saved_"))
    return names


def _released(graph: GraphSaves, keys: tuple[int, ...]) -> Callable[[object, object], None]:
    def hook(_grad_inputs: object, _grad_outputs: object) -> None:
        graph.graph_released(keys)
    return hook
