"""Saved tensors: what autograd holds for backward becomes an activation, and where it was saved.

memprof's pack hook (pushed and chained as :mod:`.saved_hooks` explains) hands
each tensor autograd keeps to :meth:`SavedTracker.account`: its storage moves
from temporaries to activations, and carries two tags for the reconciler's
causes, *what* it is (set by the op that made it) and *where* it was saved
from: outside the model, in a container's own code, in a leaf module without
a saved-bytes rule, or by rule modules that count more or less than the
storage (two modules saving it, an expanded view, a view of a larger
storage). When autograd releases its last slot the storage is an ordinary
temporary again.

Activation checkpointing saves nothing in forward; in backward, torch's own
pair stores what a non-reentrant region recomputes out of sight, so what is
created while that pair is on top and still alive when it leaves is what
checkpoint keeps for this backward.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..vocabulary import Phase
from .ledger import ACTIVATIONS, COMMUNICATION, INPUTS, TAGS, TEMPORARIES, Entry, storage_of

_RECOMPUTED = TAGS.index("recomputed_for_backward")
from .saved_hooks import Saved, SavedHooks, _Chain, is_checkpoint_pair, tensors_in
from .saved_hooks import unpack as unpack_saved

if TYPE_CHECKING:
    from .profiler import Profiler

__all__ = ["SavedTracker"]

_FORWARD = Phase.FORWARD
_BACKWARD = Phase.BACKWARD
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_top_saved_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _ignore: None)
_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", lambda: -1)
_NoPythonDispatch = getattr(torch._C, "_DisableTorchDispatch", contextlib.nullcontext)
_TAG = {name: i for i, name in enumerate(TAGS)}
_TAG_SAVED_OUTSIDE = _TAG["saved_outside_modules"]
_TAG_SAVED_TWICE = _TAG["saved_by_two_modules"]
_TAG_WEIGHT_COPY = _TAG["autocast_weight_copy"]
_TAG_SAVED_AS_VIEW = _TAG["saved_as_view_of_larger"]
_TAG_SAVED_EXPANDED = _TAG["saved_as_expanded_view"]
# "Where" tags that describe what the rule modules saving a storage count (or no tag yet).
_WHERE_BY_RULES = (-1, _TAG_SAVED_TWICE, _TAG_SAVED_AS_VIEW, _TAG_SAVED_EXPANDED)


class SavedTracker:
    """Accounts for what autograd saves; owns memprof's saved-tensor pushes."""

    def __init__(self, prof: "Profiler") -> None:
        self.prof = prof
        self.ledger = prof.ledger
        self.device = prof.device
        self.on_cpu = prof.device.type == "cpu"
        self.full = prof.mode == "full"
        self.hooks = SavedHooks(self)
        self.scoped: list[int] = []  # module calls whose forward holds a scoped push
        self.recomputing = False
        self.recompute_start = 0
        # The model's inputs saved by modules with a rule in the formula's forward:
        # (module, storage key) -> bytes saved.
        self.saved_inputs: dict[tuple[int, int], int] = {}
        # Storages the graph holds that were saved outside memprof's pushes: key -> nodes holding it.
        self.graph_saved: dict[int, int] = {}
        # Graph tasks whose graph was searched, the most recent few (a task id is not reused while
        # its backward runs, and a run has millions of them).
        self.walked_tasks: dict[int, None] = {}

    # -- memprof's own pair ---------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        # memprof's own pack (no user pair beneath): runs for every tensor autograd saves.
        if _is_compiling():
            return t  # dynamo tracing through autograd: its fake tensors are not memory
        key = self.account(t)
        origin = weakref.ref(t) if t.grad_fn is not None else None
        if key is not None:
            return Saved(self.detached(t), self, key, t._version, origin)
        # Weights, inputs, buffers: a tensor without grad_fn cannot close a reference cycle.
        return Saved(t if origin is None else self.detached(t), None, 0, t._version, origin)

    def unpack(self, saved: Any) -> torch.Tensor:
        self.unpacking()
        return unpack_saved(saved)

    def unpacking(self) -> None:
        # The first unpack of a backward pass can come before any gradient hook
        # (the loss's own backward): it starts the backward phase in light mode.
        phases = self.prof.phases
        if phases.current is not _BACKWARD and self.prof.active and _graph_task_id() != -1:
            phases.backward_started()

    def detached(self, t: torch.Tensor) -> torch.Tensor:
        # In full mode this detach would go through memprof's own dispatch mode, which does
        # nothing with it but costs the Python dispatch round trip (~5 us, a saved tensor or
        # more per op). When that mode is the only one and ``t`` a plain tensor, no Python
        # code wants to see it; a subclass or another mode still gets its detach.
        if self.full and type(t) is torch.Tensor and _dispatch_stack_len() == 1:
            with _NoPythonDispatch():
                return t.detach()
        return t.detach()

    # -- accounting -------------------------------------------------------------------

    def account(self, t: torch.Tensor) -> "int | None":
        """Ledger work for a tensor autograd now holds: returns its storage's key when that is
        a counted activation (the caller's slot must release it through :meth:`unsaved`)."""
        prof = self.prof
        if not prof.active or t.layout is not torch.strided or (
                not t.is_cpu if self.on_cpu else t.device != self.device):
            return None
        st = storage_of(t)
        if st is None:
            return None
        led = self.ledger
        modules = prof.modules
        entry = led.entries.get(st._cdata)
        if entry is None:
            # Full mode saw every op output, so an unknown storage came from outside the profile
            # (an input) or from compiled code, which allocates out of dispatch's sight. Light mode
            # sees no op outputs, so an unknown storage that autograd saves is an activation.
            made_here = not self.full or modules.compiled_depth > 0
            entry = led.add(st, ACTIVATIONS if made_here else INPUTS)
            if entry.cat == ACTIVATIONS:
                self.attribute(entry)
            elif modules.stack:
                modules.unseen_saves.append(entry.key)  # an input, unless its call turns out compiled
        elif entry.cat == TEMPORARIES or entry.cat == COMMUNICATION:
            # A collective's output that the next layer saves (tensor parallelism's all-reduce) is an
            # activation from then on, as any op output autograd keeps.
            led.move(entry, ACTIVATIONS)
            self.attribute(entry)
        stack = modules.stack
        if stack and prof.phases.current is _FORWARD and modules.saved_tag[stack[-1]] < 0:
            view = t.nbytes
            if entry.savers is None and view == entry.nbytes and entry.where < 0 and entry.cat == ACTIVATIONS:
                entry.savers = {stack[-1]: view}  # the common case: first saved whole, by a rule module
            else:
                self.saved_by_rule_module(entry, stack[-1], view)
        if entry.cat == ACTIVATIONS:
            if entry.saved < 0:
                entry.saved = 0
            entry.saved += 1
            return entry.key
        return None

    def saved_by_rule_module(self, entry: Entry, index: int, view_bytes: int) -> None:
        """Account for what the per-module formula counts: each rule counts the tensor its module
        saves (a view's bytes), once per module, whatever storage it shares."""
        if entry.cat == INPUTS:
            if self.prof.modules.capture:
                # The model's inputs that a module with a rule saves: its rule counts them as activations.
                key = (index, entry.key)
                self.saved_inputs[key] = max(view_bytes, self.saved_inputs.get(key, 0))
            return
        if entry.cat != ACTIVATIONS:
            return
        savers = entry.savers
        if savers is None:
            savers = entry.savers = {}
        elif savers.get(index, 0) >= view_bytes:
            return
        savers[index] = view_bytes
        # What the rules of the modules that saved it count, against the storage memprof counts once.
        covered = sum(savers.values())
        where = entry.where
        led = self.ledger
        if covered > entry.nbytes:
            # Rules count more than the storage holds: several modules saved it (ReLU's output, the next
            # Linear's input; q, k and v projections of one tensor), or one saved an expanded view of it.
            tag = _TAG_SAVED_TWICE if len(savers) > 1 else _TAG_SAVED_EXPANDED
            led.set_tag(entry, tag, covered - entry.nbytes)
        elif where in _WHERE_BY_RULES:
            if covered < entry.nbytes:
                # Rules count the views their modules saved (x[:, 0]); memprof, the whole storage.
                led.set_tag(entry, _TAG_SAVED_AS_VIEW, entry.nbytes - covered)
            elif where >= 0:
                led.set_tag(entry, where, 0)
        else:
            # First saved where no rule sees it (container code, a module without a rule, outside the
            # model): that cause names only what the rules of later savers do not count.
            led.set_tag(entry, where, entry.nbytes - covered)

    def attribute(self, entry: Entry) -> None:
        """Where a new activation was saved from, for the per-module formula's causes and the module table.

        An autocast weight copy has a cause of its own in every comparison, so it gets no "where"
        that would name it twice.
        """
        where = entry.where < 0 and entry.tag != _TAG_WEIGHT_COPY
        prof = self.prof
        modules = prof.modules
        stack = modules.stack
        phase = prof.phases.current
        if not stack:
            if where and phase is _FORWARD:
                self.ledger.set_tag(entry, _TAG_SAVED_OUTSIDE)
            return
        if phase is not _FORWARD:
            # Recomputation in backward (a reentrant checkpoint's block): not the module's forward saving,
            # but what the recomputed block keeps for its part of backward.
            if where:
                self.ledger.set_tag(entry, _RECOMPUTED)
            return
        index = stack[-1]
        if where:
            tag = modules.saved_tag[index]
            if tag >= 0:
                self.ledger.set_tag(entry, tag)
        modules.saved_in(index, entry.nbytes, prof.phases.step)

    def unsaved(self, key: int) -> None:
        if not self.prof.active:
            return
        entry = self.ledger.entries.get(key)
        if entry is None or entry.cat != ACTIVATIONS:
            return
        entry.saved -= 1
        if entry.saved == 0:
            # Autograd released its last reference; whoever still holds the
            # storage holds an ordinary tensor.
            self.ledger.move(entry, TEMPORARIES)

    def adopt_unseen(self, keys: list[int]) -> None:
        """Storages saved as inputs that turn out to come from compiled code: activations after all."""
        led = self.ledger
        for key in keys:
            entry = led.entries.get(key)
            if entry is not None and entry.cat == INPUTS:
                led.move(entry, ACTIVATIONS, retro=True)
                if entry.saved < 0:
                    entry.saved = 0
                self.attribute(entry)

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
        for entry in list(led.entries.values()):
            if entry.created > start and entry.cat == TEMPORARIES:
                led.move(entry, ACTIVATIONS)
                led.set_tag(entry, _RECOMPUTED)
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
        node = _current_node()
        task = _graph_task_id()
        if node is None or task in self.walked_tasks:
            return
        self.walked_tasks[task] = None
        if len(self.walked_tasks) > 16:
            del self.walked_tasks[next(iter(self.walked_tasks))]
        led = self.ledger
        found: list[int] = []
        seen: set[int] = set()
        todo = [node]
        while todo and len(seen) < _MAX_NODES:
            n = todo.pop()
            if n is None or id(n) in seen:
                continue
            seen.add(id(n))
            keys = []
            for name in _saved_names(type(n)):
                try:
                    value = getattr(n, name)
                except RuntimeError:  # released already
                    continue
                for raw in value if isinstance(value, (list, tuple)) else (value,):
                    if raw is None or self._packed_by_us(raw):
                        continue
                    try:
                        # With no pair, the tensor itself; under a pair of the user's, what its pack
                        # returned, which the graph keeps (memprof counts the tensors in it).
                        data = raw.data
                    except RuntimeError:
                        continue
                    held: list[torch.Tensor] = []
                    tensors_in(data, held)
                    for t in held:
                        st = storage_of(t) if (t.is_cpu if self.on_cpu else t.device == self.device) else None
                        entry = led.entries.get(st._cdata) if st is not None else None
                        if entry is not None and entry.cat in (TEMPORARIES, ACTIVATIONS) and entry.saved <= 0:
                            if entry.cat == TEMPORARIES:
                                led.move(entry, ACTIVATIONS, retro=True)
                                if entry.where < 0 and entry.tag != _TAG_WEIGHT_COPY:
                                    led.set_tag(entry, _TAG_SAVED_OUTSIDE)
                            entry.saved = -1  # held by the graph; released when its node has run
                            self.graph_saved[entry.key] = self.graph_saved.get(entry.key, 0) + 1
                            keys.append(entry.key)
            if keys:
                found.extend(keys)
                # When the node has run, the engine releases what it saved (unless retain_graph).
                self.prof.modules.node_hooks.append(n.register_hook(_released(self, tuple(keys))))
            todo.extend(nxt for nxt, _i in n.next_functions)

    def _packed_by_us(self, raw: Any) -> bool:
        """Whether a saved tensor went through one of memprof's pairs (counted when it was packed)."""
        hook = getattr(raw, "unpack_hook", None)
        if hook is None:
            return False
        owner = getattr(hook, "__self__", None)
        return owner is self or (type(owner) is _Chain and owner.owner is self)

    def graph_released(self, keys: tuple[int, ...]) -> None:
        if not self.prof.active:
            return
        led = self.ledger
        for key in keys:
            left = self.graph_saved.get(key, 0) - 1
            if left > 0:
                self.graph_saved[key] = left
                continue
            self.graph_saved.pop(key, None)
            entry = led.entries.get(key)
            if entry is not None and entry.cat == ACTIVATIONS and entry.saved < 0:
                led.move(entry, TEMPORARIES)  # someone else still holds it (the model's output, say)

    # -- the pushes, per module call ----------------------------------------------------------

    def cover(self, index: int) -> None:
        """A module call: make memprof's pack the one autograd calls during it (see saved_hooks)."""
        top = _top_saved_hooks(False)
        # The common case first: memprof's own pair is already the innermost one.
        if (top is None or top[0] is not self.hooks.own_pack) and self.hooks.cover():
            self.scoped.append(index)

    def uncover(self, index: int) -> None:
        if self.scoped and self.scoped[-1] == index:
            self.scoped.pop()
            self.hooks.uncover()


# The graph walk stops after this many nodes (a safety bound far above real graphs).
_MAX_NODES = 1_000_000
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)
_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(cls: type) -> tuple[str, ...]:
    """The attributes of an autograd node class that give its raw saved tensors (no unpacking)."""
    names = _SAVED_NAMES.get(cls)
    if names is None:
        names = _SAVED_NAMES[cls] = tuple(a for a in dir(cls) if a.startswith("_raw_saved_"))
    return names


def _released(tracker: SavedTracker, keys: tuple[int, ...]) -> Any:
    def hook(_grad_inputs: Any, _grad_outputs: Any) -> None:
        tracker.graph_released(keys)
    return hook
