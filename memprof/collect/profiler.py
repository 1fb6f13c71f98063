"""The profiler: validates what it is given, wires the collectors, and owns every hook's lifetime.

``memprof.profile(model, optimizer)`` returns a :class:`Profiler`, a context
manager. While it is active, the collectors in :mod:`memprof.collect` see:

* every storage an op creates (exact mode: a dispatch mode, :mod:`.track.storages`),
* what autograd saves for backward (saved-tensor hooks, :mod:`.track.saved`),
* the model's module calls, forward and backward (:mod:`.track.modules`),
* parameters and gradients as autograd stores them (:mod:`.track.params`),
* optimizer steps and state (torch's global step hooks, :mod:`.track.optimizer`),
* steps and phases (:mod:`.track.phases`), and on accelerators the device's
  own counters (:mod:`.track.device`).

Everything it installs sits on one undo stack (:mod:`.track.undo`) that
:mod:`.track.closing` unwinds on exit, also when the body raises, and whatever
any step of leaving raises (a second Ctrl-C, a user exception whose
``__str__`` fails): the exception propagates unchanged and the record up to
the failure stays readable through :meth:`Profiler.report`. The record itself
is built by :mod:`.track.record`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
import torch.optim.optimizer as _optim_mod
from torch import nn

from ..errors import InvalidArgumentError, ProfilerStateError
from ..record.trace import Breakdown, OomRecord, StepRecord, Trace
from .device import DeviceProbe
from .kv_cache import CacheTracker
from .ranks import rank_info
from .shards import ShardTracker, sharding
from .ledger import BUFFERS, WEIGHTS, Ledger, breakdown
from .arguments import checked
from .oom import OomDump, checked_folder
from .modules import ModuleTracker, attribute_tensors, unique_params
from .operations import OperationLog
from .optimizer import OptimizerTracker
from .params import ParamTracker, is_lazy
from .phases import PhaseTracker
from .windows import Windows
from .freeze import build_trace, latest_recorded, live_modules, live_storages
from .saved import SavedTracker
from .saved_hooks import pop_orphans
from .dispatch import KEEPS_COMPILE, StorageTracker, pop_orphan_modes
from .closing import Closing
from .undo import UndoStack

if TYPE_CHECKING:
    from ..report import Report
    from .schedule import Schedule

__all__ = ["Profiler", "profile"]

_get_ident = threading.get_ident

# Models currently being profiled, so that a second profiler on the same model is refused.
_ACTIVE_MODELS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
# Profiles active per thread id: dispatch modes and saved-tensor hooks are per thread, and an
# inner profile's hooks would hide every saved tensor from the outer one. A dict rather than a
# threading.local, so that a profile ended from another thread still frees its thread's slot.
_ACTIVE_THREADS: dict[int, int] = {}


def profile(
    model: nn.Module,
    optimizer: "torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None" = None,
    *,
    mode: str = "auto",
    timeline: bool = True,
    operations: bool = False,
    schedule: "Schedule | None" = None,
    on_trace_ready: "Callable[[Profiler], Any] | None" = None,
    oom_dump: "str | os.PathLike[str] | None" = None,
    record_routing: bool = False,
) -> "Profiler":
    """Profile the training (or evaluation) of ``model`` inside a ``with`` block.

    ``optimizer`` may be one optimizer, several, a wrapper of one (accelerate's,
    Lightning's), or ``None``; any other optimizer that steps the model's
    parameters is measured too, and until one is, each backward ends a step.
    ``mode`` is ``"full"`` (exact: every storage, default on CPU), ``"light"``
    (allocator counters and hooks only, default on accelerators) or ``"auto"``.
    ``timeline=False`` skips the per-module samples that plots use.
    ``operations=True`` (full mode) also records every op's class, flops and
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

    However long the run, the record stays bounded: every step is summarised
    per phase (:meth:`Report.phase_stats`), and full detail is kept for the
    first steps, the peak's step, the last step and the steps a schedule
    records.

    The profiler holds no strong reference to the model, its tensors or the
    optimizer after the block ends.
    """
    return Profiler(model, optimizer, mode=mode, timeline=timeline, operations=operations, schedule=schedule,
                    on_trace_ready=on_trace_ready, oom_dump=oom_dump, record_routing=record_routing)


class Profiler:
    """A profiling session: ``memprof.Profiler(model, optimizer, ...)`` takes the arguments of
    :func:`memprof.profile`.

    Use once: either ``with prof:`` or ``prof.start()`` ... ``prof.stop()``, a single time. After
    it, :attr:`trace` is the frozen record and :meth:`report` its views.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: "torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None" = None,
        *,
        mode: str = "auto",
        timeline: bool = True,
        operations: bool = False,
        schedule: "Schedule | None" = None,
        on_trace_ready: "Callable[[Profiler], Any] | None" = None,
        oom_dump: "str | os.PathLike[str] | None" = None,
        record_routing: bool = False,
        _allow_meta: bool = False,
        _rounding: "int | None" = None,
        _fake_mode: Any = None,
    ) -> None:
        optimizers, device = checked(model, optimizer, mode, timeline, operations, schedule, on_trace_ready,
                                      _allow_meta)
        if not isinstance(record_routing, bool):
            raise InvalidArgumentError(f"record_routing must be True or False, got {record_routing!r}")
        self._record_routing = record_routing
        self.routing: Any = None  # a RoutingRecorder with record_routing=True
        self.schedule = schedule
        self._on_trace_ready = on_trace_ready
        self.windows: "Windows | None" = None
        #: Inside on_trace_ready: prof.report() reads the run so far.
        self.in_callback = False
        self.mode_requested = mode
        if mode == "auto":
            mode = "full" if device.type in ("cpu", "meta") else "light"
        self.mode = mode
        self.device = device
        # Per-module backward frames measure op-level memory, which only full mode sees;
        # light mode skips their tensor hooks (backward itself is found by grad and unpack hooks).
        self.backward_frames = mode == "full"
        self.timeline = bool(timeline)
        self._want_operations = bool(operations)
        self._model_ref = weakref.ref(model)
        # Held strongly only until the block ends (a model built inline must survive until then).
        self._model_hold: "nn.Module | None" = model
        self._optimizer_refs = [weakref.ref(o) for o in optimizers]
        self._state = "new"
        # Inside the block: hooks record; before and after it they do nothing (read on every hook call).
        self.active = False
        self._trace: "Trace | None" = None
        self.probe = DeviceProbe(device)
        self.ledger = Ledger(rounding=_rounding if _rounding is not None else self.probe.rounding)
        self.stack: "UndoStack | None" = None
        self._fake_mode = _fake_mode  # a simulation's fake-tensor mode (its tensors are the run's)
        self.shards: "ShardTracker | None" = None  # FSDP2's parameters, when the model is sharded with it
        self.backward_waits = False  # something queues end-of-backward work that the backward phase must include
        self.notes: list[str] = []
        self.changes: list[str] = []  # how the model or its optimizers changed inside the block
        self.thread = 0
        self._setup_error: "str | None" = None
        self._freeze_error: "str | None" = None
        self._windows_closed = False
        self.error: "str | None" = None
        self.live_at_error: "Breakdown | None" = None
        self.live_modules_at_error: tuple[tuple[str, int], ...] = ()
        self.live_storages_at_error: tuple[tuple[int, int, str, str], ...] = ()
        self.oom: "OomRecord | None" = None
        self.oom_dump = OomDump(self, checked_folder(oom_dump)) if oom_dump is not None else None
        #: Where the OOM dump was written, after an out-of-memory error ended the block.
        self.oom_dump_path: "str | None" = None

    # ------------------------------------------------------------------ public

    def start(self) -> "Profiler":
        """Begin profiling: install every hook (what entering ``with prof:`` does). Pair it with
        :meth:`stop`, for callbacks and loops that cannot hold a ``with`` block."""
        return self.__enter__()

    def stop(self, error: "BaseException | None" = None) -> None:
        """End profiling: remove every hook and freeze the record (what leaving ``with prof:`` does).
        :meth:`report` is readable afterwards. ``error``: the exception that ended the run, recorded as
        a ``with`` block records one (what was live, an OOM and its dump); it is not raised, and nothing
        else is either (what failed while closing is a warning and a note).

        Called in another thread than the one that started the profile, it removes everything as well
        and the record says so; then, as leaving the ``with`` block there does, a plain ``stop()``
        raises :class:`ProfilerStateError` (profiles are per thread), while ``stop(error)`` does not
        raise over the error it records."""
        if self._state != "active":
            raise ProfilerStateError(
                "stop() was called on a profiler that is not running (" + self._state_words() + "); call "
                "prof.start() first, and stop() once"
            )
        if error is not None and not isinstance(error, BaseException):
            raise InvalidArgumentError(f"stop(error=...) takes the exception that ended the run, got {type(error).__name__}")
        self.__exit__(type(error) if error is not None else None, error, None)

    @property
    def running(self) -> bool:
        """Between :meth:`start` (or entering ``with``) and :meth:`stop` (or leaving it)."""
        return self._state == "active"

    def end_step(self) -> None:
        """The current step is over (all its optimizers have stepped): close its record now instead of
        at the next forward, so that :meth:`latest_step` reads it. For callbacks at a step's end."""
        if self._state != "active":
            raise ProfilerStateError("end_step() is only valid while the profiler runs; call prof.start() first")
        phases = self.phases
        if self.windows is not None and self.windows.paused:
            return  # a step the schedule does not watch: counted at the next forward
        if phases.pending_step_end or (phases.pending_backward_end and not phases.optimizer_seen
                                       and not phases.explicit):
            phases.pending_step_end = phases.pending_backward_end = False
            self.params.release_stale_grads()
            phases.end_step()

    def mark_inputs(self, *objs: Any) -> None:
        """The tensors in ``objs`` (in lists, tuples, dicts too) are inputs: the batch a framework hands a model
        whose call memprof does not see (Lightning's ``training_step``). Paused by a schedule: nothing."""
        if self._state != "active":
            raise ProfilerStateError("mark_inputs() is only valid while the profiler runs; call prof.start() first")
        if self.active and _get_ident() == self.thread:
            self.storages.mark_inputs(objs)

    def latest_step(self) -> "StepRecord | None":
        """The record of the last step that ended and was recorded (``None`` before the first), while the
        profiler runs or after: what callbacks log each step. What the run could not measure (so far) is
        ``None`` in it, as in the report."""
        return latest_recorded(self)

    def _state_words(self) -> str:
        return {"new": "it was never started", "done": "it was already stopped",
                "failed": "its start failed"}.get(self._state, self._state)

    def __enter__(self) -> "Profiler":
        if self._state != "new":
            raise ProfilerStateError(
                "this profiler was already used (" + self._state_words() + "); profilers are single-use, "
                "create a new one with memprof.profile() or memprof.Profiler()"
            )
        model = self._model_ref()
        assert model is not None  # held by self._model_hold until the block ends
        if model in _ACTIVE_MODELS:
            raise ProfilerStateError(
                "memprof.profile() is already active on this model; exit that block first "
                "(one profiler per model at a time)"
            )
        thread = _get_ident()
        if _ACTIVE_THREADS.get(thread, 0):
            raise ProfilerStateError(
                "another memprof.profile() is active in this thread; profiles cannot nest (the inner one would "
                "hide saved tensors from the outer); profile the outer model once and read report.modules() "
                "for its submodules"
            )
        # What profiles ended from another thread left on this thread's stacks, where it is on top.
        pop_orphans()
        pop_orphan_modes()
        # No gc.collect() here (it cost 130-270 ms per block): the ledger counts only storages it
        # registered, so garbage from before the profile never enters its totals, and a parameter,
        # gradient or state tensor that garbage still holds is memory the process really holds.
        self._state = "active"
        self.active = True
        self.thread = thread
        try:
            # Inside the try: an interrupt right after a slot is taken must still free it.
            _ACTIVE_MODELS.add(model)
            _ACTIVE_THREADS[thread] = 1
            self.stack = UndoStack()
            self._setup(model)
        except BaseException as exc:
            # The user's own error comes through unchanged (a lazy module, a hook that raises);
            # nothing memprof installed stays behind, and no partial record is made of it.
            self._state = "failed"
            self.active = False
            self._setup_error = type(exc).__name__
            Closing(self).abandon_start(exc)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Record ``exc``, remove everything, freeze the record (:mod:`.track.closing` says what it raises:
        never over ``exc``, the body's exception, which propagates unchanged)."""
        if self._state != "active":
            return None
        Closing(self).leave(exc, elsewhere=_get_ident() != self.thread)
        return None

    def live_now(self) -> "tuple[Breakdown, tuple[tuple[str, int], ...], tuple[tuple[int, int, str, str], ...]] | None":
        """What is live now, by category, by creating module, and storage by storage; None in a step a
        schedule does not watch, where memprof saw none of what the step made (wrong, not partial)."""
        if self.windows is not None and self.windows.paused:
            msg = ("the error was raised in a step the schedule did not watch: what was live then is not measured "
                   "(profile without a schedule, or with one that records that step, to see it)")
            if msg not in self.notes:
                self.notes.append(msg)
            return None
        return (breakdown(self.ledger.totals, light=self.mode == "light", where="now"), live_modules(self),
                live_storages(self))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Mark one step explicitly: ``with prof.step(): ...``.

        Once used, steps are delimited only by these blocks (optimizer steps
        and backward passes no longer end steps on their own).
        """
        if self._state != "active":
            raise ProfilerStateError("prof.step() is only valid inside the 'with memprof.profile(...)' block")
        self.phases.explicit_steps()
        try:
            yield
        finally:
            if self._state == "active":
                if self.windows is not None and self.windows.paused:
                    self.windows.blocks_ended += 1  # a step the schedule does not watch ended
                else:
                    self.phases.end_step()

    @property
    def trace(self) -> Trace:
        """The frozen record. Available after the block ends (also after an exception)."""
        if self.in_callback and self._state == "active":
            return build_trace(self)  # the run so far, at the end of a window
        if self._trace is None:
            if self._state == "new":
                raise ProfilerStateError(
                    "nothing was profiled yet; run your step inside 'with memprof.profile(model, optimizer) as prof:' "
                    "and read prof.report() after the block"
                )
            if self._state == "active":
                raise ProfilerStateError(
                    "the profiler is still running; read prof.report() after the 'with' block ends"
                )
            if self._state == "failed":
                raise ProfilerStateError(
                    f"profiling never started: setting it up raised {self._setup_error}; fix that error "
                    "(it was raised to your code too) and profile again"
                )
            raise ProfilerStateError(
                f"memprof could not build the record of this profile: {self._freeze_error or 'it was interrupted'} "
                "(everything it installed was removed, and your code ran unchanged); profile again, and report "
                "the error to memprof if it recurs"
            )
        assert self._trace is not None
        return self._trace

    def report(self) -> "Report":
        """The :class:`memprof.Report` built on :attr:`trace`."""
        from ..report import Report

        return Report(self.trace)

    # ------------------------------------------------------------------ wiring

    def _setup(self, model: nn.Module) -> None:
        stack = self.stack
        assert stack is not None
        led = self.ledger
        # The collectors: each owns one concern; they reach each other through this hub.
        self.storages = StorageTracker(self)
        self.storages.fake_mode = self._fake_mode
        self.phases = PhaseTracker(self)
        self.params = ParamTracker(self)
        optimizers = [o for o in (r() for r in self._optimizer_refs) if o is not None]
        self.optimizers = OptimizerTracker(self, optimizers)
        self.phases.optimizer_seen = bool(optimizers)
        self.modules = ModuleTracker(self, model)
        self.saved = SavedTracker(self)
        self.kv = CacheTracker(self, model)
        self.rank = rank_info(model)
        self.shards = sharding(self, model)
        # Two steps, so that a failure in one still runs the other.
        stack.callback(self._close_saved_hooks)
        stack.callback(self.modules.remove_hooks)

        params = [p for p in unique_params(model) if not is_lazy(p)]
        self.param_dtypes = tuple(sorted({str(p.dtype).replace("torch.", "") for p in params}))
        self.register_existing()
        self.optimizers.start()
        self.start_totals = led.totals.copy()
        self.phases.start()

        # Hooks. Each registration goes on the stack right away so that a
        # failure half-way still removes what was installed.
        self.modules.adopt(model)
        if self.modules.compiled_paths and self.mode == "full" and not KEEPS_COMPILE:
            # With this torch any dispatch mode makes compiled code run eagerly, and for the rest of
            # the process: full mode would change the user's training.
            if self.mode_requested == "full":
                raise InvalidArgumentError(
                    f"{self.modules.compiled_paths[0]} runs torch.compile'd code, and with torch "
                    f"{torch.__version__} full mode's dispatch mode would make it run eagerly for the rest of "
                    "the process; profile it with mode='light', or upgrade torch (2.9 and later keep compiled "
                    "code compiled)"
                )
            self.mode = "light"
            self.backward_frames = self.saved.full = False
            self.notes.append(
                f"light mode: the model runs torch.compile'd code, which full mode's dispatch mode would make "
                f"run eagerly with torch {torch.__version__}"
            )
        pre, post = self.optimizers.pre_hook, self.optimizers.post_hook
        if "torch._dynamo" in sys.modules:
            # A compiled optimizer.step() calls the global step hooks from its compiled frame: run them
            # eagerly, outside the graph, rather than have dynamo trace memprof's code into it.
            pre, post = torch.compiler.disable(pre), torch.compiler.disable(post)
        stack.callback(_optim_mod.register_optimizer_step_pre_hook(pre).remove)
        stack.callback(_optim_mod.register_optimizer_step_post_hook(post).remove)
        # The model may gain parameters or submodules inside the block (a new head, lazy modules).
        from torch.nn.modules import module as _module_mod

        for name in ("register_module_parameter_registration_hook", "register_module_module_registration_hook"):
            register = getattr(_module_mod, name, None)
            if register is not None:
                stack.callback(register(self.params.registration_hook).remove)
        if self._want_operations and self.mode != "full":
            self.notes.append("operations=True needs mode='full' (it sees ops through the dispatch mode)")
        if self.mode == "full":
            if self._want_operations:
                self.storages.operations = OperationLog()
            self.storages.install()
            stack.callback(self.storages.uninstall, self.thread)
        else:
            self.probe.start_light()
            self.notes.extend(self.probe.light_notes())
            # Light mode has no dispatch mode: code outside the model's modules runs unseen.
            self.notes.append(
                "light mode sees no op outside the model's modules: what autograd saves there (the loss "
                "function's tensors) is not counted as activations, nor as inputs the tensors made before the "
                "profile that only code there uses (targets handed to the loss function, a metric accumulator "
                "such as acc += loss.detach()); on an accelerator both are among temporaries (full mode counts "
                "them)")
        self.phases.sample("start", "start")
        if self.schedule is not None:
            self.windows = Windows(self, self.schedule, self._on_trace_ready)
            self.windows.start()
        if self.oom_dump is not None:
            self.oom_dump.start()
            stack.callback(self.oom_dump.stop)
        if self._record_routing:
            from .routing import RoutingRecorder

            self.routing = RoutingRecorder(self)
            self.routing.__enter__()
            stack.callback(self.routing.__exit__, None, None, None)

    def _close_saved_hooks(self) -> None:
        """Undo memprof's per-thread saved-tensor pushes."""
        if not self.saved.hooks.close() and _get_ident() == self.thread:
            self.notes.append(
                "saved_tensors_hooks entered inside the profile were still active when it ended (above "
                "memprof's own pair), so memprof's pair is left inert beneath them until they exit"
            )

    def register_existing(self) -> None:
        """What exists now: weights, buffers, gradients, optimizer state (at the start, and when a
        schedule resumes)."""
        model = self._model_ref()
        if model is None:
            return
        params = [p for p in unique_params(model) if not is_lazy(p)]
        for p in params:
            self.storages.add_tensor(p, WEIGHTS)
        for p in params:
            if p.grad is not None:
                self.params.add_grad(p.grad, retro=False)
        for b in model.buffers():
            self.storages.add_tensor(b, BUFFERS)
        for mod in model.modules():
            for t in attribute_tensors(mod):  # module state kept as plain attributes, like buffers
                self.storages.add_tensor(t, BUFFERS)
        for opt in self.optimizers.all():
            self.optimizers.collect_state(opt, retro=False)

    @property
    def window(self) -> "tuple[int, int] | None":
        """The first and last step of the recorded window that just ended (in ``on_trace_ready``)."""
        return self.windows.window if self.windows is not None else None

    def _release(self) -> None:
        """The model and the thread may be profiled again."""
        model = self._model_ref()
        if model is not None:
            _ACTIVE_MODELS.discard(model)
        if self.thread:
            _ACTIVE_THREADS.pop(self.thread, None)
