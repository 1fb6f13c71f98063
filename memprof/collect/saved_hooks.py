"""memprof's saved-tensor hooks: pushed in balanced scopes, chained to the pair beneath.

torch calls only the innermost pair of ``saved_tensors_hooks``. A pair that
memprof kept on the stack for a whole profile would therefore switch off a
user's own pair (activation offloading, compression) and would make
``torch.func.grad`` refuse to run (it refuses whenever any pair is on the
stack: ``torch/_functorch/vmap.py``, ``doesnt_support_saved_tensors_hooks``).

So memprof pushes its pair only around a module call of the model (a forward,
or a checkpointed block recomputed in backward), and pops it in that call's
forward post-hook: the push nests inside whatever the user does, and outside
the model's calls no pair of memprof's is on the stack (``torch.func`` runs,
and so does ``disable_saved_tensors_hooks``). It never pushes inside a
``torch.func`` transform (hooks are disabled there) nor over
``torch.utils.checkpoint``'s own pair (in forward it keeps nothing; in
backward it recomputes, which memprof follows apart). What code outside the
model saves (the loss) is found on the autograd graph when backward starts
(:meth:`memprof.collect.graph_saves.GraphSaves.find_outside_saves`).

A pair pushed over another one is *chained*: memprof's pack calls the outer
pack with the original tensor, exactly as torch would have, and hands
autograd the outer pack's result; memprof's unpack calls the outer unpack.
What autograd then holds is what the outer pack returned, so memprof counts
the tensors it finds in that result as activations.

torch skips its in-place modification check for tensors saved through hooks
(``torch/csrc/autograd/saved_variable.cpp``); memprof's own unchained pair
(:meth:`memprof.collect.saved.SavedTracker.unpack`) restores it, so "modified
by an inplace operation" is raised as without memprof. Through a chained pair torch would not check either, and memprof
does not.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

import torch

from ..errors import is_interrupt
from .torch_compat import current_autograd_node, is_compiling as _is_compiling, pop_saved_hooks as _pop
from .torch_compat import push_saved_hooks as _push, saved_hooks_disabled_message as _disabled_message
from .torch_compat import top_saved_hooks as _top

if TYPE_CHECKING:
    from .aliases import PackHook, SavedPair, UnpackHook

__all__ = ["Accountant", "Packed", "SavedHooks", "tensors_in", "is_checkpoint_pair", "under_checkpoint",
           "modified_message"]


class Accountant(Protocol):
    """What memprof's pairs hand each saved tensor to (:class:`memprof.collect.saved.SavedTracker`)."""

    def pack(self, t: torch.Tensor) -> object:
        """memprof's own pack, with no pair of the user's beneath it."""

    def unpack(self, saved: object) -> torch.Tensor:
        """memprof's own unpack."""

    def account(self, t: torch.Tensor) -> "int | None":
        """A tensor autograd now holds: its storage's key when it is a counted activation."""

    def watch(self, holder: object, keys: tuple[int, ...]) -> None:
        """When autograd lets ``holder`` go, release one slot of each counted storage in ``keys``."""

    def unpacking(self) -> None:
        """Backward unpacks a saved tensor (the first unpack may be what starts backward)."""


class Packed:
    """What a chained pack hands autograd: the outer pack's result. When the pack found activations in it,
    the ledger watches it (``Ledger.watch``), and releases their slots when autograd lets it go."""

    __slots__ = ("packed", "__weakref__")

    def __init__(self, packed: object) -> None:
        self.packed = packed


def modified_message(t: torch.Tensor, expected: int) -> str:
    """torch's error for a saved tensor modified in place since it was saved (``expected`` its version then)."""
    # torch's own wording (torch/csrc/autograd/saved_variable.cpp), so that code and people
    # that recognise the error still do. The node is the one unpacking, i.e. the one that needs it.
    node = current_autograd_node()
    needed_by = f", which is needed by {type(node).__name__}," if node is not None else ""
    return (
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{t.type()} {list(t.shape)}]{needed_by} is at version {t._version}; expected version {expected} "
        "instead. Hint: enable anomaly detection to find the operation that failed to compute its gradient, "
        "with torch.autograd.set_detect_anomaly(True)."
    )


def tensors_in(obj: object, out: list[torch.Tensor], depth: int = 0) -> None:
    """Tensors an outer pack's result holds: itself, in tuples, lists, dicts or object attributes."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth >= 3 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            tensors_in(x, out, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            tensors_in(x, out, depth + 1)
    else:
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for x in attrs.values():
                tensors_in(x, out, depth + 1)


def is_checkpoint_pair(pair: "SavedPair | None") -> bool:
    """Is this torch.utils.checkpoint's own pair (it keeps nothing in forward; recomputes in backward)?"""
    return pair is not None and getattr(pair[0], "__module__", None) == "torch.utils.checkpoint"


def under_checkpoint() -> bool:
    """Does code run inside a torch.utils.checkpoint region now (its pair on the stack, directly or
    beneath memprof's own chained pairs)?"""
    pair = _top(False)
    if pair is None:
        return False
    pack = pair[0]
    owner = getattr(pack, "__self__", None)
    while isinstance(owner, _Chain):
        pack = owner.outer_pack
        owner = getattr(pack, "__self__", None)
    return getattr(pack, "__module__", None) == "torch.utils.checkpoint"


class _Chain:
    """memprof's pair over an outer one: the outer pack runs as without memprof."""

    __slots__ = ("owner", "outer_pack", "outer_unpack")

    def __init__(self, owner: Accountant, outer: "SavedPair") -> None:
        self.owner: "Accountant | None" = owner
        # The user's pair: autograd hands its unpack what its pack made, and wants a tensor back.
        self.outer_pack: "PackHook"
        self.outer_unpack: "UnpackHook"
        self.outer_pack, self.outer_unpack = outer

    def pack(self, t: torch.Tensor) -> object:
        packed = self.outer_pack(t)
        owner = self.owner
        if owner is None or _is_compiling():
            return packed
        found: list[torch.Tensor] = []
        tensors_in(packed, found)
        keys = tuple(k for k in (owner.account(x) for x in found) if k is not None)
        held = Packed(packed)
        if keys:
            owner.watch(held, keys)
        return held

    def unpack(self, saved: object) -> torch.Tensor:
        owner = self.owner
        if owner is not None:
            owner.unpacking()
        return self.outer_unpack(saved.packed if type(saved) is Packed else saved)


class SavedHooks:
    """The pushes memprof made on one thread's saved-tensor hooks stack, and their undoing."""

    def __init__(self, owner: Accountant) -> None:
        self.owner = owner
        self.thread = threading.get_ident()
        self.own_pack = owner.pack  # bound once: the identity that says "ours" on the stack
        self.own_unpack = owner.unpack
        # What memprof pushed and has not popped yet: (pack function, chain or None).
        self.pushed: "list[tuple[PackHook, _Chain | None]]" = []
        # Packs of outer pairs memprof chained to (for the report's notes).
        self.chained_to: set[str] = set()
        self.in_transform = 0

    def is_ours(self, pair: "SavedPair | None") -> bool:
        if pair is None:
            return False
        pack = pair[0]
        if pack is self.own_pack:
            return True
        chain = getattr(pack, "__self__", None)
        return type(chain) is _Chain and chain.owner is self.owner

    def cover(self) -> bool:
        """Make memprof's pack the one autograd calls during this module call; True when it pushed
        (the caller pops with :meth:`uncover` in the call's forward post-hook)."""
        top = _top(False)
        if self.is_ours(top):
            return False
        if _disabled_message() is not None:
            # Inside a torch.func transform: torch refuses saved-tensor hooks there.
            self.in_transform += 1
            return False
        if is_checkpoint_pair(top):
            return False
        if top is None:
            pack, unpack_, chain = self.own_pack, self.own_unpack, None
        else:
            chain = _Chain(self.owner, top)
            pack, unpack_ = chain.pack, chain.unpack
            self.chained_to.add(_name_of(top[0]))
        _push(pack, unpack_)
        self.pushed.append((pack, chain))
        return True

    def uncover(self) -> None:
        """Pop the push of this module call (it is on top: module calls nest)."""
        if self.pushed and self._on_top(self.pushed[-1][0]):
            _pop()
            self.pushed.pop()

    def close(self) -> bool:
        """Undo every push; True when all could be popped.

        A push that cannot be popped (a forward that raised past a pair of the user's, or the
        profile ending in another thread) is made inert: it passes through to the pair beneath.
        """
        clean = True
        here = threading.get_ident() == self.thread
        while self.pushed:
            # Forgotten only once handled: run again after an interrupt, this finishes the job.
            pack, chain = self.pushed[-1]
            if here and self._on_top(pack):
                _pop()
            else:
                clean = False
                if chain is not None:
                    chain.owner = None
                if (self.thread, pack) not in _ORPHANS:
                    _ORPHANS.append((self.thread, pack))
            self.pushed.pop()
        # A push a signal handler's exception cut off before it was recorded (between _push and the append in
        # cover()) is ours all the same: popped while it is on top, as the recorded ones are.
        while here and self.is_ours(_top(False)):
            _pop()
        return clean

    @staticmethod
    def _on_top(pack: "PackHook") -> bool:
        top = _top(False)
        return top is not None and top[0] is pack


def _name_of(pack: "PackHook") -> str:
    """The user's pack function's name, for a note; its type's name when reading it fails (a callable
    object's ``__qualname__`` is the user's code, and this runs inside the model's forward)."""
    try:
        name = getattr(pack, "__qualname__", None)
    except Exception as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        name = None
    return name if isinstance(name, str) else type(pack).__name__


# Pushes that could not be popped when their profile ended: (thread id, pack function).
# The next profile started in that thread pops those that are on top of its stack.
_ORPHANS: "list[tuple[int, PackHook]]" = []


def pop_orphans() -> None:
    """Pop orphaned memprof pushes on top of this thread's stack (left by a profile ended elsewhere)."""
    me = threading.get_ident()
    mine = [pack for thread, pack in _ORPHANS if thread == me]
    while mine:
        top = _top(False)
        if top is None or top[0] not in mine:
            break
        _pop()
        mine.remove(top[0])
        _ORPHANS.remove((me, top[0]))
