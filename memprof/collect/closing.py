"""Ending a profile: what the error left, everything removed, the record frozen, what failed said.

The profile ends while the user's exception unwinds, or while a second Ctrl-C may land at any line,
so every step runs whatever the others raise (:mod:`.undo`): with the user's exception nothing is
raised over it; without one, once everything is removed, an interrupt is raised again, then
``on_trace_ready``'s own exception unchanged, then the ProfilerStateError of a profile ended in
another thread. memprof's own failures are a warning and a note, and a record that could not be
built says why when it is read.

A :class:`Closing` owns what ending the profile leaves (the record, or why there is none; what the error
left; where the OOM dump went), and the profiler reads it there.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Callable

from ..errors import MemprofWarning, ProfilerStateError, error_text, is_interrupt
from .oom import is_oom, oom_record
from .freeze import AtError, build_trace
from .undo import Failure, Failures, attempt, undo

if TYPE_CHECKING:
    from ..record.trace import Trace
    from .ledger import Ledger
    from .oom import LiveAtError, OomDump
    from .state import Run
    from .undo import UndoStack
    from .wiring import Collectors

__all__ = ["Closing"]

_CALLBACK = "on_trace_ready"
_ENDED_ELSEWHERE = (
    "this profile was ended in another thread than the one that started it: ops the starting thread ran "
    "while it was being closed may be counted in part")


class Closing:
    """The steps of ending one profile, what failed in them, and what they leave.

    ``stack`` holds everything the profile installed; ``release`` frees the profile's slots (the model and the
    thread may be profiled again) and marks it ended; ``collectors`` is None when the start failed before they
    were built; ``live_now`` reads what is live (``Profiler.live_now``).
    """

    def __init__(self, run: "Run", ledger: "Ledger", stack: "UndoStack | None", release: Callable[[], None],
                 collectors: "Collectors | None", oom_dump: "OomDump | None",
                 live_now: "Callable[[], LiveAtError | None] | None" = None) -> None:
        self.run = run
        self.ledger = ledger
        self.stack = stack
        self.release = release
        self.collectors = collectors
        self.oom_dump = oom_dump
        self.live_now = live_now
        self.failures: Failures = []
        #: What the error that ended the block left (empty without one).
        self.at_error = AtError()
        #: The record, once built; else why it could not be (``freeze_error``), or why the start failed.
        self.trace: "Trace | None" = None
        self.freeze_error: "str | None" = None
        self.setup_error: "str | None" = None
        #: Where the OOM dump was written, after an out-of-memory error ended the block.
        self.oom_dump_path: "str | None" = None
        self.windows_closed = False

    def leave(self, exc: "BaseException | None", elsewhere: bool) -> None:
        """What leaving the block does: record ``exc``, remove everything, freeze, say what failed, and
        raise only as the module docstring says."""
        failures = self.failures
        if elsewhere:
            self.run.notes.append(_ENDED_ELSEWHERE)
        if exc is not None:
            attempt(failures, "recording the error", self.record_error, exc)
        self.close(freeze=True)
        if self.at_error.oom is not None and self.oom_dump is not None and self.trace is not None:
            attempt(failures, "writing the OOM dump", self.write_oom_dump)
        elif self.oom_dump is not None:
            attempt(failures, "discarding the OOM snapshot", self.oom_dump.discard)
        callback = [f.exc for f in failures if f.what == _CALLBACK and exc is None]
        own = [f for f in failures if not (f.what == _CALLBACK and exc is None)]
        said: Failures = []
        attempt(said, "saying what failed", self.say, own, exc is not None)
        if exc is not None:
            return  # nothing raises over the body's exception
        interrupts = [f.exc for f in own + said if is_interrupt(f.exc)]
        if interrupts:
            raise interrupts[0]  # the user's Ctrl-C (or handler), now that nothing of memprof's is left installed
        if callback:
            raise callback[0]  # the user's on_trace_ready: its exception as it raised it
        if elsewhere:
            raise ProfilerStateError(
                "this profile was ended in another thread than the one that started it; everything it "
                "installed is removed (its dispatch mode leaves the starting thread at that thread's next op) "
                "and prof.report() holds what was measured, but ops that thread ran meanwhile may be counted "
                "in part: end a profile in the thread that started it"
            )

    def abandon_start(self, exc: BaseException) -> None:
        """The start failed half-way with ``exc`` (raised to the user after this): remove what was installed."""
        self.close(freeze=False)
        attempt(self.failures, "describing the error", self.describe_setup_error, exc)
        attempt([], "saying what failed", warn, self.failures, "while its start was being undone")

    # -- the error ---------------------------------------------------------------------------------

    def record_error(self, exc: BaseException) -> None:
        """What the error left: its description, what was live, an OOM's record. Each part on its own; an
        interrupt (a second Ctrl-C) skips the rest, which the notes then say."""
        failures = self.failures
        if not attempt(failures, "describing the error", self.describe_error, exc) and _interrupted(failures):
            return
        try:
            oom = is_oom(exc)
        except Exception as failure:  # the exception's own __str__ raised: it cannot be told to be an OOM
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            oom = False
        if not attempt(failures, "recording what was live at the error", self.record_live, oom) and _interrupted(
                failures):
            return
        if oom:
            attempt(failures, "recording the out-of-memory error", self.record_oom, exc)

    def describe_error(self, exc: BaseException) -> None:
        self.at_error.error = type(exc).__name__  # what stays if describing is interrupted
        self.at_error.error = error_text(exc)

    def describe_setup_error(self, exc: BaseException) -> None:
        self.setup_error = type(exc).__name__  # what stays if describing is interrupted
        self.setup_error = error_text(exc)

    def record_live(self, oom: bool) -> None:
        dump = self.oom_dump
        # At a CUDA OOM the allocator's observer took what was live at the failing allocation itself.
        live = dump.live if oom and dump is not None and dump.observed else None
        live = live or (self.live_now() if self.live_now is not None else None)
        if live is not None:
            at = self.at_error
            at.live, at.live_modules, at.live_storages = live

    def record_oom(self, exc: BaseException) -> None:
        dump = self.oom_dump
        self.at_error.oom = dump.record(exc) if dump is not None else oom_record(exc, self.run.device)

    def write_oom_dump(self) -> None:
        assert self.oom_dump is not None and self.trace is not None  # called only then (finish)
        self.oom_dump_path = self.oom_dump.write(self.trace)

    # -- removing everything ------------------------------------------------------------------------

    def close(self, *, freeze: bool) -> None:
        """Tear down, once more if that was cut short (every part of it is safe to run again)."""
        for _ in range(2):
            try:
                self.failures += self.teardown(freeze)
                return
            except BaseException as exc:  # between two of its guarded parts: a second Ctrl-C
                self.failures.append(Failure("closing the profile", exc))

    def teardown(self, freeze: bool) -> Failures:
        """Remove everything the profile installed, free its slots and (``freeze``) build its record;
        each part runs whatever the others raise, and running it again finishes what an interrupt cut
        short. What failed, in order (an exception of ``on_trace_ready`` as _CALLBACK)."""
        failures: Failures = []
        stack = self.stack
        if stack is not None:
            failures += stack.close()
            self.stack = None
        undo(failures, "freeing its slot", self.release)
        if freeze and self.trace is None and self.freeze_error is None:
            attempt(failures, "building the record", self.freeze)
        undo(failures, "closing its ledger", self.close_ledger)
        windows = self.collectors.windows if self.collectors is not None else None
        if freeze and windows is not None and not self.windows_closed:
            self.windows_closed = True
            # The last window, if on_trace_ready has not had it.
            if not attempt(failures, "closing the last window", windows.window_ended):
                if failures[-1].exc is windows.callback_error:
                    failures[-1] = Failure(_CALLBACK, failures[-1].exc)
        return failures

    def freeze(self) -> None:
        assert self.collectors is not None  # a profile that started
        try:
            self.trace = build_trace(self.collectors, self.at_error)
        except BaseException as exc:
            self.freeze_error = error_text(exc)
            raise

    def close_ledger(self) -> None:
        self.ledger.close()
        if self.collectors is not None:  # None when the start failed before they were made
            self.collectors.timeline.samples = []

    # -- saying what failed ---------------------------------------------------------------------------

    def say(self, failures: Failures, raised: bool) -> None:
        """A note in the record for each step that failed (the record lacks that part), and a warning for
        memprof's own failures (an interrupt only when it is not raised: the user asked for it)."""
        notes = [_failure_note(f) for f in failures if not f.done]
        if notes:
            self.run.notes.extend(notes)
            if self.trace is not None:
                notes = list(dict.fromkeys(self.trace.notes + tuple(notes)))
                self.trace = dataclasses.replace(self.trace, notes=tuple(notes))
        warn([f for f in failures if raised or not is_interrupt(f.exc)], "while the profile was closed")


def _failure_note(failure: Failure) -> str:
    what, exc = failure.what, failure.exc
    if what == _CALLBACK:
        return f"on_trace_ready raised {error_text(exc)} at the end of the profile, while an error was leaving it"
    if is_interrupt(exc):
        return f"the profile's closing was interrupted ({type(exc).__name__}) while {what}: the record lacks that part"
    return f"memprof failed while {what} ({error_text(exc)}): the record lacks that part"


def _interrupted(failures: Failures) -> bool:
    """Was the last failure an interrupt (a second Ctrl-C, a signal handler's exception), after which only
    undoing goes on?"""
    return is_interrupt(failures[-1].exc)


def warn(failures: Failures, when: str) -> None:
    """One warning for what failed while a profile was closed (it never raises over the user's code)."""
    if not failures:
        return
    what = "; ".join(f"{f.what}: {error_text(f.exc)}" for f in failures)
    try:
        warnings.warn(f"memprof: {len(failures)} step(s) failed {when} ({what}); everything it installed was "
                      "removed", MemprofWarning, stacklevel=4)
    except Exception as failure:  # warnings turned into errors: the user's code must still not see memprof's failure
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        pass
