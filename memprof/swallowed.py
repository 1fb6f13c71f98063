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
are); a hook installed meanwhile that hands on to the one it found reaches :func:`_keep`, which hands on in turn.

No count of running calls is kept: an interrupt can land at any bytecode, this module's own included, and one
landing between a count's update and the hook's made every later call leave the hook out (5 Ctrl-Cs of 600 lost
after one such). Whether a call runs is read from the stack instead (a frame of :func:`guarded`); one landing
between the hook's installing and its putting back at worst leaves :func:`_keep` installed, which outside a call
hands every unraisable on as before, until the next call puts the hook back. A kept interrupt is forgotten when
the next outermost call begins.

What this cannot reach: a finaliser that runs outside a memprof call (the collector freeing a simulation's garbage
during the user's own code later) swallows a Ctrl-C as it would any library's; a second Ctrl-C landing inside
:func:`_keep` while it keeps the first is dropped by Python (the first is kept); a ``KeyboardInterrupt`` a
finaliser raises itself, or a handler function it calls directly, is taken for a signal's; and a profile
(:func:`memprof.profile`) around the user's loop is not a call of this kind (the loop is the user's).
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
    """The hooks :func:`_keep` was installed over, oldest first, and how deep :func:`_keep` is in forwarding one
    unraisable. A hook installed during a call that hands on to the hook it found (the usual pattern) hands on to
    :func:`_keep`; the next call installs :func:`_keep` over it, so :func:`_keep` is reached again while forwarding,
    and then forwards to the hook before that one, never round again."""

    previous: "list[Hook]" = []
    forwarding = 0


def _keep(unraisable: "sys.UnraisableHookArgs") -> None:
    """Installed as ``sys.unraisablehook`` while a public call runs: an interrupt the main thread swallowed in a
    call is kept, anything else goes to the hook that was there."""
    exc = unraisable.exc_value
    if exc is not None and _main() and not _State.forwarding:
        KEPT.append(exc)  # first: a second Ctrl-C landing in what follows cannot lose this one
        if _signalled(exc) and _calls() > 0:
            return
        if KEPT and KEPT[-1] is exc:
            KEPT.pop()
    previous, depth = _State.previous, _State.forwarding
    hook = previous[-1 - depth] if depth < len(previous) else sys.__unraisablehook__
    try:
        _State.forwarding = depth + 1  # inside: whatever lands where, the count is back after
        hook(unraisable)
    finally:
        _State.forwarding = depth


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
    the latest when it returns. Only the outermost call installs the hook and puts back the one it found; other
    threads change nothing (signal handlers run in the main thread only)."""
    if not _main():
        return call()
    try:
        if _calls() == 1:
            KEPT.clear()  # one a second Ctrl-C left behind in an earlier call is not this call's
            hook = sys.unraisablehook
            if hook is not _keep:
                _State.previous.append(hook)
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
    """One call ends: at the outermost, the hook that was installed is back, unless another replaced
    :func:`_keep` meanwhile (left as it is; it may hand on to :func:`_keep`, which then hands on as before)."""
    if _calls() == 1 and sys.unraisablehook is _keep and _State.previous:
        sys.unraisablehook = _State.previous.pop()


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
