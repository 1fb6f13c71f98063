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

What autograd saves outside memprof's pushes (the loss, checkpointed regions
recomputed in backward) is found apart, by :mod:`.graph_saves`.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable

import torch

from ..errors import is_interrupt
from ..vocabulary import Phase
from .ledger import ACTIVATIONS, BUFFERS, COMMUNICATION, GRADIENTS, INPUTS, KV_CACHE, OPTIMIZER_STATES
from .ledger import TEMPORARIES, WEIGHTS, storage_of
from .moves import move, set_tag
from .ledger import Release as _Release
from .saved_hooks import SavedHooks, modified_message
from .saved_where import attribute, saved_by_rule_module
from .state import EXACT
from .torch_compat import NoPythonDispatch as _NoPythonDispatch
from .torch_compat import dispatch_stack_len as _dispatch_stack_len, graph_task_id as _graph_task_id
from .torch_compat import COMPILER as _COMPILER, top_saved_hooks as _top_saved_hooks

if TYPE_CHECKING:
    from .aliases import SavedForm
    from .capture import Capture
    from .ledger import Ledger
    from .module_table import ModuleTable
    from .state import Run

__all__ = ["SavedTracker"]

_FORWARD = Phase.FORWARD
_BACKWARD = Phase.BACKWARD
_PARAMETER = torch.nn.Parameter
# Categories whose storages a save leaves as they are (account_storage() neither moves nor counts them).
_PASSIVE = frozenset((WEIGHTS, BUFFERS, GRADIENTS, OPTIMIZER_STATES, KV_CACHE))


class Saved:
    """What memprof's own pack hands autograd for an activation: a detached alias of it, its version at
    the save, and the saved tensor weakly (``origin``) when it had a ``grad_fn``. When autograd releases
    it, the ledger's queue hears of it (:meth:`Ledger.watch`: a weak reference whose callback is C code, so
    that no bytecode of memprof's runs as a finaliser) and gives the activation back to temporaries when it
    held the last slot. Made without ``__init__`` (:meth:`SavedTracker.pack` sets its fields)."""

    __slots__ = ("tensor", "version", "origin", "__weakref__")

    tensor: torch.Tensor
    version: int
    origin: "weakref.ref[torch.Tensor] | None"


class SavedTracker:
    """Accounts for what autograd saves; owns memprof's saved-tensor pushes. ``backward_started`` is
    called at the first unpack of a backward that no gradient hook announced."""

    def __init__(self, ledger: "Ledger", run: "Run", table: "ModuleTable", capture: "Capture") -> None:
        self.ledger = ledger
        self.run = run
        self.table = table
        self.capture = capture
        self.device = run.device
        self.on_cpu = run.on_cpu
        self.full = run.mode == EXACT  # exact mode (set again if the profiler falls back to light)
        self.backward_started: Callable[[], None] = _nothing
        self.hooks = SavedHooks(self)
        self.scoped: list[int] = []  # module calls whose forward holds a scoped push
        # The model's inputs saved by modules with a rule in the formula's forward:
        # (module, storage key) -> bytes saved.
        self.saved_inputs: dict[tuple[int, int], int] = {}
        #: Saved tensors whose own code raised when read: the activations are then not measured.
        self.unreadable = 0

    # -- memprof's own pair ---------------------------------------------------------

    def pack(self, t: torch.Tensor) -> object:
        """memprof's own pack (no user pair beneath), for every tensor autograd saves. A counted activation is
        handed to autograd as a :class:`Saved`, which tells the ledger when autograd lets it go; anything else
        as a tuple ``(tensor, version, origin)``. ``tensor`` is a detached alias of anything with a ``grad_fn``
        (``t`` itself would close the cycle output -> grad_fn -> saved output, keeping a dropped graph alive),
        ``t`` itself otherwise (torch too keeps a leaf itself, torch/csrc/autograd/saved_variable.cpp).
        ``origin`` is ``t`` weakly when it had a ``grad_fn``: torch refuses a saved tensor detached in place
        since, and so must memprof."""
        if _COMPILER._is_compiling_flag:
            # dynamo compiling through autograd: its fake tensors are not memory. (The flag itself, read as
            # is_compiling() reads it: autograd's C++ calls this hook, dynamo never inlines it.)
            return t
        # account() written out for a plain tensor on the profiled device. Its common cases make at most one
        # other frame (tests/integration/test_overhead_counts.py): a storage that is a weight, a gradient, a
        # buffer or a state (nothing to do), and light mode's new activation saved in a module's forward (the
        # ledger's add, then account_storage()'s and attribute()'s work for it, written out).
        key = None
        run = self.run
        if not run.active:
            pass
        elif ((type(t) is torch.Tensor or type(t) is _PARAMETER) and t.layout is torch.strided
                and (t.is_cpu if self.on_cpu else t.device == self.device)):
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError) as failure:
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                st = None
            led = self.ledger
            if led.released:
                led.settle()  # what torch let go of first: a freed storage may have had this address
            entry = led.entries.get(st._cdata) if st is not None else None
            stack = run.calls
            if entry is not None and entry.cat in _PASSIVE:
                pass  # account_storage() would leave it as it is: not an activation, not an input
            elif self.full or entry is not None or st is None or not stack or run.phase is not _FORWARD:
                key = self.account_storage(t, st) if st is not None else None
            else:
                entry = led.add(st, ACTIVATIONS)
                key, index, table = entry.key, stack[-1], self.table
                tag = table.saved_tag[index]
                if tag >= 0:
                    # attribute(): saved in a container's own code or a module without a rule. (A new entry has
                    # no tag of either kind yet: the autocast weight copy's is set by exact mode's ops only.)
                    set_tag(led, entry, tag)
                elif t.nbytes == entry.nbytes:
                    entry.savers = {index: entry.nbytes}  # saved whole by a rule module (as account_storage())
                else:
                    saved_by_rule_module(led, entry, index, t.nbytes, self.saved_inputs if self.capture.on else None)
                info = table.info[index]  # ModuleTable.saved_in, as attribute() writes it out
                if info.act_step != run.step:
                    info.act_step, info.act_bytes = run.step, 0
                info.act_bytes += entry.nbytes
                entry.saved = 1
        else:
            key = self.account(t)
        # is_leaf is "grad_fn is None" read in C++ (torch/csrc/autograd/python_variable.cpp), without making
        # the Python object of the node that t.grad_fn would.
        if t.is_leaf:
            d, origin = t, None  # no grad_fn, so no cycle to break (and nothing to detach in place)
        else:
            origin = weakref.ref(t)
            # In exact mode this detach would go through memprof's own dispatch mode, which does nothing with it
            # but costs the Python dispatch round trip. When that mode is the only one and ``t`` a plain tensor,
            # no Python code wants to see it; a subclass or another mode still gets its detach.
            if self.full and type(t) is torch.Tensor and _dispatch_stack_len() == 1:
                with _NoPythonDispatch():
                    d = t.detach()
            else:
                d = t.detach()
        if key is None:
            return (d, t._version, origin)
        saved = Saved.__new__(Saved)  # no __init__: one frame less per save
        saved.tensor, saved.version, saved.origin = d, t._version, origin
        led = self.ledger  # Ledger.watch() written out
        ref = _Release(saved, led.queue_release)
        ref.keys, ref.then = (key,), None
        led.watched.add(ref)
        return saved

    def unpack(self, saved: "SavedForm") -> torch.Tensor:
        """memprof's own unpack, with torch's in-place modification check (torch skips its own for tensors
        saved through hooks: torch/csrc/autograd/saved_variable.cpp)."""
        run = self.run
        # The first unpack of a backward pass can come before any gradient hook (the loss's own backward):
        # it starts the backward phase in light mode. (unpacking() inlined: it runs for every unpack.)
        if run.phase is not _BACKWARD and run.active and _graph_task_id() != -1:
            self.backward_started()
        t: torch.Tensor  # what the pack kept (autograd hands back its result as it was made: untyped)
        kind = type(saved)
        if kind is tuple:
            t, version, origin = saved
        elif kind is Saved:
            t, version, origin = saved.tensor, saved.version, saved.origin
        else:
            t = saved  # packed while compiling: the tensor itself
            return t
        if origin is not None:
            o = origin()
            if o is not None and o.is_leaf:  # detached in place since (is_leaf: grad_fn is None, read in C++)
                # torch's wording (torch/csrc/autograd/saved_variable.cpp).
                raise RuntimeError(
                    "Trying to use a saved tensor that has been detached in-place, i.e. with .detach_().This is "
                    "not supported, please use out-of-place `.detach()` instead")
        if t._version != version:
            raise RuntimeError(modified_message(t, version))
        return t

    def watch(self, holder: object, keys: tuple[int, ...]) -> None:
        self.ledger.watch(holder, keys)

    def unpacking(self) -> None:
        # The first unpack of a backward pass can come before any gradient hook
        # (the loss's own backward): it starts the backward phase in light mode.
        run = self.run
        if run.phase is not _BACKWARD and run.active and _graph_task_id() != -1:
            self.backward_started()

    # -- accounting -------------------------------------------------------------------

    def account(self, t: torch.Tensor) -> "int | None":
        """Ledger work for a tensor autograd now holds: returns its storage's key when that is
        a counted activation (the caller's slot must release it through the ledger's ``watch``)."""
        run = self.run
        if not run.active:
            return None
        st: "torch.UntypedStorage | None"  # (an annotation only: no work at run time)
        if type(t) is torch.Tensor or type(t) is _PARAMETER:  # storage_of() inlined: this runs for every save
            # (A Parameter whose type is exactly nn.Parameter holds plain data: a parameter of a tensor subclass
            # has that subclass's type, torch/nn/parameter.py.)
            if t.layout is not torch.strided or (not t.is_cpu if self.on_cpu else t.device != self.device):
                return None
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError) as failure:
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                return None
        else:
            st = self.subclass_storage(t)
            if st is None:
                return None
        led = self.ledger
        if led.released:
            led.settle()  # what torch let go of first: a freed storage may have had this address
        return self.account_storage(t, st)

    def account_storage(self, t: torch.Tensor, st: "torch.UntypedStorage") -> "int | None":
        """:meth:`account` for ``t`` whose counted storage is ``st``, the ledger settled: returns the storage's
        key when that is a counted activation."""
        run = self.run
        led = self.ledger
        table = self.table
        entry = led.entries.get(st._cdata)
        if entry is None:
            # Exact mode saw every op output, so an unknown storage came from outside the profile
            # (an input) or from compiled code, which allocates out of dispatch's sight. Light mode
            # sees no op outputs, so an unknown storage that autograd saves is an activation.
            made_here = not self.full or table.compiled_depth > 0
            entry = led.add(st, ACTIVATIONS if made_here else INPUTS)
            if entry.cat == ACTIVATIONS:
                attribute(led, run, table, entry)
            elif run.calls:
                table.unseen_saves.append(entry.key)  # an input, unless its call turns out compiled
        elif entry.cat == TEMPORARIES or entry.cat == COMMUNICATION:
            # A collective's output that the next layer saves (tensor parallelism's all-reduce) is an
            # activation from then on, as any op output autograd keeps.
            move(led, entry, ACTIVATIONS)
            attribute(led, run, table, entry)
        stack = run.calls
        if stack and run.phase is _FORWARD and table.saved_tag[stack[-1]] < 0:
            view = t.nbytes
            if entry.savers is None and view == entry.nbytes and entry.where < 0 and entry.cat == ACTIVATIONS:
                entry.savers = {stack[-1]: view}  # the common case: first saved whole, by a rule module
            else:
                saved_by_rule_module(led, entry, stack[-1], view, self.saved_inputs if self.capture.on else None)
        if entry.cat == ACTIVATIONS:
            if entry.saved < 0:
                entry.saved = 0
            entry.saved += 1
            return entry.key
        return None

    def subclass_storage(self, t: torch.Tensor) -> "torch.UntypedStorage | None":
        """The counted storage of a saved tensor of a subclass, or None: off the profiled device, of another
        layout, or one whose own code raises when read (a note says its bytes are not counted, and the step runs
        as without memprof)."""
        try:
            if t.layout is not torch.strided or (not t.is_cpu if self.on_cpu else t.device != self.device):
                return None
            return storage_of(t)
        except Exception as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            self.unreadable += 1
            self.run.note(f"autograd saved a {type(t).__name__} whose device or layout cannot be read "
                          f"({type(exc).__name__}): activations are not measured")
            return None

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


def _nothing() -> None:
    pass
