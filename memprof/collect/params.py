"""Parameters and gradients: weights, what becomes a ``.grad``, and a model that changes.

Each parameter's storage is a weight; a post-accumulate-grad hook moves its
gradient into the gradients category as autograd stores it. A storage that
stops being any parameter's ``.grad`` (``zero_grad(set_to_none=True)`` while
someone still holds it) is an ordinary temporary again. Parameters and
submodules the model gains inside the block (a new head, lazy modules taking
their shapes) are adopted when they appear, and a note says from which step.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..vocabulary import Phase
from ..units import format_bytes
from .ledger import ACTIVATIONS, COMMUNICATION, GRADIENTS, INPUTS, TEMPORARIES, WEIGHTS, storage_of

if TYPE_CHECKING:
    from .profiler import Profiler

__all__ = ["ParamTracker", "is_lazy"]

_BACKWARD = Phase.BACKWARD
_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


class ParamTracker:
    """The model's parameters and their gradients."""

    def __init__(self, prof: "Profiler") -> None:
        self.prof = prof
        self.ledger = prof.ledger
        self.refs: list[weakref.ref] = []
        # id(parameter) -> its weak reference: an id is a parameter's only while that parameter lives.
        self.by_id: dict[int, weakref.ref] = {}
        self.storage_keys: list["int | None"] = []  # each parameter's storage as last seen
        self.moved_at: "int | None" = None  # the step parameters first moved to new storages
        self.pending: list[weakref.ref] = []  # lazy parameters not materialised yet
        self.grad_keys: set[int] = set()
        self.changed = False  # a module of the model registered a parameter or submodule
        self.invisible_forwards = 0  # gradients of the model from forwards no module hook saw

    def live(self) -> list[nn.Parameter]:
        return [p for p in (r() for r in self.refs) if p is not None]

    def holds(self, p: Any) -> bool:
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
            stack = self.prof.stack
            assert stack is not None
            stack.callback(p.register_post_accumulate_grad_hook(self.grad_hook).remove)

    def weigh(self, p: torch.Tensor) -> "int | None":
        """``p``'s storage is a weight from now on (also at the peaks of this phase, if it was made in it); its
        ledger key, or None off this device."""
        entry = self.prof.storages.add_tensor(p, WEIGHTS)
        if entry is None:
            return None
        if entry.cat != WEIGHTS:
            self.ledger.move(entry, WEIGHTS, retro=True)
        return entry.key

    def resync_storages(self) -> None:
        """Parameters whose storage changed under them (``model.to(dtype)``, ``param.data = ...``,
        ``load_state_dict``): the new storage is a weight, the old one an ordinary tensor again."""
        led = self.ledger
        changed = False
        for i, ref in enumerate(self.refs):
            p = ref()
            st = storage_of(p) if p is not None else None
            key = st._cdata if st is not None else None
            if p is None or key == self.storage_keys[i]:
                continue
            changed = True
            old = led.entries.get(self.storage_keys[i]) if self.storage_keys[i] is not None else None
            self.storage_keys[i] = self.weigh(p)
            if old is not None and old.cat == WEIGHTS and old.key not in self.storage_keys:
                led.move(old, TEMPORARIES)
        if changed and self.moved_at is None:
            self.moved_at = self.prof.phases.step
            self.prof.changes.append(f"step {self.moved_at}: parameters moved to new storages (model.to(...), "
                                     "param.data = ..., a state dict loaded with assign=True); the new ones are "
                                     "weights from then on")

    # -- gradients ------------------------------------------------------------------------

    def grad_hook(self, param: torch.Tensor) -> None:
        prof = self.prof
        if not prof.active:
            if prof.windows is not None and prof.windows.paused:
                prof.windows.backward_ran_while_paused()
            return
        if _is_compiling():
            return
        if not prof.phases.forward_seen and not prof.modules.foreign_threads:
            # A gradient of the model from a forward memprof's module hooks never saw: a torch.compile
            # wrapper of this model ran (its hooks are inside compiled code), or the forward ran
            # before the profile. What that forward saved was never seen. (A forward in another thread
            # was seen, from outside: its own note says why what it saved is not measured.)
            self.invisible_forwards += 1
        if prof.phases.current is not _BACKWARD:
            prof.phases.backward_started()
        g = param.grad
        if g is not None:
            self.add_grad(g, retro=True)

    def add_grad(self, g: torch.Tensor, *, retro: bool, follow: bool = True) -> None:
        """``g`` is a gradient now. ``follow``: it is a followed parameter's ``.grad``, an ordinary
        tensor again once it stops being one (release_stale_grads); FSDP's unsharded gradients are not."""
        entry = self.prof.storages.add_tensor(g, GRADIENTS)
        # A gradient that lives in a collective's buffer (DDP's gradient_as_bucket_view, FSDP's
        # reduce-scatter output) is a gradient.
        if entry is not None and entry.cat in (TEMPORARIES, ACTIVATIONS, INPUTS, COMMUNICATION):
            self.ledger.move(entry, GRADIENTS, retro=retro)
        if follow and entry is not None and entry.cat == GRADIENTS:
            self.grad_keys.add(entry.key)

    def walk_grads(self) -> None:
        for ref in self.refs:
            p = ref()
            if p is not None and p.grad is not None:
                self.add_grad(p.grad, retro=False)

    def release_stale_grads(self) -> None:
        """A storage that is no parameter's .grad any more (zero_grad(set_to_none=True)
        while the user still holds it) is an ordinary tensor again."""
        if not self.grad_keys:
            return
        current: set[int] = set()
        for ref in self.refs:
            p = ref()
            g = p.grad if p is not None else None
            if g is None:
                continue
            parts = (g._values(), g._indices()) if g.is_sparse else (g,)
            for part in parts:
                st = storage_of(part)
                if st is not None:
                    current.add(st._cdata)
        led = self.ledger
        for key in list(self.grad_keys):
            if key in current:
                continue
            self.grad_keys.discard(key)
            entry = led.entries.get(key)
            if entry is not None and entry.cat == GRADIENTS:
                led.move(entry, TEMPORARIES)

    # -- a model that changes ------------------------------------------------------------------

    def registration_hook(self, module: nn.Module, name: str, value: Any) -> None:
        # Global: fires for every module in the process. Only the model's matter; what changed
        # is adopted at the next point where the model is not running (a forward's start, a step).
        if self.prof.active and id(module) in self.prof.modules.index and value is not None:
            self.changed = True

    def sync(self) -> None:
        """Adopt parameters and modules the model gained since the last look, and lazy parameters."""
        prof = self.prof
        modules = prof.modules
        model = modules.root_ref()
        if model is None:
            return
        before_params, before_mods = len(self.refs), len(modules.info)
        if self.pending:
            pending = [r() for r in self.pending]
            self.pending = []
            for p in pending:
                if p is not None:
                    self.adopt(p)
        if self.changed:
            self.changed = False
            modules.adopt(model)
        new_params = [p for p in (r() for r in self.refs[before_params:]) if p is not None]
        new_mods = len(modules.info) - before_mods
        phases = prof.phases
        if new_params and phases.ops == phases.phase_ops_start:
            phases.phase_start = self.ledger.totals.copy()  # the phase has just begun: it starts with them
        if new_params or new_mods:
            nbytes = sum(self.ledger.size_of(st.nbytes()) for st in map(storage_of, new_params) if st is not None)
            what = [f"{len(new_params)} parameter(s) ({format_bytes(nbytes)})"] if new_params else []
            if new_mods:
                what.append(f"{new_mods} module(s)")
            prof.changes.append(f"step {phases.step}: " + " and ".join(what))


def is_lazy(p: torch.Tensor) -> bool:
    """A parameter of a lazy module (nn.LazyLinear ...) before its first forward gives it a shape."""
    return isinstance(p, nn.parameter.UninitializedTensorMixin)
