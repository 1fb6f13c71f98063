"""Storages: every op output, seen through a thin dispatch mode, and the tensors handed in.

Exact mode installs :class:`DispatchMode`, whose ``__torch_dispatch__`` is the one
frame it adds per op; :class:`StorageTracker` holds what it reads and does the rarer work.
Each op is classified once from its schema: ops that return new storages
register them as temporaries; views and in-place ops are skipped (they return
storages they were given), ``out=`` ops register a buffer memprof never saw
(allocated inside compiled code), and ``lift_fresh`` (how ``torch.tensor``
hands a C++-built tensor to dispatch) counts as a new storage. A few ops carry
a tag rule that names what they produced (dropout masks, norm statistics,
autocast weight copies ...) for the reconciler's causes: :mod:`.op_tags`.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from ..errors import is_interrupt
from ..vocabulary import Phase
from .ledger import INPUTS, TEMPORARIES, inner_tensors, is_wrapper, storage_of
from .moves import move, set_tag
from .mode_stack import exit_mode, pop_from_beneath, push_beneath
from .op_tags import COLLECTIVE_NAMESPACES, TAG_RULES, TagRule, autocast_dtype, op_named as _op
from .op_tags import communication as _communication
from .torch_compat import FakeTensor as _FakeTensor
from .torch_compat import KEEPS_COMPILE, UnwrappedMode, dispatch_mode_at, dispatch_stack_len as _dispatch_stack_len
from .torch_compat import skip_dynamo
from .torch_compat import graph_task_id as _graph_task_id, top_saved_hooks as _top_saved_hooks

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .aliases import Op
    from .graph_saves import GraphSaves
    from .ledger import Entry, Ledger
    from .operations import OperationLog
    from .state import Run

__all__ = ["DispatchMode", "StorageTracker", "KEEPS_COMPILE", "pop_orphan_modes"]

_aten = torch.ops.aten
_PLAIN = torch.Tensor
#: The input types whose gradient an input's first call reads (mark_inputs): none of their attributes raise.
_GRAD_READ = frozenset({torch.Tensor, torch.nn.Parameter, _FakeTensor})
_DETACH = _aten.detach.default
_BACKWARD = Phase.BACKWARD


def _nothing() -> None:
    pass


class DispatchMode(UnwrappedMode):
    """Registers what every op makes; passes ops through once the profile has ended.

    Its handler is the one Python frame exact mode adds per op in the common case (a plain tensor made by an
    op: its storage registered as a temporary, through :meth:`Ledger.add` when new): what
    :class:`StorageTracker` used to do per op is inlined here, and the run state is read from plain
    attributes that the trackers changing it push.
    """

    def __init__(self, tracker: "StorageTracker") -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is untyped
        self.tracker: "StorageTracker | None" = tracker
        self.home = threading.get_ident()  # the thread whose stack holds it
        # Armed while inert: see inert().
        self.exits: list[weakref.finalize[[weakref.ref[DispatchMode]], torch.Tensor]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Every other dispatch mode makes torch.compile run the model eagerly, and the code
        # object stays eager for the rest of the process (torch/_dynamo/convert_frame.py skips
        # frames while a mode without this flag is on the stack). With it, compiled code stays
        # compiled and this mode sees the ops the compiled artifact dispatches at run time.
        return True

    # TorchDispatchMode leaves these untyped: torch passes an OpOverload, the types of the tensors among the
    # arguments, and the op's own arguments, which this handler passes on.
    def __torch_dispatch__(self, func: "Op", types: "tuple[type, ...]", args: "tuple[object, ...]" = (),
                           kwargs: "dict[str, object] | None" = None) -> object:
        tracker = self.tracker
        if tracker is None:
            # The profile ended (in another thread, or beneath a mode that could not be moved).
            return self.inert(func, args, kwargs or {})
        if kwargs is None:
            kwargs = {}
        if func is _DETACH:
            # A detach only aliases (the engine and saved-tensor packing issue many): nothing to count.
            return func._op(*args, **kwargs)
        for t in types:
            if t is not _PLAIN and is_wrapper(t):
                # A wrapper subclass (DTensor ...): let it run first. It desugars into ops on the tensors
                # it wraps, which come back through this mode with real storages and local sizes.
                return NotImplemented
        run = tracker.run
        phase = run.phase
        if phase is _BACKWARD:
            graph = tracker.graph
            # Checkpoint's recomputation and nested backward passes need the graph's watch; a plain backward
            # (no saved-tensor pair on the stack, a graph task already searched) does not.
            if graph is not None and (graph.recomputing or _top_saved_hooks(False) is not None
                                      or _graph_task_id() not in graph.walked_tasks):
                graph.watch_recompute()
        elif run.scan_args and not run.calls:
            # Only outside the model's modules (the loss, data movement): inside them every tensor
            # was either handed to the model (marked by the root hook) or made by an op already.
            tracker.scan_inputs(args)
        # OpOverload.__call__ is itself a Python frame that only calls _op.
        out = func._op(*args, **kwargs)
        # Keyed by id(): OpOverload.__hash__ is a Python method, a second call per op.
        info = _OP_INFO.get(id(func))
        if info is None:
            info = _op_info(func)
        kind = info[0]
        if kind >= _NOT_WORK:  # views and profiler markers
            return out
        if kind == _WRITES_OUT:
            # An out= op writes into a buffer it was handed (and may grow it). A buffer memprof never
            # saw was allocated where no op reaches dispatch: inside compiled code (torch.compile's
            # generated kernels allocate directly) or by the caller before the profile.
            tracker.register_unseen(kwargs)
        elif kind == _RESIZES and args and isinstance(args[0], torch.Tensor):
            tracker.register_unseen({"self": args[0]})
        run.ops += 1
        if tracker.operations is not None:
            tracker.operations.record(phase.value, func, args, kwargs, out)
        if phase is not _BACKWARD and _graph_task_id() != -1:
            tracker.backward_started()
        if kind == _NEW_OUTPUTS:
            led = tracker.ledger
            if led.released:
                led.settle()  # a storage freed since may have had an output's address
            entries = led.entries
            on_cpu = tracker.on_cpu
            for o in (out,) if type(out) is _PLAIN else out if isinstance(out, (tuple, list)) else ():
                if type(o) is not _PLAIN:
                    if not isinstance(o, torch.Tensor) or tracker.foreign_fake(o):
                        continue
                if on_cpu:
                    if not o.is_cpu:
                        continue
                elif o.device != tracker.device:
                    continue
                try:  # storage_of() inlined: this runs for every op output
                    st = o.untyped_storage()
                except (RuntimeError, NotImplementedError) as failure:
                    if is_interrupt(failure):
                        raise  # a signal handler's exception (errors.is_interrupt) is the user's
                    continue
                if st._cdata not in entries:
                    led.add(st, TEMPORARIES)
            if type(out) is not _PLAIN and isinstance(out, torch.Tensor):
                tracker.register_output(out)  # a tensor subclass result (e.g. a Parameter)
        rule = info[1]
        if rule is not None:
            rule(tracker, func, args, out)
        return out

    def inert(self, func: "Op", args: "tuple[object, ...]", kwargs: "dict[str, object]") -> object:
        """Pass an op through, and arrange for this mode to leave its thread's stack.

        It cannot leave from here: while a mode handles an op torch has taken it off the stack, and
        puts it back when the handler returns (``StashTorchDispatchModeGuard``,
        torch/csrc/utils/torch_dispatch_mode.h). So it leaves when the op's output is released,
        which is outside dispatch in the common case (the end of the user's statement), if it is
        then on top of the stack. Only this path pays for it; a running profile's ops never come here.
        """
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and threading.get_ident() == self.home:
            exits = self.exits = [f for f in self.exits if f.alive]
            if len(exits) < 4:  # a few outputs, in case the first ones live on
                leave = weakref.finalize(out, _leave_stack, weakref.ref(self))
                leave.atexit = False
                exits.append(leave)
        return out


def _leave_stack(ref: "weakref.ref[DispatchMode]") -> None:
    """An inert mode's armed output was released: leave the stack if the mode is on top of it here."""
    mode = ref()
    if mode is None or mode.tracker is not None or threading.get_ident() != mode.home:
        return
    try:
        if not _on_top(mode):
            return  # inside another op's dispatch, or beneath a mode of the user's: a later output tries again
        exit_mode(mode)
    except Exception:  # a finaliser must not raise into the user's code; the next profile here pops it
        return
    _forget_orphan(mode)


# What an op's outputs are, decided once per op from its schema.
_NEW_OUTPUTS, _ALIASES, _WRITES_OUT, _RESIZES, _NOT_WORK, _VIEW = 0, 1, 2, 3, 4, 5


# Ops whose schema says "returns an alias of the input" but which hand out a storage made outside
# dispatch: torch.tensor(...), torch.as_tensor(list) and from_numpy build the tensor in C++ and only
# then pass it through lift_fresh (torch/csrc/utils/tensor_new.cpp). The output is a new storage.
_LIFTS = frozenset(o for o in (_op("lift_fresh"), _op("lift_fresh_copy"), _op("lift")) if o is not None)
# Composite ops whose schema says they alias their input but which copy when they must (a dtype conversion, a
# non-contiguous input). A mode sees them whole when code below another mode calls them (context parallelism's
# ring attention casts its merged output with .to(dtype)); a new storage they return is counted like any op's.
_MAYBE_COPIES = frozenset(o for o in (_op("to", "dtype"), _op("to", "device"), _op("to", "dtype_layout"),
                                      _op("to", "other"), _op("contiguous"), _op("reshape"),
                                      _op("flatten", "using_ints"))
                          if o is not None)
# In-place ops that change the size of the storage they write.
_RESIZE_OPS = frozenset(o for o in (_op("resize_"), _op("resize_as_"), _op("set_", "source_Storage"),
                                    _op("set_", "source_Storage_storage_offset"), _op("set_", "source_Tensor"))
                        if o is not None)


class StorageTracker:
    """Registers what ops make and what the model is handed; tags what some ops make.

    It calls up through three slots the profiler wires: :attr:`backward_started` (an op of the engine's
    before any hook said backward began), :attr:`graph` (whose ``watch_recompute`` an op in backward calls
    while a saved-tensor pair is on the stack, a checkpointed region is recomputed or a graph task is new:
    nested backward passes) and :attr:`after_collective` (a collective ran: FSDP2 may have stored gradients).
    """

    def __init__(self, ledger: "Ledger", run: "Run") -> None:
        self.ledger = ledger
        self.run = run
        self.device = run.device
        self.on_cpu = run.on_cpu
        self.backward_started: Callable[[], None] = _nothing
        self.graph: "GraphSaves | None" = None
        self.after_collective: "Callable[[], None] | None" = None
        self.operations: "OperationLog | None" = None  # with operations=True
        self.autocast_dtype: "str | None" = None
        self.mode: "DispatchMode | None" = None
        self.base_depth: "int | None" = None  # the dispatch stack's depth when the profile began
        self.fake_mode: "FakeTensorMode | None" = None  # a simulation's: its tensors are the ones counted
        # The mode install() makes: None, this module's DispatchMode (read when it runs); a simulation's is
        # collect.simulated.SimulatedDispatchMode.
        self.mode_class: "type[DispatchMode] | None" = None

    # -- the dispatch mode -----------------------------------------------------

    def install(self) -> None:
        # Again at every install: a flag on the code objects, which nothing else should clear. The handler and
        # the ledger's settling of what torch released run wherever an op runs, also inside a compiled frame
        # whose graph broke at an op, where dynamo looks at every new Python frame.
        made = DispatchMode if self.mode_class is None else self.mode_class
        for mode_class in {DispatchMode, made}:  # a subclass's handler runs DispatchMode's
            skip_dynamo(mode_class.__torch_dispatch__.__code__)
        ledger = type(self.ledger)
        for method in (ledger.settle,):
            skip_dynamo(method.__code__)
        mode = _reusable_orphan()
        if mode is not None:
            # A mode of ours left beneath one that could not be moved (a fake or proxy mode): it is
            # still on the stack, so it takes the ops again rather than a new one on every window.
            mode.tracker = self
            self.mode = mode
            return
        mode = made(self)
        if self.base_depth is None:  # the profile's start: whatever is on the stack was there before it
            self.base_depth = _dispatch_stack_len()
            mode.__enter__()  # type: ignore[no-untyped-call]  # TorchDispatchMode's is untyped
        else:  # a schedule's window: beneath the modes the user entered since (mode_stack.py says why)
            push_beneath(mode, self.base_depth)
        self.mode = mode

    def uninstall(self, thread: int) -> None:
        """Take the mode off ``thread``'s stack, or leave it there inert. Safe to run again when cut short
        (the mode is forgotten only once it is out or listed as an orphan)."""
        mode = self.mode
        if mode is None:
            return
        mode.tracker = None  # inert from now on, wherever it still sits
        # Taken out, also from beneath modes the user entered inside the block and left open. Otherwise (another
        # thread's stack, or beneath a mode torch keeps apart: fake, proxy) it leaves by itself once on top
        # (DispatchMode.inert), or at the next profile in that thread.
        if not (threading.get_ident() == thread and pop_from_beneath(mode)):
            if (thread, mode) not in _ORPHAN_MODES:
                _ORPHAN_MODES.append((thread, mode))
        self.mode = None

    # -- registration ------------------------------------------------------------

    def add_tensor(self, t: torch.Tensor, cat: int) -> "Entry | None":
        """Register ``t``'s storage (if new) under ``cat``; its entry, or None off this device."""
        if t.device != self.device:
            return None
        if t.layout is not torch.strided:
            if t.is_sparse:
                self.add_tensor(t._indices(), cat)
                return self.add_tensor(t._values(), cat)
            if not is_wrapper(type(t)):
                return None
        if type(t) is not _PLAIN and is_wrapper(type(t)):
            # (A jagged nested tensor too: its values and offsets.)
            # A wrapper subclass: what it wraps (a DTensor's local shard; a quantised tensor's data and scales).
            entries = [self.add_tensor(x, cat) for x in inner_tensors(t)]
            return entries[0] if entries else None
        st = storage_of(t)
        return self.ledger.add(st, cat) if st is not None else None

    def foreign_fake(self, t: torch.Tensor) -> bool:
        """A fake tensor that is not the simulation's: metadata torch computes on the side (DTensor's sharding
        propagation runs ops on fake tensors of the global shape), which holds no memory."""
        return isinstance(t, _FakeTensor) and t.fake_mode is not self.fake_mode

    def register_output(self, t: torch.Tensor) -> None:
        """A tensor that came out of code memprof sees only from outside: a temporary if new, and a
        known storage at its current size."""
        if type(t) is not _PLAIN and self.foreign_fake(t):
            return
        if self.on_cpu:
            if not t.is_cpu:
                return
        elif t.device != self.device:
            return
        st = storage_of(t)
        if st is None:
            return
        led = self.ledger
        if led.released:
            led.settle()
        entry = led.entries.get(st._cdata)
        if entry is None:
            led.add(st, TEMPORARIES)
        elif entry.nbytes != led.size_of(st.nbytes()):
            led.resize(entry, st.nbytes())

    def register_unseen(self, kwargs: "dict[str, object]") -> None:
        # out= tensors are keyword-only in the schemas of .out overloads.
        for value in kwargs.values():
            for t in (value,) if isinstance(value, torch.Tensor) else value if isinstance(value, (tuple, list)) else ():
                if isinstance(t, torch.Tensor):
                    self.register_output(t)

    def entry_of(self, t: torch.Tensor) -> "Entry | None":
        st = storage_of(t)
        if st is None:
            return None
        led = self.ledger
        if led.released:
            led.settle()
        return led.entries.get(st._cdata)

    def tag(self, t: torch.Tensor, tag: int) -> None:
        entry = self.entry_of(t)
        if entry is not None:
            set_tag(self.ledger, entry, tag)

    def scan_inputs(self, args: Iterable[object]) -> None:
        # Tensors that come from outside the profile (targets handed to the
        # loss, masks) are inputs; known storages are skipped in O(1).
        led = self.ledger
        if led.released:
            led.settle()
        entries = led.entries
        for a in args:
            if isinstance(a, torch.Tensor):
                if type(a) is not _PLAIN and self.foreign_fake(a):
                    continue  # DTensor's global-shape metadata (the loss under loss_parallel): not the batch
                try:  # storage_of() inlined: this runs for every op argument
                    st = a.untyped_storage()
                except (RuntimeError, NotImplementedError) as failure:
                    if is_interrupt(failure):
                        raise  # a signal handler's exception (errors.is_interrupt) is the user's
                    continue
                if st._cdata not in entries and a.device == self.device:
                    self.ledger.add(st, INPUTS)

    def mark_inputs(self, objs: object, depth: int = 0, *, made_in_block_too: bool = True) -> None:
        # Tensors handed to the model's forward are its inputs: unknown ones (made before the
        # profile), and temporaries made in the block (the batch built inside it). Handed to a
        # submodule called directly (made_in_block_too=False), only the unknown ones are: a
        # temporary there may be the encoder's output, or the loop's F.gelu of it.
        if depth > 4:
            return
        if isinstance(objs, torch.Tensor):
            entry = self.add_tensor(objs, INPUTS)
            if made_in_block_too:
                if entry is not None and entry.cat == TEMPORARIES:
                    move(self.ledger, entry, INPUTS)
                if (type(objs) in _GRAD_READ and objs.requires_grad and objs.is_leaf
                        and objs.grad is not None):
                    # Its gradient from before the profile, which backward accumulates into: live as a fresh one
                    # backward would make (a temporary), never seen made (its 20,480 B were left out). Plain and
                    # the simulation's tensors and parameters only: a subclass's attributes may raise
                    # (test_undescribable_inputs).
                    self.add_tensor(objs.grad, TEMPORARIES)
        elif isinstance(objs, (list, tuple)):
            for o in objs:
                self.mark_inputs(o, depth + 1, made_in_block_too=made_in_block_too)
        elif isinstance(objs, dict):
            for o in objs.values():
                self.mark_inputs(o, depth + 1, made_in_block_too=made_in_block_too)

    def note_autocast(self) -> None:
        if self.autocast_dtype is None:
            dtype = autocast_dtype(self.device)
            self.autocast_dtype = str(dtype).replace("torch.", "") if dtype is not None else None


# id(op) -> (kind, tag rule or None, op). The op itself is kept so that its id stays its own.
_OP_INFO: "dict[int, tuple[int, TagRule | None, Op]]" = {}


def _op_info(func: "Op") -> "tuple[int, TagRule | None, Op]":
    if func.namespace == "profiler":  # record_function markers are not work
        kind = _NOT_WORK
    else:
        try:
            returns = func._schema.returns
            # Views and in-place ops return storages they were given: no new memory.
            infos = [r.alias_info for r in returns]
            aliases = bool(infos) and all(a is not None for a in infos)
            writes = aliases and any(a is not None and a.is_write for a in infos)
        except Exception as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            aliases = writes = False
        # In-place ops (_ALIASES) write their result; views (_VIEW) move no data at all.
        kind = (_ALIASES if writes else _VIEW) if aliases else _NEW_OUTPUTS
        if kind == _ALIASES and func._overloadname == "out":
            kind = _WRITES_OUT
        if func in _LIFTS or func in _MAYBE_COPIES:
            kind = _NEW_OUTPUTS
        elif func in _RESIZE_OPS:
            kind = _RESIZES
    rule = TAG_RULES.get(func)
    if func.namespace in COLLECTIVE_NAMESPACES:
        rule = _communication
    info = (kind, rule, func)
    _OP_INFO[id(func)] = info
    return info


# Dispatch modes that could not be popped because their profile ended in another thread:
# (thread id, mode). The next profile started in that thread pops those on top of its stack.
_ORPHAN_MODES: list[tuple[int, DispatchMode]] = []


def _on_top(mode: DispatchMode) -> bool:
    depth = _dispatch_stack_len()
    return depth > 0 and dispatch_mode_at(depth - 1) is mode


def _reusable_orphan() -> "DispatchMode | None":
    """An inert mode of ours still on this thread's dispatch stack, taken off the orphan list."""
    me = threading.get_ident()
    depth = _dispatch_stack_len()
    if depth <= 0:
        return None
    on_stack = {id(dispatch_mode_at(i)) for i in range(depth)}
    for thread, mode in list(_ORPHAN_MODES):
        if thread == me and id(mode) in on_stack:
            _forget_orphan(mode)
            return mode
    return None


def pop_orphan_modes() -> None:
    """Pop this thread's inert modes that are on top of its stack (a profile starts here)."""
    me = threading.get_ident()
    for entry in [e for e in _ORPHAN_MODES if e[0] == me]:
        if _on_top(entry[1]):
            exit_mode(entry[1])
            _forget_orphan(entry[1])


def _forget_orphan(mode: DispatchMode) -> None:
    for leave in mode.exits:
        leave.detach()
    mode.exits = []
    # Rebuilt rather than removed from: another thread may change the list meanwhile.
    _ORPHAN_MODES[:] = [e for e in _ORPHAN_MODES if e[1] is not mode]
