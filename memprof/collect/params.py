"""Parameters and gradients: weights, what becomes a ``.grad``, and a model that changes.

Each parameter's storage is a weight; a post-accumulate-grad hook moves its
gradient into the gradients category as autograd stores it. A storage that
stops being any parameter's ``.grad`` (``zero_grad(set_to_none=True)`` while
someone still holds it) is an ordinary temporary again. Parameters and
submodules the model gains inside the block (a new head, lazy modules taking
their shapes) are adopted when they appear (:meth:`memprof.collect.modules.ModuleTracker.sync`),
and a note says from which step.
"""

from __future__ import annotations

import functools
import operator
import weakref
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ..errors import is_interrupt
from ..vocabulary import Phase
from .ledger import ACTIVATIONS, COMMUNICATION, GRADIENTS, INPUTS, TEMPORARIES, WEIGHTS, known_as
from .moves import move
from .state import EXACT
from .ledger import plain_storage_keys, storage_of
from .torch_compat import COMPILER as _COMPILER, in_compiled_autograd, is_dynamo_compiling as _dynamo_compiling

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .dispatch import StorageTracker
    from .ledger import Ledger
    from .phases import PhaseTracker
    from .state import Run
    from .undo import UndoStack

__all__ = ["ParamTracker", "is_lazy"]

_BACKWARD = Phase.BACKWARD
_PARAMETER = nn.Parameter
_PLAIN = torch.Tensor
_STRIDED = torch.strided
_DEREF = weakref.ref.__call__
_GRAD = operator.attrgetter("grad")
_NOT_NONE = functools.partial(operator.is_not, None)
# What a storage can be before autograd stores it as a gradient (DDP's gradient_as_bucket_view, FSDP's
# reduce-scatter output: a collective's buffer).
_BECOME_GRADIENTS = (TEMPORARIES, ACTIVATIONS, INPUTS, COMMUNICATION)


class ParamTracker:
    """The model's parameters and their gradients. ``while_paused`` is told of a gradient hook that ran
    while a schedule paused the profile (a step it does not watch may have ended)."""

    def __init__(self, ledger: "Ledger", run: "Run", storages: "StorageTracker", phases: "PhaseTracker",
                 stack: "UndoStack") -> None:
        self.ledger = ledger
        self.run = run
        self.storages = storages
        self.phases = phases
        self.stack = stack
        self.while_paused: "Callable[[], None] | None" = None
        self.refs: list[weakref.ref[nn.Parameter]] = []
        # id(parameter) -> its weak reference: an id is a parameter's only while that parameter lives.
        self.by_id: dict[int, weakref.ref[nn.Parameter]] = {}
        self.storage_keys: list["int | None"] = []  # each parameter's storage as last seen
        self.moved_at: "int | None" = None  # the step parameters first moved to new storages
        self.pending: list[weakref.ref[nn.Parameter]] = []  # lazy parameters not materialised yet
        self.grad_keys: set[int] = set()  # shared with the phase tracker, which reads it (never rebound)
        self.changed = False  # a module of the model registered a parameter or submodule since the last sync
        self.invisible_forwards = 0  # gradients of the model from forwards no module hook saw
        self.compiled_backwards = 0  # backwards compiled autograd ran: their gradients no gradient hook announced
        # The post-accumulate-grad hook. Light mode's is the ledger queue's own C append (no hook visit per
        # parameter and backward): settle() hands the parameter to grad_hook at its place among the releases, the
        # ledger as it was when autograd stored the gradient (engine_watch.py). Exact mode's is grad_hook itself.
        self.hook: "Callable[[torch.Tensor], None]" = self.grad_hook
        if run.mode != EXACT:
            self.hook, ledger.grad_arrived = ledger.queue_release, self.grad_hook
        self.queued: "list[tuple[weakref.ref[nn.Parameter], RemovableHandle]]" = []  # light mode's hooks

    def live(self) -> list[nn.Parameter]:
        return [p for p in (r() for r in self.refs) if p is not None]

    def holds(self, p: object) -> bool:
        """Is ``p`` one of the model's parameters memprof follows?"""
        ref = self.by_id.get(id(p))
        return ref is not None and ref() is p

    def adopt(self, p: nn.Parameter) -> None:
        """A parameter of the model: its storage is a weight and its gradient is watched."""
        if self.holds(p):
            return
        if is_lazy(p):
            if all(r() is not p for r in self.pending):
                self.pending.append(weakref.ref(p))
            return
        ref = weakref.ref(p)
        self.refs.append(ref)
        self.by_id[id(p)] = ref
        # Already a weight for the parameters that existed at the start; one made inside the block
        # (a new head, a materialised lazy parameter) was a temporary until now.
        self.storage_keys.append(self.weigh(p))
        if p.requires_grad:
            # torch's Tensor.register_post_accumulate_grad_hook is untyped.
            handle = p.register_post_accumulate_grad_hook(self.hook)  # type: ignore[no-untyped-call]
            self.stack.callback(handle.remove)
            if self.hook is self.ledger.queue_release:
                self.queued.append((ref, handle))

    def weigh(self, p: torch.Tensor) -> "int | None":
        """``p``'s storage is a weight from now on (also at the peaks of this phase, if it was made in it); its
        ledger key, or None off this device."""
        entry = self.storages.add_tensor(p, WEIGHTS)
        if entry is None:
            return None
        if entry.cat != WEIGHTS:
            move(self.ledger, entry, WEIGHTS, retro=True)
        return entry.key

    def resync_storages(self) -> None:
        """Parameters whose storage changed under them (``model.to(dtype)``, ``param.data = ...``,
        ``load_state_dict``): the new storage is a weight, the old one an ordinary tensor again."""
        keys = self.storage_keys
        if plain_storage_keys(list(map(_DEREF, self.refs))) == keys:
            return  # every step but the rare one: nothing moved, found without a Python loop
        led = self.ledger
        led.settle()
        changed = False
        for i, ref in enumerate(self.refs):
            p = ref()
            if p is None:
                continue
            # Runs for every parameter at every forward and optimizer step: storage_of() inlined for a plain
            # parameter (no wrapper subclass, whose counted storage is the one it wraps).
            if type(p) is _PARAMETER:
                try:
                    st = p.untyped_storage()
                except (RuntimeError, NotImplementedError) as failure:
                    if is_interrupt(failure):
                        raise  # a signal handler's exception (errors.is_interrupt) is the user's
                    st = None
            else:
                st = storage_of(p)
            if (st._cdata if st is not None else None) == keys[i]:
                continue
            changed = True
            was = self.storage_keys[i]
            old = led.entries.get(was) if was is not None else None
            self.storage_keys[i] = self.weigh(p)
            if old is not None and old.cat == WEIGHTS and old.key not in self.storage_keys:
                move(led, old, TEMPORARIES)
        if changed and self.moved_at is None:
            self.moved_at = self.run.step
            self.run.changes.append(f"step {self.moved_at}: parameters moved to new storages (model.to(...), "
                                     "param.data = ..., a state dict loaded with assign=True); the new ones are "
                                     "weights from then on")

    # -- gradients ------------------------------------------------------------------------

    def grad_hook(self, param: torch.Tensor) -> None:
        """Autograd stored ``param``'s gradient: called by autograd (exact mode), or by the ledger's settle() at
        the parameter's place in its queue (light mode, :attr:`hook`), the queue before it applied."""
        run = self.run
        if not run.active:
            if run.paused and self.while_paused is not None:
                self.while_paused()
            return
        led = self.ledger
        if not led.settling:
            # Called by autograd. Under dynamo's tracing memprof's code must not enter the graph; and what torch
            # released first is applied: a gradient's storage may have the address of one freed since.
            if _dynamo_compiling() or _COMPILER._is_compiling_flag:  # is_compiling(), in one frame
                return
            if led.released:
                led.settle()
        if not run.forward_seen and not run.foreign_threads:
            # A gradient of the model from a forward memprof's module hooks never saw: a torch.compile
            # wrapper of this model ran (its hooks are inside compiled code), or the forward ran
            # before the profile. What that forward saved was never seen. (A forward in another thread
            # was seen, from outside: its own note says why what it saved is not measured.)
            self.invisible_forwards += 1
        if run.phase is not _BACKWARD:
            self.phases.backward_started()
        g = param.grad
        if g is None:
            return
        if type(g) is _PLAIN and g.layout is _STRIDED and (g.is_cpu if run.on_cpu else g.device == run.device):
            # add_grad() written out for a plain gradient on the profiled device: one frame less for each
            # parameter in every backward.
            try:
                st = g.untyped_storage()
            except (RuntimeError, NotImplementedError) as failure:
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                return
            entry = led.entries.get(st._cdata)
            if entry is None:
                entry = led.add(st, GRADIENTS)
            elif entry.cat in _BECOME_GRADIENTS:
                move(led, entry, GRADIENTS, retro=True)
            if entry.cat == GRADIENTS:
                self.grad_keys.add(entry.key)
            return
        self.add_grad(g, retro=True)

    def add_grad(self, g: torch.Tensor, *, retro: bool, follow: bool = True) -> None:
        """``g`` is a gradient now. ``follow``: it is a followed parameter's ``.grad``, an ordinary
        tensor again once it stops being one (release_stale_grads); FSDP's unsharded gradients are not."""
        run = self.run
        if type(g) is _PLAIN and g.layout is _STRIDED and (g.is_cpu if run.on_cpu else g.device == run.device):
            # Once per parameter in every backward and at every step: a plain gradient on the profiled device,
            # known (an op's output in exact mode) or new (light mode), is registered with no call into add_tensor.
            try:
                st = g.untyped_storage()
            except (RuntimeError, NotImplementedError) as failure:
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                return
            led = self.ledger
            entry = led.entries.get(st._cdata)
            if entry is None:
                entry = led.add(st, GRADIENTS)
        else:
            entry = self.storages.add_tensor(g, GRADIENTS)
        # A gradient that lives in a collective's buffer (DDP's gradient_as_bucket_view, FSDP's
        # reduce-scatter output) is a gradient.
        if entry is not None and entry.cat in _BECOME_GRADIENTS:
            move(self.ledger, entry, GRADIENTS, retro=retro)
        if follow and entry is not None and entry.cat == GRADIENTS:
            self.grad_keys.add(entry.key)

    def backward_began(self) -> None:
        """A backward begins: counted if compiled autograd runs it, which traces memprof's gradient hook into its
        graph (where the hook does nothing), so that its gradients are found at the step (the report says so)."""
        if in_compiled_autograd():
            self.compiled_backwards += 1

    def walk_grads(self) -> None:
        """Every parameter's ``.grad`` is a gradient (at backward's end and before a step)."""
        self.ledger.settle()
        entries = self.ledger.entries
        grad_keys = self.grad_keys
        keys = self.grad_storage_keys()
        if keys is not None and grad_keys.issuperset(keys) and known_as(entries, keys, GRADIENTS):
            return  # the common case, every gradient followed already: found without a Python loop
        in_backward = self.run.phase is _BACKWARD
        for ref in self.refs:
            p = ref()
            g = p.grad if p is not None else None
            if g is None:
                continue
            if type(g) is _PLAIN and g.layout is _STRIDED:
                # The common case, a gradient followed already: nothing to do, and no call to find that out.
                try:
                    key = g.untyped_storage()._cdata
                except (RuntimeError, NotImplementedError) as failure:
                    if is_interrupt(failure):
                        raise  # a signal handler's exception (errors.is_interrupt) is the user's
                    key = None
            else:
                # A subclass (a DTensor's, whose counted storage is its local shard's) or a sparse gradient.
                st = storage_of(g)
                key = st._cdata if st is not None else None
            if key in grad_keys:
                entry = entries.get(key)
                if entry is not None and entry.cat == GRADIENTS:
                    continue
            # A gradient no hook announced while the backward that made it is still the phase: one compiled
            # autograd made (it traces memprof's gradient hook into its graph, where the hook does nothing, so the
            # step's pre-hook is the first to see it), or one set by assignment, which no AccumulateGrad announces
            # (FSDP2's reduce-scatter output given to the sharded parameter, p.grad = g after torch.autograd.grad).
            # Either was made in this backward, so its peak names it a gradient, as the hook's own retro move
            # would have; a gradient set by hand after backward (another phase) was something else until then.
            self.add_grad(g, retro=in_backward)

    def grad_storage_keys(self) -> "list[int] | None":
        """The storage keys of the parameters' gradients (None where a parameter has none), when every
        parameter lives and every gradient is a plain tensor; None otherwise."""
        try:
            grads = list(filter(_NOT_NONE, map(_GRAD, map(_DEREF, self.refs))))
        except AttributeError as failure:  # a parameter that died
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            return None
        return plain_storage_keys(grads)

    def release_stale_grads(self) -> None:
        """A storage that is no parameter's .grad any more (zero_grad(set_to_none=True)
        while the user still holds it) is an ordinary tensor again."""
        if not self.grad_keys:
            return
        keys = self.grad_storage_keys()
        current = set(keys) if keys is not None else walk_grad_keys(self.refs)
        led = self.ledger
        led.settle()
        for key in self.grad_keys - current:  # the set difference in C: most steps nothing is stale
            self.grad_keys.discard(key)
            entry = led.entries.get(key)
            if entry is not None and entry.cat == GRADIENTS:
                move(led, entry, TEMPORARIES)


def walk_grad_keys(refs: "list[weakref.ref[nn.Parameter]]") -> set[int]:
    """The storage keys of the gradients of the parameters ``refs`` refers to, one by one (what
    :meth:`ParamTracker.grad_storage_keys` cannot answer: a dead parameter, a subclass, a sparse gradient)."""
    current: set[int] = set()
    for ref in refs:
        p = ref()
        g = p.grad if p is not None else None
        if g is None:
            continue
        if type(g) is _PLAIN and g.layout is _STRIDED:  # storage_of() inlined: every parameter, every step
            try:
                current.add(g.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError) as failure:
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                pass
            continue
        parts = (g._values(), g._indices()) if g.is_sparse else (g,)
        for part in parts:
            st = storage_of(part)
            if st is not None:
                current.add(st._cdata)
    return current


def is_lazy(p: torch.Tensor) -> bool:
    """A parameter of a lazy module (nn.LazyLinear ...) before its first forward gives it a shape."""
    return nn.parameter.is_lazy(p)
