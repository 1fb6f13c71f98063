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
``sys.unraisablehook`` is wrapped: an exception a signal handler raises (:func:`_signalled`: ``KeyboardInterrupt``,
``SystemExit``, or one raised through a Python handler installed now) that the main thread's finaliser swallowed
is kept in :data:`KEPT` instead of printed, and raised again at the next place that can raise it: the end of the
outermost simulated torch call (:func:`memprof.simulate.held_signals.release`) or else the end of the public call.
Every other unraisable goes to the hook that was installed, unchanged. Only the outermost call installs the hook
and puts back the one it found, unless something else replaced it meanwhile (left as it is, as signal handlers
are); a hook installed meanwhile that hands on to the one it found reaches :class:`_Keeper`, which hands on in turn.

No count of running calls is kept: an interrupt can land at any bytecode, this module's own included, and one
landing between a count's update and the hook's made every later call leave the hook out (5 Ctrl-Cs of 600 lost
after one such). Whether a call runs is read from the stack instead (a frame of :func:`guarded`); one landing
between the hook's installing and its putting back at worst leaves :class:`_Keeper` installed, which outside a call
hands every unraisable on as before, until the next call puts the hook back. A kept interrupt is forgotten when
the next outermost call begins.

What this cannot reach: a finaliser that runs outside a memprof call (the collector freeing a simulation's garbage
during the user's own code later) swallows a Ctrl-C as it would any library's; a second Ctrl-C landing inside a
keeper while it handles an unraisable is dropped by Python (the unraisable in hand is raised, whatever it was); a
``KeyboardInterrupt`` or ``SystemExit`` a finaliser raises itself, or an exception from a handler function it calls
directly, is taken for a signal's; a library that installs its own hook whenever the installed one is not its own,
from code a memprof call runs (a forward), installs it again in every call, over that call's keeper, so an
unraisable passes each copy (as it would under any tool that swaps the hook for a while, pytest's included); and a
profile (:func:`memprof.profile`) around the user's loop is not a call of this kind (the loop is the user's).
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


class _Keeper:
    """``sys.unraisablehook`` while a public call runs: an interrupt the main thread's finaliser swallowed during a
    call is kept, anything else goes to the hook this one was installed over (``previous``), and only to it.

    One keeper per installation, holding its own ``previous``: a hook installed during a call that hands on to the
    one it found hands on to this keeper, and the next call's keeper is installed over that hook, so an unraisable
    passes each hook of the chain once, in order, with no count shared between threads or calls. Outside a call a
    keeper only hands on."""

    __slots__ = ("previous",)

    def __init__(self, previous: Hook) -> None:
        self.previous = previous

    def __call__(self, unraisable: "sys.UnraisableHookArgs") -> None:
        exc = unraisable.exc_value
        if exc is not None and _main():
            if any(kept is exc for kept in KEPT):
                return  # an older keeper further down the chain: kept already
            KEPT.append(exc)  # first: a second Ctrl-C landing in what follows cannot lose this one
            if _signalled(exc) and _calls() > 0:
                return
            if KEPT and KEPT[-1] is exc:
                KEPT.pop()
        self.previous(unraisable)


def _signalled(exc: BaseException) -> bool:
    """Is ``exc`` what a signal handler raises: Ctrl-C's ``KeyboardInterrupt``, ``SystemExit`` (``sys.exit`` in a
    handler), or an exception raised through a Python handler installed now (:func:`memprof.errors.is_interrupt`
    reads its frame in the traceback). Other exceptions that are not an ``Exception`` (asyncio's
    ``CancelledError``, ``GeneratorExit``) are a finaliser's own, reported as Python reports them."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return True
    return isinstance(exc, Exception) and is_interrupt(exc)


def raise_kept() -> None:
    """Raise the oldest interrupt kept, forgetting every one (one interruption ends the call; the same Ctrl-C
    swallowed twice, or a second one, is not raised a second time). Nothing kept: nothing happens."""
    if KEPT:
        exc = KEPT[0]
        KEPT.clear()
        raise exc


def guarded(call: Callable[[], T]) -> T:
    """``call()``, a public memprof function's work: interrupts finalisers swallow meanwhile are raised again, at
    the latest when it returns. Only the outermost call installs a keeper and puts back the hook it was installed
    over; other threads change nothing (signal handlers run in the main thread only)."""
    if not _main():
        return call()
    try:
        if _calls() == 1:
            KEPT.clear()  # one a second Ctrl-C left behind in an earlier call is not this call's
            if not isinstance(sys.unraisablehook, _Keeper):  # one left installed by an interrupted call: reused
                sys.unraisablehook = _Keeper(sys.unraisablehook)
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
    """One call ends: at the outermost, the hook its keeper was installed over is back, in one store, unless
    another hook replaced the keeper meanwhile (left as it is; it may hand on to the keeper, which hands on)."""
    hook = sys.unraisablehook
    if isinstance(hook, _Keeper) and _calls() == 1:
        sys.unraisablehook = hook.previous


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
