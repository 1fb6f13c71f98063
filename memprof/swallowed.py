"""Interrupts a finaliser swallowed during a memprof call, raised again where they propagate.

Python runs a signal handler at the next bytecode of the main thread, wherever that is, and the first Python code
after a stretch of C is often a finaliser: a ``__del__``, a weak reference's callback, run as the garbage collector
frees a cycle or as a dict of weak references is torn down. An exception a finaliser raises cannot propagate; CPython
hands it to ``sys.unraisablehook``, which prints "Exception ignored in ..." and goes on. A Ctrl-C landing there is
lost: the interrupted call returns as if nothing happened. An estimate makes and drops many such objects (torch's
fake tensors keep ``StorageWeakRef``\\ s, whose ``__del__`` frees a weak reference; weak dictionaries' callbacks), and
about 1 Ctrl-C in 200 at random instants of repeated estimates was lost so, always in a finaliser run by the
collector.

So while a public memprof function runs (:func:`guarded`, called by the facade's one seam and by nothing else),
``sys.unraisablehook`` is wrapped: an interrupt (:func:`memprof.errors.is_interrupt`: ``KeyboardInterrupt``,
``SystemExit``, a signal handler's own exception) swallowed in the main thread is kept in :data:`KEPT` instead of
printed, and raised again at the next place that can raise it: the end of the outermost simulated torch call
(:func:`memprof.simulate.held_signals.release`) or else the end of the public call. Every other unraisable goes to
the hook that was installed, unchanged. The hook is put back when the outermost call ends, unless something else
replaced it meanwhile (left as it is, as signal handlers are).

No count of running calls is kept: an interrupt can land at any bytecode, this module's own included, and one
landing between a count's update and the hook's made every later call leave the hook out (5 Ctrl-Cs of 600 lost
after one such). Whether a call runs is read from the stack instead (a frame of :func:`guarded`), where an
interrupt cannot leave it wrong; one landing between the hook's installing and its putting back at worst leaves
:func:`_keep` installed, which outside a call hands every unraisable on as before, until the next call puts the
hook back.

What this cannot reach: a finaliser that runs outside a memprof call (the collector freeing a simulation's garbage
during the user's own code later) swallows a Ctrl-C as it would any library's; and a profile (:func:`memprof.profile`)
around the user's loop is not a call of this kind (the loop is the user's).
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Callable, TypeVar

from .errors import is_interrupt

__all__ = ["KEPT", "guarded", "raise_kept"]

T = TypeVar("T")
Hook = Callable[["sys.UnraisableHookArgs"], object]

#: Interrupts swallowed and not raised again yet, oldest first (the main thread's; at most a few).
KEPT: "list[BaseException]" = []


class _State:
    """The hook that was installed before the outermost running call (or before the last one that installed
    :func:`_keep`)."""

    previous: "Hook | None" = None


def _keep(unraisable: "sys.UnraisableHookArgs") -> None:
    """Installed as ``sys.unraisablehook`` while a public call runs: an interrupt the main thread swallowed in a
    call is kept, anything else goes to the hook that was there."""
    exc = unraisable.exc_value
    if exc is not None and _main() and is_interrupt(exc) and _calls() > 0:
        # With its traceback, which tells a handler's exception apart wherever memprof contains failures
        # (errors.is_interrupt reads the handler's frame in it).
        KEPT.append(exc)
        return
    previous = _State.previous if _State.previous is not None else sys.__unraisablehook__
    previous(unraisable)


def raise_kept() -> None:
    """Raise the oldest interrupt kept, forgetting every one (one interruption ends the call; the same Ctrl-C
    swallowed twice, or a second one, is not raised a second time). Nothing kept: nothing happens."""
    if KEPT:
        exc = KEPT[0]
        KEPT.clear()
        raise exc


def guarded(call: Callable[[], T]) -> T:
    """``call()``, a public memprof function's work: interrupts finalisers swallow meanwhile are raised again, at
    the latest when it returns. Nested calls share the outermost's hook; other threads change nothing (signal
    handlers run in the main thread only)."""
    if not _main():
        return call()
    try:
        if sys.unraisablehook is not _keep:
            _State.previous = sys.unraisablehook
            sys.unraisablehook = _keep
        result = call()
    except BaseException as propagating:
        _put_back()
        if is_interrupt(propagating):
            KEPT.clear()  # the user's interruption propagates already: a swallowed one is not raised twice
        raise_kept()  # else the interruption replaces the failure, which it carries as its context
        raise
    _put_back()
    raise_kept()
    return result


def _put_back() -> None:
    """One call ends: at the outermost, the hook that was installed is back (unless another replaced it)."""
    if _calls() == 1 and sys.unraisablehook is _keep:
        sys.unraisablehook = _State.previous if _State.previous is not None else sys.__unraisablehook__


def _calls() -> int:
    """How many calls of :func:`guarded` run in this thread now: its frames on the stack."""
    code, count = guarded.__code__, 0
    frame: "FrameType | None" = sys._getframe(1)
    while frame is not None:
        count += frame.f_code is code
        frame = frame.f_back
    return count


def _main() -> bool:
    return threading.current_thread() is threading.main_thread()
