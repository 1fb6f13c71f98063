"""Ending a profile: what the error left, everything removed, the record frozen, what failed said.

The profile ends while the user's exception unwinds, or while a second Ctrl-C may land at any line,
so every step runs whatever the others raise (:mod:`.undo`): with the user's exception nothing is
raised over it; without one, once everything is removed, an interrupt is raised again, then
``on_trace_ready``'s own exception unchanged, then the ProfilerStateError of a profile ended in
another thread. memprof's own failures are a warning and a note, and a record that could not be
built says why when it is read.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING

from ..errors import MemprofWarning, ProfilerStateError, error_text
from .oom import is_oom, oom_record
from .freeze import build_trace
from .undo import Failure, Failures, attempt, undo

if TYPE_CHECKING:
    from .profiler import Profiler

__all__ = ["Closing"]

_CALLBACK = "on_trace_ready"
_ENDED_ELSEWHERE = (
    "this profile was ended in another thread than the one that started it: ops the starting thread ran "
    "while it was being closed may be counted in part")


class Closing:
    """The steps of ending one profile, and what failed in them."""

    def __init__(self, prof: "Profiler") -> None:
        self.prof = prof
        self.failures: Failures = []

    def leave(self, exc: "BaseException | None", elsewhere: bool) -> None:
        """What leaving the block does: record ``exc``, remove everything, freeze, say what failed, and
        raise only as the module docstring says."""
        prof = self.prof
        failures = self.failures
        if elsewhere:
            prof.notes.append(_ENDED_ELSEWHERE)
        if exc is not None:
            attempt(failures, "recording the error", self.record_error, exc)
        self.close(freeze=True)
        if prof.oom is not None and prof.oom_dump is not None and prof._trace is not None:
            attempt(failures, "writing the OOM dump", self.write_oom_dump)
        elif prof.oom_dump is not None:
            attempt(failures, "discarding the OOM snapshot", prof.oom_dump.discard)
        callback = [f.exc for f in failures if f.what == _CALLBACK and exc is None]
        own = [f for f in failures if not (f.what == _CALLBACK and exc is None)]
        said: Failures = []
        attempt(said, "saying what failed", self.say, own, exc is not None)
        if exc is not None:
            return  # nothing raises over the body's exception
        interrupts = [f.exc for f in own + said if not isinstance(f.exc, Exception)]
        if interrupts:
            raise interrupts[0]  # the user's Ctrl-C, now that nothing of memprof's is left installed
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
        except Exception:  # the exception's own __str__ raised: it cannot be told to be an OOM
            oom = False
        if not attempt(failures, "recording what was live at the error", self.record_live, oom) and _interrupted(
                failures):
            return
        if oom:
            attempt(failures, "recording the out-of-memory error", self.record_oom, exc)

    def describe_error(self, exc: BaseException) -> None:
        self.prof.error = type(exc).__name__  # what stays if describing is interrupted
        self.prof.error = error_text(exc)

    def describe_setup_error(self, exc: BaseException) -> None:
        self.prof._setup_error = error_text(exc)

    def record_live(self, oom: bool) -> None:
        prof = self.prof
        # At a CUDA OOM the allocator's observer took what was live at the failing allocation itself.
        live = prof.oom_dump.live if oom and prof.oom_dump is not None and prof.oom_dump.observed else None
        live = live or prof.live_now()
        if live is not None:
            prof.live_at_error, prof.live_modules_at_error, prof.live_storages_at_error = live

    def record_oom(self, exc: BaseException) -> None:
        prof = self.prof
        prof.oom = prof.oom_dump.record(exc, prof.device) if prof.oom_dump is not None else oom_record(exc, prof.device)

    def write_oom_dump(self) -> None:
        prof = self.prof
        assert prof.oom_dump is not None
        prof.oom_dump_path = prof.oom_dump.write(prof._trace)

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
        prof = self.prof
        failures: Failures = []
        stack = prof.stack
        if stack is not None:
            failures += stack.close()
            prof.stack = None
        prof._model_hold = None
        undo(failures, "freeing its slot", prof._release)
        prof.active = False
        if prof._state != "failed":
            prof._state = "done"
        if freeze and prof._trace is None and prof._freeze_error is None:
            attempt(failures, "building the record", self.freeze)
        undo(failures, "closing its ledger", self.close_ledger)
        windows = prof.windows
        if freeze and windows is not None and not prof._windows_closed:
            prof._windows_closed = True
            # The last window, if on_trace_ready has not had it.
            if not attempt(failures, "closing the last window", windows.window_ended):
                if failures[-1].exc is windows.callback_error:
                    failures[-1] = Failure(_CALLBACK, failures[-1].exc)
        return failures

    def freeze(self) -> None:
        try:
            self.prof._trace = build_trace(self.prof)
        except BaseException as exc:
            self.prof._freeze_error = error_text(exc)
            raise

    def close_ledger(self) -> None:
        self.prof.ledger.close()
        phases = getattr(self.prof, "phases", None)  # absent when the start failed before it was made
        if phases is not None:
            phases.samples = []

    # -- saying what failed ---------------------------------------------------------------------------

    def say(self, failures: Failures, raised: bool) -> None:
        """A note in the record for each step that failed (the record lacks that part), and a warning for
        memprof's own failures (an interrupt only when it is not raised: the user asked for it)."""
        prof = self.prof
        notes = [_failure_note(f) for f in failures if not f.done]
        if notes:
            prof.notes.extend(notes)
            if prof._trace is not None:
                notes = list(dict.fromkeys(prof._trace.notes + tuple(notes)))
                prof._trace = dataclasses.replace(prof._trace, notes=tuple(notes))
        warn([f for f in failures if raised or isinstance(f.exc, Exception)], "while the profile was closed")


def _failure_note(failure: Failure) -> str:
    what, exc = failure.what, failure.exc
    if what == _CALLBACK:
        return f"on_trace_ready raised {error_text(exc)} at the end of the profile, while an error was leaving it"
    if not isinstance(exc, Exception):
        return f"the profile's closing was interrupted ({type(exc).__name__}) while {what}: the record lacks that part"
    return f"memprof failed while {what} ({error_text(exc)}): the record lacks that part"


def _interrupted(failures: Failures) -> bool:
    """Was the last failure an interrupt (a second Ctrl-C), after which only undoing goes on?"""
    return not isinstance(failures[-1].exc, Exception)


def warn(failures: Failures, when: str) -> None:
    """One warning for what failed while a profile was closed (it never raises over the user's code)."""
    if not failures:
        return
    what = "; ".join(f"{f.what}: {error_text(f.exc)}" for f in failures)
    try:
        warnings.warn(f"memprof: {len(failures)} step(s) failed {when} ({what}); everything it installed was "
                      "removed", MemprofWarning, stacklevel=4)
    except Exception:  # warnings turned into errors: the user's code must still not see memprof's failure
        pass
