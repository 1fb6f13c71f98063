"""The profiler: the public face of a profile. It checks what it is given, owns the run state and the
lifetime of everything installed, and hands the wiring to :mod:`.wiring`.

``memprof.profile(model, optimizer)`` returns a :class:`Profiler`, a context
manager. While it is active, the collectors in :mod:`memprof.collect` see:

* every storage an op creates (exact mode: a dispatch mode, :mod:`.dispatch`),
* what autograd saves for backward (saved-tensor hooks, :mod:`.saved`, :mod:`.graph_saves`),
* the model's module calls, forward and backward (:mod:`.modules`, :mod:`.frames`),
* parameters and gradients as autograd stores them (:mod:`.params`),
* optimizer steps and state (torch's global step hooks, :mod:`.optimizer`),
* steps and phases (:mod:`.phases`), and on accelerators the device's
  own counters (:mod:`.device`).

Everything it installs sits on one undo stack (:mod:`.undo`) that
:mod:`.closing` unwinds on exit, also when the body raises, and whatever
any step of leaving raises (a second Ctrl-C, a user exception whose
``__str__`` fails): the exception propagates unchanged and the record up to
the failure stays readable through :meth:`Profiler.report`. The record itself
is built by :mod:`.freeze`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Callable, Iterator, Sequence, TypeVar

from typing_extensions import Self

import torch
from torch import nn

from . import marks
from ..errors import (InvalidArgumentError, MemprofWarning, ProfilerStateError, error_text, is_interrupt,
                      remember_signal_handlers)
from ..record.trace import Breakdown
from .allocator_source import resolved_mode
from .arguments import checked
from .closing import Closing
from .device import DeviceProbe
from .dispatch import pop_orphan_modes
from .freeze import live_modules, live_storages
from .ledger import Ledger, breakdown
from . import slots
from .oom import OomDump, checked_folder
from .profile_state import ProfileState
from .saved_hooks import pop_orphans
from .state import EXACT, LIGHT, Run
from .undo import UndoStack
from .wiring import Collectors, Wiring, wire

if TYPE_CHECKING:
    from types import TracebackType

    from torch._subclasses.fake_tensor import FakeTensorMode

    from .dispatch import DispatchMode
    from .schedule import Schedule

__all__ = ["Profiler", "profile"]

#: The profiler's own class, a facade's subclass included: what its ``on_trace_ready`` is handed (mypy types
#: ``self`` as Self only in a method whose signature names Self, which a callback's runner does not).
_P = TypeVar("_P", bound="Profiler")

_get_ident = threading.get_ident


def _warn_ended_elsewhere(exc: BaseException) -> None:
    """A profile ended with the user's ``exc`` in another thread than the one that started it: what a plain
    ``stop()`` there raises (:class:`ProfilerStateError`) is said as a warning, never raised over ``exc``, at the
    first line outside this module (the user's ``stop(exc)`` or ``__exit__`` call)."""
    level, frame = 1, sys._getframe()
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    try:
        warnings.warn(
            f"memprof: the profile was ended in another thread than the one that started it, with "
            f"{error_text(exc, first_line=True)}: everything it installed is removed and the error is in its record, "
            "but ops the starting thread ran meanwhile may be counted in part; end a profile in the thread that "
            "started it (nothing is raised here, so that your error stays the one raised)",
            MemprofWarning, stacklevel=level)
    except Exception as failure:  # warnings turned into errors: the user's error must still be the one they see
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        pass


def profile(
    model: nn.Module,
    optimizer: "torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None" = None,
    *,
    mode: str = "auto",
    timeline: bool = True,
    operations: bool = False,
    schedule: "Schedule | None" = None,
    on_trace_ready: "Callable[[Profiler], object] | None" = None,
    oom_dump: "str | os.PathLike[str] | None" = None,
    record_routing: bool = False,
    record_allocations: bool = False,
    source: str = "dispatch",
    carry_optimizer_steps: bool = True,
) -> "Profiler":
    """Profile the training (or evaluation) of ``model`` inside a ``with`` block.

    ``optimizer`` may be one optimizer, several, a wrapper of one (accelerate's,
    Lightning's), or ``None``; any other optimizer that steps the model's
    parameters is measured too, and until one is, each backward ends a step.
    ``mode`` is ``"exact"`` (every storage, to the byte; default on CPU), ``"light"``
    (allocator counters and hooks only, default on accelerators) or ``"auto"``.
    ``timeline=False`` skips the per-module samples that plots use.
    ``operations=True`` (exact mode) also records every op's class, flops and
    bytes moved, for :meth:`Report.operations` (a few microseconds per op).
    ``schedule=memprof.schedule(...)`` records only the steps it selects, and
    turns memprof off between them; ``on_trace_ready(prof)`` is called at the
    end of each recorded window (``prof.report()`` then reads the run so far,
    ``prof.window`` is the window's first and last step).
    ``oom_dump="dir/"``: when an out-of-memory error leaves the block, the
    trace up to it is written there as ``memprof-oom-<rank>-<pid>-<time>.json``
    (on CUDA with a memory_viz snapshot beside it); the folder is created and
    checked now, the exception propagates unchanged.
    ``record_routing=True`` also records, for a mixture-of-experts model, how many tokens each router call
    sent to each expert (``report.trace.routing``), for a simulation to replay:
    ``memprof.estimate(..., routing=report)``.
    ``record_allocations=True`` (exact mode) keeps every storage made and freed, in order, for
    :meth:`Report.what_a_gpu_would_reserve` (the stream grows with the run: for a few steps).
    ``source="allocator"`` (exact mode, CUDA) takes exact mode's figures from the caching allocator's own
    events instead of a dispatch mode: no Python runs per op, the hooks run as in light mode and say which
    address holds what, every phase is reduced from the events (:attr:`Profiler.allocator_phases`), and the
    record's figures are those (``source="dispatch"`` stays the default). Whenever the allocator records its
    history on CUDA (memprof's or your own ``torch.cuda.memory._record_memory_history``), its entries are
    labelled with memprof's phase, step and module, which memory_viz shows.
    ``carry_optimizer_steps=False`` (exact mode) measures every optimizer step op by op; by default a step
    whose settings, tensors and state match a clean measured step of the same optimizer is carried: run without
    memprof's dispatch mode and replayed from that step, with the same figures (``report.trace.optimizer_steps``
    says which steps were which). ``operations=True``, ``record_allocations=True`` and ``oom_dump=`` measure
    every step.

    However long the run, the record stays bounded: every step is summarised
    per phase (:meth:`Report.phase_stats`), and full detail is kept for the
    first steps, the peak's step, the last step and the steps a schedule
    records.

    The profiler holds no strong reference to the model, its tensors or the
    optimizer after the block ends.
    """
    return Profiler(model, optimizer, mode=mode, timeline=timeline, operations=operations, schedule=schedule,
                    on_trace_ready=on_trace_ready, oom_dump=oom_dump, record_routing=record_routing,
                    record_allocations=record_allocations, source=source,
                    carry_optimizer_steps=carry_optimizer_steps)


class Profiler(ProfileState):
    """A profiling session: ``memprof.Profiler(model, optimizer, ...)`` takes the arguments of
    :func:`memprof.profile`.

    Use once: either ``with prof:`` or ``prof.start()`` ... ``prof.stop()``, a single time. After
    it, :attr:`trace` is the frozen record and :meth:`report` its views.
    """

    #: The collector's dispatch mode where not its own (None): a simulation's profile
    #: (:class:`~memprof.collect.simulated.SimulatedProfile`) has one for beneath the simulation's function mode.
    _dispatch_mode: "type[DispatchMode] | None" = None

    def __init__(
        self,
        model: nn.Module,
        optimizer: "torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None" = None,
        *,
        mode: str = "auto",
        timeline: bool = True,
        operations: bool = False,
        schedule: "Schedule | None" = None,
        on_trace_ready: "Callable[[Self], object] | None" = None,
        oom_dump: "str | os.PathLike[str] | None" = None,
        record_routing: bool = False,
        record_allocations: bool = False,
        source: str = "dispatch",
        carry_optimizer_steps: bool = True,
        _allow_meta: bool = False,
        _rounding: "int | None" = None,
        _fake_mode: "FakeTensorMode | None" = None,
    ) -> None:
        optimizers, device = checked(model, optimizer, mode, timeline, operations, schedule, on_trace_ready,
                                      _allow_meta)
        for name, value in (("record_routing", record_routing), ("carry_optimizer_steps", carry_optimizer_steps)):
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"{name} must be True or False, got {value!r}")
        self._record_routing, self._carry = record_routing, carry_optimizer_steps and oom_dump is None
        # Called with this profiler: a facade's subclass hands its callback an instance of itself.
        self._on_trace_ready: "Callable[[Self], object] | None" = on_trace_ready
        self.schedule = schedule
        self._mode_requested = mode
        mode, self._allocator = resolved_mode(mode, device, source, schedule)
        self.device, self._want_operations = device, bool(operations)
        #: What every hook reads: the profiler pushes ``active`` and the thread onto it.
        self.run = Run(mode, device, bool(timeline), self._allocator)
        self._model_ref = weakref.ref(model)
        # Held strongly only until the block ends (a model built inline must survive until then).
        self._model_hold: "nn.Module | None" = model
        self._optimizer_refs = [weakref.ref(o) for o in optimizers]
        # _in_callback: inside on_trace_ready, where prof.report() reads the run so far.
        self._state, self._in_callback = "new", False
        self.probe = DeviceProbe(device)
        self.ledger = Ledger(rounding=_rounding if _rounding is not None else self.probe.rounding)
        if record_allocations:
            if mode != EXACT:
                raise InvalidArgumentError("record_allocations=True needs mode='exact' with source='dispatch': light "
                                           "mode and the allocator's events do not see each storage made and freed")
            marks.record_stream(self.ledger)
        self._stack: "UndoStack | None" = None
        self._fake_mode = _fake_mode  # a simulation's fake-tensor mode (its tensors are the run's)
        #: The collectors, once the block has begun (None before, and when their start failed).
        self.collectors: "Collectors | None" = None
        self._closing: "Closing | None" = None  # what ending the profile left
        self.oom_dump = OomDump(checked_folder(oom_dump), device) if oom_dump is not None else None

    # ------------------------------------------------------------------ public
    def start(self) -> Self:
        """Begin profiling: install every hook (what entering ``with prof:`` does). Pair it with
        :meth:`stop`, for callbacks and loops that cannot hold a ``with`` block."""
        return self.__enter__()

    def stop(self, error: "BaseException | None" = None) -> None:
        """End profiling: remove every hook and freeze the record (what leaving ``with prof:`` does).
        :meth:`report` is readable afterwards. ``error``: the exception that ended the run, recorded as
        a ``with`` block records one (what was live, an OOM and its dump); it is not raised, and nothing
        else is either (what failed while closing is a warning and a note).

        Called in another thread than the one that started the profile, it removes everything as well
        and the record says so (ops that thread ran meanwhile may be counted in part); then, as leaving
        the ``with`` block there does, a plain ``stop()`` raises :class:`ProfilerStateError` (profiles
        are per thread), while ``stop(error)`` records the error and warns (:class:`MemprofWarning`)
        instead: raising there would put memprof's error in place of yours in the handler that is about
        to re-raise it. ``error`` that is no exception is refused with :class:`InvalidArgumentError`
        once the profile has ended all the same (no hook stays installed)."""
        if self._state != "active":
            raise ProfilerStateError(
                "stop() was called on a profiler that is not running (" + self._state_words() + "); call "
                "prof.start() first, and stop() once"
            )
        if error is not None and not isinstance(error, BaseException):
            self._stop_refusing(error)
        self.__exit__(type(error) if error is not None else None, error, None)

    def _stop_refusing(self, error: object) -> None:
        """``stop(error=...)`` was given what is no exception: end the profile without it (a call from an
        ``except`` block must not leave every hook installed), then refuse it, with what ending raised (a
        profile ended in another thread, ``on_trace_ready``'s error) as its cause; an interrupt propagates."""
        refused = InvalidArgumentError(
            f"stop(error=...) takes the exception that ended the run, got {type(error).__name__}; the profile was "
            "stopped without recording it")
        try:
            self.__exit__(None, None, None)
        except Exception as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            raise refused from exc
        raise refused

    def end_step(self) -> None:
        """The current step is over (all its optimizers have stepped): close its record now instead of
        at the next forward, so that :meth:`latest_step` reads it. For callbacks at a step's end."""
        if self._state != "active":
            raise ProfilerStateError("end_step() is only valid while the profiler runs; call prof.start() first")
        if self.run.paused:
            return  # a step the schedule does not watch: counted at the next forward
        assert self.collectors is not None  # built when the profile started
        self.collectors.phases.close_pending_step()

    def mark_inputs(self, *objs: object) -> None:
        """The tensors in ``objs`` (in lists, tuples, dicts too) are inputs: the batch a framework hands a model
        whose call memprof does not see (Lightning's ``training_step``). Paused by a schedule: nothing."""
        if self._state != "active":
            raise ProfilerStateError("mark_inputs() is only valid while the profiler runs; call prof.start() first")
        if self.run.active and _get_ident() == self.run.thread:
            assert self.collectors is not None
            self.collectors.storages.mark_inputs(objs)

    def __enter__(self) -> Self:
        remember_signal_handlers()  # one that uninstalls itself before it raises is still the user's
        if self._state != "new":
            raise ProfilerStateError(
                "this profiler was already used (" + self._state_words() + "); profilers are single-use, "
                "create a new one with memprof.profile() or memprof.Profiler()"
            )
        model = self._model_ref()
        assert model is not None  # held by self._model_hold until the block ends
        thread = _get_ident()
        slots.refuse_taken(model, thread)
        # What profiles ended from another thread left on this thread's stacks, where it is on top.
        pop_orphans()
        pop_orphan_modes()
        # No gc.collect() here (it cost 130-270 ms per block): the ledger counts only storages it
        # registered, so garbage from before the profile never enters its totals, and a parameter,
        # gradient or state tensor that garbage still holds is memory the process really holds.
        self._state = "active"
        run = self.run
        run.active = True
        run.thread = thread
        try:
            # Inside the try: an interrupt right after a slot is taken must still free it.
            slots.take(model, thread)
            self._stack = UndoStack()
            self._setup(model)
        except BaseException as exc:
            # The user's own error comes through unchanged (a lazy module, a hook that raises);
            # nothing memprof installed stays behind, and no partial record is made of it.
            self._state = "failed"
            run.active = False
            closing = self._closing = self._closing_steps()
            closing.setup_error = type(exc).__name__
            closing.abandon_start(exc)
            raise
        return self

    def _setup(self, model: nn.Module) -> None:
        """Build and wire the collectors (:mod:`.wiring`), then watch for an out-of-memory error."""
        stack = self._stack
        assert stack is not None
        optimizers = [o for o in (r() for r in self._optimizer_refs) if o is not None]
        ready = self._window_ready if self._on_trace_ready is not None else None
        how = Wiring(self._mode_requested, self._want_operations, self._fake_mode, self.schedule, ready,
                     record_routing=self._record_routing, allocator=self._allocator, carry=self._carry,
                     dispatch_mode=self._dispatch_mode)
        self.collectors = wire(model, optimizers, self.run, self.ledger, self.probe, stack, how)
        if self.oom_dump is not None:
            self.oom_dump.start(self.live_now)
            stack.callback(self.oom_dump.stop)

    def _window_ready(self: _P) -> None:
        """A schedule's window ended: on_trace_ready reads the run so far through this profiler."""
        assert self._on_trace_ready is not None
        self._in_callback = True
        try:
            self._on_trace_ready(self)
        finally:
            self._in_callback = False

    def __exit__(self, exc_type: "type[BaseException] | None", exc: "BaseException | None",
                 tb: "TracebackType | None") -> None:
        """Record ``exc``, remove everything, freeze the record (:mod:`.closing` says what it raises:
        never over ``exc``, the body's exception, which propagates unchanged)."""
        if self._state != "active":
            return None
        elsewhere = _get_ident() != self.run.thread
        closing = self._closing = self._closing_steps()
        closing.leave(exc, elsewhere=elsewhere)
        if elsewhere and exc is not None:
            _warn_ended_elsewhere(exc)
        return None

    def _closing_steps(self) -> Closing:
        return Closing(self.run, self.ledger, self._stack, self._release, self.collectors, self.oom_dump, self.live_now)

    def live_now(self) -> "tuple[Breakdown, tuple[tuple[str, int], ...], tuple[tuple[int, int, str, str], ...]] | None":
        """What is live now, by category, by creating module, and storage by storage; None in a step a
        schedule does not watch, where memprof saw none of what the step made (wrong, not partial)."""
        run = self.run
        if run.paused:
            run.note("the error was raised in a step the schedule did not watch: what was live then is not measured "
                     "(profile without a schedule, or with one that records that step, to see it)")
            return None
        assert self.collectors is not None  # read while the profile runs
        self.ledger.settle()
        return (breakdown(self.ledger.totals, light=run.mode == LIGHT, where="now"), live_modules(self.collectors),
                live_storages(self.collectors))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Mark one step explicitly: ``with prof.step(): ...``.

        Once used, steps are delimited only by these blocks (optimizer steps
        and backward passes no longer end steps on their own).
        """
        if self._state != "active":
            raise ProfilerStateError("prof.step() is only valid inside the 'with memprof.profile(...)' block")
        c = self.collectors
        assert c is not None
        c.phases.explicit_steps()
        try:
            yield
        finally:
            if self._state == "active":
                if c.windows is not None and self.run.paused:
                    c.windows.blocks_ended += 1  # a step the schedule does not watch ended
                else:
                    c.phases.end_step()

    def _release(self) -> None:
        """The profile has ended: the model and the thread may be profiled again (safe to run twice)."""
        self._model_hold = None
        if self.run.active:
            # What autograd released while the profile ran still counts; what it releases later does not.
            self.ledger.settle()
            self.ledger.unsaving = False
        self.run.active = False
        if self._state != "failed":
            self._state = "done"
        slots.free(self._model_ref(), self.run.thread)
