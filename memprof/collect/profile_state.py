"""What a profile says about itself, read from outside: whether it runs, how it measures, and its record.

:class:`ProfileState` is the reading side of :class:`memprof.collect.profiler.Profiler`: the queries a user,
a callback or the report makes, which change nothing. The profiler's lifecycle (start, stop, steps) keeps the
fields they read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ProfilerStateError
from .freeze import build_trace, latest_recorded
from .state import EXACT

if TYPE_CHECKING:
    from ..record.trace import StepRecord, Trace
    from .allocator_source import AllocatorPhase
    from .closing import Closing
    from .state import Run
    from .wiring import Collectors

__all__ = ["ProfileState"]

_STATE_WORDS = {"new": "it was never started", "done": "it was already stopped", "failed": "its start failed"}


class ProfileState:
    """A profile's state and record, as its public properties read them."""

    #: What every hook reads (the profiler pushes ``active`` and the thread onto it).
    run: "Run"
    #: The collectors, once the block has begun (None before, and when their start failed).
    collectors: "Collectors | None"
    # "new", "active", "done" or "failed".
    _state: str
    # What ending the profile left (None until it ends, or its start fails).
    _closing: "Closing | None"
    # Inside on_trace_ready, where prof.report() reads the run so far.
    _in_callback: bool

    @property
    def mode(self) -> str:
        """``"exact"`` or ``"light"``: how this profile measures (``"auto"`` decided by the device; a model
        running compiled code may turn exact mode light at the start)."""
        return EXACT if self.run.source == "allocator" else self.run.mode

    @property
    def running(self) -> bool:
        """Between :meth:`start` (or entering ``with``) and :meth:`stop` (or leaving it)."""
        return self._state == "active"

    @property
    def oom_dump_path(self) -> "str | None":
        """Where the OOM dump was written, after an out-of-memory error ended the block."""
        return self._closing.oom_dump_path if self._closing is not None else None

    @property
    def window(self) -> "tuple[int, int] | None":
        """The first and last step of the recorded window that just ended (in ``on_trace_ready``)."""
        windows = self.collectors.windows if self.collectors is not None else None
        return windows.window if windows is not None else None

    @property
    def allocator_phases(self) -> "tuple[AllocatorPhase, ...]":
        """With ``source="allocator"``: each phase as the CUDA allocator's own events give it (its start, peak,
        the peak's moment and end by category), in order; empty otherwise."""
        src = self.collectors.allocator if self.collectors is not None else None
        return tuple(src.records) if src is not None else ()

    def latest_step(self) -> "StepRecord | None":
        """The record of the last step that ended and was recorded (``None`` before the first), while the
        profiler runs or after: what callbacks log each step. What the run could not measure (so far) is
        ``None`` in it, as in the report."""
        if self._state in ("new", "failed") or self.collectors is None:
            return None
        trace = self._closing.trace if self._closing is not None else None
        if trace is not None:
            return trace.steps[-1] if trace.steps else None
        return latest_recorded(self.collectors)

    @property
    def trace(self) -> "Trace":
        """The frozen record. Available after the block ends (also after an exception)."""
        if self._in_callback and self._state == "active":
            assert self.collectors is not None
            return build_trace(self.collectors)  # the run so far, at the end of a window
        closing = self._closing
        if closing is None or closing.trace is None:
            raise self._no_record(closing)
        return closing.trace

    def _no_record(self, closing: "Closing | None") -> ProfilerStateError:
        """Why there is no record to read, and what to do."""
        if self._state == "new":
            return ProfilerStateError(
                "nothing was profiled yet; run your step inside 'with memprof.profile(model, optimizer) as prof:' "
                "and read prof.report() after the block"
            )
        if self._state == "active":
            return ProfilerStateError(
                "the profiler is still running; read prof.report() after the 'with' block ends"
            )
        if self._state == "failed":
            return ProfilerStateError(
                f"profiling never started: setting it up raised {closing.setup_error if closing else None}; fix "
                "that error (it was raised to your code too) and profile again"
            )
        return ProfilerStateError(
            f"memprof could not build the record of this profile: "
            f"{(closing.freeze_error if closing else None) or 'it was interrupted'} "
            "(everything it installed was removed, and your code ran unchanged); profile again, and report "
            "the error to memprof if it recurs"
        )

    def _state_words(self) -> str:
        return _STATE_WORDS.get(self._state, self._state)
