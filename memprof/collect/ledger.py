"""The ledger: live storages, their categories, and running totals.

Every storage memprof knows about has one entry here, keyed by the address of
its C++ ``StorageImpl`` (``untyped_storage()._cdata``), which is unique while
the storage lives. The entry is a weak reference to the storage; the ledger
never holds a strong reference to anything the user owns.

What torch lets go of (a storage freed, a saved slot released) is queued, not
accounted, where it happens: a weak reference's callback runs as a finaliser,
and Python drops an exception raised in a finaliser ("Exception ignored in
..."), including the one a signal handler raises there (Ctrl-C, a preemption
handler). So the callback is the queue's own ``append``, a C function that
runs no bytecode and so gives a signal nowhere to land, and :meth:`Ledger.settle`
applies the queue, in order, from memprof's hooks before they read the ledger:
every reading of the totals and every lookup by key sees what torch released.

Totals per category are updated in O(1) per event. At each new high the
composition (nine ints, one per tensor category) and the saved tags' live bytes
(fifteen ints, one per tag) are copied, never a deep structure.
"""

from __future__ import annotations

import operator
import weakref
from collections import deque
from time import perf_counter_ns
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch

from ..errors import is_interrupt
from ..vocabulary import Category, TENSOR_CATEGORIES
from ..record.trace import Breakdown

if TYPE_CHECKING:
    from .device import DeviceReading

# Index of each tensor category in the running totals.
WEIGHTS, BUFFERS, GRADIENTS, OPTIMIZER_STATES, ACTIVATIONS, INPUTS, KV_CACHE, COMMUNICATION, TEMPORARIES = range(9)
N_CATS = 9
CATEGORY_OF_INDEX: tuple[Category, ...] = TENSOR_CATEGORIES

# Tags name a saved storage for the reconciler's named causes. Their live bytes
# are tracked only while the storage is an activation (saved). An entry holds
# one tag of each kind: what it is (the first seven, from the op that made it)
# and where it was saved from (the last eight, against the per-module formula
# and activation checkpointing),
# so a dropout mask saved in a container's own code counts for both causes.
TAGS: tuple[str, ...] = (
    "autocast_weight_copy",  # 16-bit copy of a parameter made by autocast
    "dropout_mask",  # a 1-byte mask (CUDA's native_dropout)
    "dropout_mask_2byte",  # a mask kept in a 16-bit input dtype (the CPU path: bernoulli_ noise)
    "dropout_mask_4byte",  # a mask kept in fp32
    "norm_statistics",  # mean / rstd of layer, batch, group and RMS norms
    "attention_logsumexp",  # fused attention's fp32 logsumexp
    "autocast_fp32_output",  # outputs of ops autocast runs in fp32 (softmax, layer_norm, ...)
    "saved_outside_modules",  # saved while no module of the model ran (the loss function)
    "saved_in_container_code",  # saved by functional code in a forward() that has submodules
    "saved_in_module_without_rule",  # saved by a leaf module memprof has no saved-bytes rule for
    "saved_by_two_modules",  # saved by 2+ leaf modules with a rule (ReLU's output, next Linear's input): the extra
    # bytes their rules count beyond the storage
    "saved_as_view_of_larger",  # rule modules saved only views of it (x[:, 0]): the bytes their rules do not count
    "saved_as_expanded_view",  # one rule module saved an expanded view of it: the bytes its rule counts beyond it
    "kept_by_checkpoint",  # a checkpointed region's input, kept to recompute the region in backward
    "recomputed_for_backward",  # saved by a checkpointed region recomputed in backward
)
N_TAGS = len(TAGS)
FIRST_WHERE_TAG = TAGS.index("saved_outside_modules")
assert tuple(c.value for c in CATEGORY_OF_INDEX) == (
    "weights", "buffers", "gradients", "optimizer_states", "activations", "inputs", "kv_cache", "communication",
    "temporaries"
)


class Storage(Protocol):
    """What the ledger reads of a storage it registers (:meth:`Ledger.add`, which also takes a weak reference to
    it): a tensor's ``UntypedStorage``, or the stand-in a carried step registers for its peak (collect/carry.py)."""

    _cdata: int  # the address of its StorageImpl: the ledger's key, unique while it lives

    def nbytes(self) -> int: ...


def storage_of(t: torch.Tensor) -> "torch.UntypedStorage | None":
    """The untyped storage under tensor ``t``, or None where there is none to count (sparse and
    nested layouts, tensor subclasses without storage, functorch wrappers). A wrapper subclass
    (DTensor, FSDP's and quantisation libraries' tensors) has a storage of its own that holds no data
    and, for DTensor, has the global size: the storage counted is that of the tensor it wraps."""
    if type(t) is not torch.Tensor and is_wrapper(type(t)):
        inner = inner_tensors(t)
        return storage_of(inner[0]) if inner else None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return None


# The bulk checks below run per parameter and per optimizer state at every step. Written as chains of C
# iterators (map, filter, operator's getters), they run no Python bytecode per tensor; anything unusual makes
# them answer None and the caller walks the tensors one by one as before.
_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))  # a Parameter of this exact type holds plain data
UNTYPED_STORAGE = operator.methodcaller("untyped_storage")  # also step_signature's
STORAGE_KEY = operator.attrgetter("_cdata")  # a storage's key in the ledger
_CAT = operator.attrgetter("cat")


def plain_storage_keys(tensors: "Sequence[torch.Tensor | None]") -> "list[int] | None":
    """The storage keys of ``tensors`` in order, when every one is a plain tensor (or a Parameter of that
    exact type) with a storage; None when any is not (None, a subclass, a sparse tensor). Devices are not
    looked at: the key of a storage on another device is not in the ledger (:func:`known_as`)."""
    if not _PLAIN_TYPES.issuperset(map(type, tensors)):
        return None
    try:
        return list(map(STORAGE_KEY, map(UNTYPED_STORAGE, tensors)))
    except (RuntimeError, NotImplementedError) as failure:  # no storage: sparse, or a tensor torch keeps apart
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return None


def known_as(entries: "dict[int, Entry]", keys: "list[int]", cat: int) -> bool:
    """Is every storage of ``keys`` live in the ledger under ``cat``?"""
    try:
        return set(map(_CAT, map(entries.__getitem__, keys))).issubset((cat,))
    except KeyError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return False


_WRAPPERS: dict[type, bool] = {}


def is_wrapper(klass: type) -> bool:
    """Is ``klass`` a traceable wrapper subclass (``__tensor_flatten__``, torch/utils/_python_dispatch.py)
    whose data lives in inner tensors? Fake and functional tensors are torch's own machinery, not data."""
    known = _WRAPPERS.get(klass)
    if known is None:
        known = hasattr(klass, "__tensor_flatten__") and klass.__name__ not in ("FakeTensor", "FunctionalTensor")
        _WRAPPERS[klass] = known
    return known


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a wrapper subclass holds (recursively), the largest first; [] when unreadable."""
    try:
        # Read by name: torch.Tensor does not declare the method every wrapper subclass has (is_wrapper).
        flattened: tuple[list[str], object] = getattr(t, "__tensor_flatten__")()  # noqa: B009
        names, _ = flattened
        inner = [getattr(t, name) for name in names]
    except Exception as failure:  # a subclass that cannot flatten now: nothing memprof can count
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return []
    out: list[torch.Tensor] = []
    for x in inner:
        if isinstance(x, torch.Tensor):
            out.extend(inner_tensors(x) if type(x) is not torch.Tensor and is_wrapper(type(x)) else [x])
    out.sort(key=lambda x: -x.numel() * x.element_size())
    return out


# Unparameterised base: the referent (a storage) is never read through this reference's type, only its callback.
class Entry(weakref.ref):  # type: ignore[type-arg]
    """One live storage: its size, category, and where it came from; also the weak reference to the storage
    whose callback queues it when torch frees it (:meth:`Ledger.settle` then subtracts its bytes).

    A weak reference subclass without ``__init__``: making one runs no Python frame, which matters on the
    dispatch mode's path (one per new storage). :meth:`Ledger.add` fills its fields.
    """

    __slots__ = ("key", "nbytes", "cat", "created", "saved", "module", "phase_serial", "tag", "tag_bytes",
                 "moved", "before", "where", "where_bytes", "savers")
    # Compared and hashed as itself, not as the storage it refers to (weakref.ref's own equality).
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    key: int
    nbytes: int
    cat: int
    created: int
    #: How many autograd saved-tensor slots hold this storage right now.
    saved: int
    module: int
    phase_serial: int
    #: What it is (a tag index below FIRST_WHERE_TAG, or -1) and the bytes that tag counts.
    tag: int
    tag_bytes: int
    #: The event count of its last change of category (0: none yet), and its category before that change.
    moved: int
    before: int
    #: Where it was saved from (a tag index from FIRST_WHERE_TAG, or -1) and the bytes that counts: the
    #: storage's, or for "saved_by_two_modules" what the per-module formula counts beyond them.
    where: int
    where_bytes: int
    #: Leaf modules with a saved-bytes rule that saved a view of it in a forward: index -> view bytes.
    savers: "dict[int, int] | None"


# Unparameterised base, as Entry's: only its callback matters.
class Release(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to what memprof hands autograd for a saved slot (:class:`memprof.collect.saved.Saved`,
    a chained pack's result): when autograd lets it go, the ledger's queue receives this reference, and
    :meth:`Ledger.settle` releases the slot of each storage in ``keys``. Made with :meth:`Ledger.watch`."""

    __slots__ = ("keys", "then")
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    keys: "tuple[int, ...]"
    #: Called with this reference when the queue is settled, in order among the frees (or None).
    then: "Callable[[Release], None] | None"


class Frame:
    """A module call (forward or backward) in progress, for its temporaries peak.

    Made with :func:`new_frame`, which runs no Python frame of its own (the module hooks make one per call).
    """

    __slots__ = ("module", "entry", "max", "backward")

    module: int
    #: Live bytes when the call began, and the highest while it ran.
    entry: int
    max: int
    backward: bool


def new_frame(module: int, entry: int, backward: bool) -> Frame:
    """A frame for a call of ``module`` that begins with ``entry`` live bytes."""
    frame = _new_object(Frame)
    frame.module, frame.entry, frame.max, frame.backward = module, entry, entry, backward
    return frame


_new_object = object.__new__

#: The queue a ledger shows while a queued gradient is handled (Ledger.settle): empty. Shared: nothing appends to a
#: ledger's queue but through its own queue_release, bound to the real one.
_NONE_NOW: "deque[Entry | Release | torch.Tensor]" = deque()


class Peaks:
    """The highest the ledger's totals reached, in the phase under way and in the run: the bytes, the categories and
    tags then, the event (``seq``) and the module on top at that moment; ``phase_serial`` counts the phases begun.
    :class:`Ledger` is one: it keeps the totals these follow (``add()`` writes :meth:`check_peak` out, on its hot
    path)."""

    # The totals followed, which the ledger keeps.
    totals: list[int]
    total: int
    tag_act: list[int]
    seq: int
    top: "Frame | None"

    def __init__(self) -> None:
        self.phase_serial = 0
        self.phase_peak_total = 0
        self.phase_peak = [0] * N_CATS
        self.phase_peak_tags = [0] * N_TAGS
        self.phase_peak_seq = 0
        self.phase_peak_module = -1
        self.phase_peak_ns = perf_counter_ns()  # when the phase's peak was reached (exports' time axis)
        self.peak_total = 0
        self.peak = [0] * N_CATS
        self.peak_tags = [0] * N_TAGS
        self.peak_seq = 0
        self.peak_phase_serial = 0
        self.peak_module = -1

    def check_peak(self) -> None:
        """The totals went up (a storage resized, moved or made outside ``add()``): the module frame on top, the
        phase and the run keep their highest."""
        total = self.total
        top = self.top
        if top is not None and total > top.max:
            top.max = total
        if total > self.phase_peak_total:
            # Slices, not copy() calls: no call while the peak is half recorded (see add()).
            self.phase_peak_total = total
            self.phase_peak = self.totals[:]
            self.phase_peak_tags = self.tag_act[:]
            self.phase_peak_seq = self.seq
            self.phase_peak_module = top.module if top is not None else -1
            if total > self.peak_total:
                self.peak_total = total
                self.peak = self.phase_peak[:]
                self.peak_tags = self.phase_peak_tags
                self.peak_seq = self.seq
                self.peak_phase_serial = self.phase_serial
                self.peak_module = self.phase_peak_module
            self.phase_peak_ns = perf_counter_ns()


class Ledger(Peaks):
    """Running accounting of live storages by category.

    ``rounding`` is the allocator's granularity (512 on CUDA, 1 on CPU): a
    storage of n bytes counts as ``ceil(n / rounding) * rounding`` (and 0 stays
    0), as the CUDA caching allocator rounds every block.
    """

    def __init__(self, rounding: int = 1) -> None:
        super().__init__()
        self.rounding = rounding
        self.entries: dict[int, Entry] = {}
        # What torch released and the ledger has not applied yet (Entry: a storage freed; Release: saved
        # slots let go), in the order it happened. queue_release is every weak reference's callback.
        self.released: "deque[Entry | Release | torch.Tensor]" = deque()
        self.queue_release = self.released.append
        self.grad_arrived: "Callable[[torch.Tensor], None] | None" = None  # takes parameters queued (light mode)
        self.settling = False  # settle() hands a queued gradient to grad_arrived (see there)
        # The Release references not yet queued: held here so that they are reachable when what they refer
        # to dies in a reference cycle (the collector calls back only weak references that are reachable).
        self.watched: "set[Release]" = set()
        # Whether released slots still count (the profile is active); frees always do until closed.
        self.unsaving = True
        self.totals = [0] * N_CATS
        self.total = 0
        self.seq = 0
        self.closed = False
        self.tag_act = [0] * N_TAGS
        # Module frames (innermost last).
        self.frames: list[Frame] = []
        self.top: "Frame | None" = None
        self.module_of_new = -1
        # The allocation stream, kept only when asked (record_stream): (seq, key, bytes) per storage made or
        # resized, (seq, key, -1) per storage freed, in the order torch made and freed them; and per phase
        # closed, (step, start seq, peak seq, end seq). None: nothing is kept, nothing is paid per event.
        self.stream: "list[tuple[int, int, int]] | None" = None
        self.moments: "list[tuple[int, int, int, int]] | None" = None
        # Beside the stream: the category each storage was made in (one per storage made, in order), and each move
        # of a live storage to another category as (seq, key) (memprof.simulate.depth_stream reads them).
        self.stream_cats: list[int] = []
        self.stream_moves: list[tuple[int, int, int]] = []  # (seq, key, the category it moved to)
        # The seqs of the moves that also moved the storage in its phase's peak (moves.move's retro).
        self.stream_retro: list[int] = []
        self.phase_start_seq = self.mark_seq = 0

    # -- sizes ---------------------------------------------------------------

    def size_of(self, nbytes: int) -> int:
        r = self.rounding
        if r <= 1 or nbytes == 0:
            return nbytes
        return -(-nbytes // r) * r

    # -- events --------------------------------------------------------------

    def add(self, storage: Storage, cat: int) -> Entry:
        """Register a storage (if new) under ``cat``; return its entry."""
        if self.released:
            self.settle()  # a storage freed and not yet applied may have had this address
        key = storage._cdata
        entry = self.entries.get(key)
        if entry is not None:
            return entry
        # One frame per new storage (the dispatch handler's path): size_of(), new_entry() and check_peak() are
        # inlined. The calls come first (the size, the weak reference) and last (the stream, the clock): a signal's
        # handler runs where a call returns, so the storage is registered whole, with its peak, or not at all.
        raw = nbytes = storage.nbytes()
        entry = Entry(storage, self.queue_release)
        r = self.rounding
        if r > 1 and nbytes:
            nbytes = -(-nbytes // r) * r
        seq = self.seq = self.seq + 1
        entry.key, entry.nbytes, entry.cat, entry.created = key, nbytes, cat, seq
        entry.module, entry.phase_serial = self.module_of_new, self.phase_serial
        entry.saved = entry.tag_bytes = entry.where_bytes = entry.moved = 0
        entry.tag = entry.where = -1
        entry.before = cat
        entry.savers = None
        self.entries[key] = entry
        self.totals[cat] += nbytes
        total = self.total = self.total + nbytes
        top = self.top
        if top is not None and total > top.max:
            top.max = total
        peaked = total > self.phase_peak_total
        if peaked:  # check_peak(), written out
            self.phase_peak_total = total
            self.phase_peak = self.totals[:]
            self.phase_peak_tags = self.tag_act[:]
            self.phase_peak_seq = seq
            self.phase_peak_module = top.module if top is not None else -1
            if total > self.peak_total:
                self.peak_total = total
                self.peak = self.phase_peak[:]
                self.peak_tags = self.phase_peak_tags
                self.peak_seq = seq
                self.peak_phase_serial = self.phase_serial
                self.peak_module = self.phase_peak_module
        if self.stream is not None:  # kept only when asked (an allocator replay): one attribute read otherwise
            self.stream.append((seq, key, raw))
            self.stream_cats.append(cat)
        if peaked:
            self.phase_peak_ns = perf_counter_ns()
        return entry

    def watch(self, holder: object, keys: "tuple[int, ...]",
              then: "Callable[[Release], None] | None" = None) -> Release:
        """When ``holder`` dies (autograd lets it go), release one saved slot of each storage in ``keys``, and
        call ``then`` with the reference returned, when the queue is settled (not as a finaliser)."""
        ref = Release(holder, self.queue_release)
        ref.keys, ref.then = keys, then
        self.watched.add(ref)
        return ref

    def settle(self) -> None:
        """Apply what torch released since the last call, in order (see the module's docstring); hot paths test
        ``released`` first. A freed storage leaves the totals; a saved slot released gives its storage back to
        temporaries when it was the last; a queued parameter's gradient goes to ``grad_arrived``. Written out:
        one frame per batch. A signal's handler runs where a call returns, so each event is applied with no call
        between its first change and its last and leaves the queue only once applied: an exception a handler
        raises here (the user may catch it and train on) leaves every event applied whole or not at all, and the
        next settling finishes the queue. A call from within a queued gradient's handling (it begins the backward
        phase) finds the queue empty: the queue before that event is applied, the rest comes after."""
        released = self.released
        if self.closed:
            released.clear()
            return
        # The loop is written here, not in a helper: one frame per batch.
        entries, totals, tag_act = self.entries, self.totals, self.tag_act
        while released:
            ref = released[0]
            if ref.__class__ is Entry:
                key = ref.key
                if entries.get(key) is ref:  # else forgotten already: closed, applied, or another storage's address
                    n, cat = ref.nbytes, ref.cat
                    self.seq += 1
                    del entries[key]
                    totals[cat] -= n
                    self.total -= n
                    if cat == ACTIVATIONS:
                        if ref.tag >= 0:
                            tag_act[ref.tag] -= ref.tag_bytes
                        if ref.where >= 0:
                            tag_act[ref.where] -= ref.where_bytes
                    if self.stream is not None:
                        self.stream.append((self.seq, key, -1))
            elif ref.__class__ is Release:  # (a test of __class__: isinstance() would cost a call per event)
                rel: Release = ref
                self.watched.discard(rel)
                then = rel.then
                if then is not None:
                    rel.then = None  # called once, whatever happens in it
                    then(rel)
                while rel.keys:
                    entry = entries.get(rel.keys[0]) if self.unsaving else None
                    rel.keys = rel.keys[1:]
                    if entry is not None and entry.cat == ACTIVATIONS:
                        entry.saved -= 1
                        if entry.saved == 0:
                            # move(entry, TEMPORARIES) written out: no call while the slot is half released.
                            n = entry.nbytes
                            totals[ACTIVATIONS] -= n
                            totals[TEMPORARIES] += n
                            entry.cat = TEMPORARIES
                            self.seq += 1
                            if self.stream is not None:
                                self.stream_moves.append((self.seq, entry.key, TEMPORARIES))
                            entry.moved, entry.before = self.seq, ACTIVATIONS
                            if entry.tag >= 0:
                                tag_act[entry.tag] -= entry.tag_bytes
                            if entry.where >= 0:
                                tag_act[entry.where] -= entry.where_bytes
            elif self.grad_arrived is not None:  # a parameter with a new gradient (light mode's gradient hook)
                # Its handling may settle (it begins the backward): an empty queue is shown meanwhile, the rest waits
                self.settling, self.released = True, _NONE_NOW
                try:
                    self.grad_arrived(ref)  # type: ignore[arg-type]
                finally:
                    self.settling, self.released = False, released
            released.popleft()

    def resize(self, entry: Entry, nbytes: int) -> None:
        """A live storage changed size in place (``resize_``, an ``out=`` op growing its buffer)."""
        new = self.size_of(nbytes)
        delta = new - entry.nbytes
        if not delta:
            return
        self.seq += 1
        if self.stream is not None:
            self.stream.append((self.seq, entry.key, nbytes))
        entry.nbytes = new
        self.totals[entry.cat] += delta
        self.total += delta
        self.check_peak()

    # -- phases ----------------------------------------------------------------

    def start_phase(self) -> None:
        """Begin a new phase: its peak starts at the current level."""
        self.settle()  # what torch released before the boundary belongs to the phase that ends
        self.phase_serial += 1
        self.phase_start_seq = self.seq
        self.phase_peak_total = self.total  # the phase's peak starts again here (Peaks), written out: no call
        self.phase_peak = self.totals.copy()
        self.phase_peak_tags = self.tag_act.copy()
        self.phase_peak_seq = self.seq
        self.phase_peak_module = self.top.module if self.top is not None else -1
        self.phase_peak_ns = perf_counter_ns()

    def close(self) -> None:
        """Stop accounting; drop every weak reference so no callback runs later."""
        self.closed = True
        self.entries.clear()
        self.watched.clear()
        self.released.clear()
        self.frames.clear()
        self.top = None


def breakdown(totals: list[int], *, light: bool, where: str, device: "DeviceReading | None" = None) -> Breakdown:
    """The ledger's totals as a Breakdown, with what the device reported (``where``: start, peak,
    end, now or sample). In light mode temporaries come from the allocator, where there is one."""
    values: list["int | None"] = list(totals)
    total: "int | None"
    if light:
        values[TEMPORARIES] = None
        total = None
        allocated = None
        if device is not None and where in ("peak", "end", "now") and device.allocated is not None:
            allocated = device.peak_allocated if where == "peak" else device.allocated
        if allocated is not None:
            known = sum(v for v in totals[:TEMPORARIES])
            rest = values[TEMPORARIES] = max(0, allocated - known)
            total = known + rest
    else:
        total = sum(totals)
    overhead = outside = None
    if device is not None and total is not None:
        if device.reserved is not None:
            overhead = max(0, device.reserved - total)
        if device.nvml_used is not None and device.reserved is not None:
            outside = max(0, device.nvml_used - max(device.reserved, total))
    full = values + [overhead, outside]
    if total is not None:
        total += (overhead or 0) + (outside or 0)
    return Breakdown(tuple(full), total)


def tag_pairs(values: list[int]) -> tuple[tuple[str, int], ...]:
    """The ledger's live bytes per tag as (name, bytes) pairs, the empty ones left out."""
    return tuple((name, v) for name, v in zip(TAGS, values) if v)
