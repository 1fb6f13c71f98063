"""Signals held back while a simulated op runs: torch's C++ calls Python there where it cannot let an exception out.

On shape-only tensors, torch's C++ asks Python for what it needs in places that do not expect a Python exception:
making a leaf's gradient accumulator reads the tensor's metadata (``torch::autograd::InputMetadata``), and a
Python composite followed with the simulation's mode on runs inside ``torch._C._skip_one_hop_torch_function``. A
signal handler that raises there (Ctrl-C's ``KeyboardInterrupt``, a preemption handler) aborted the process
("terminate called after throwing an instance of 'python_error'") in about one interrupted estimate in three.

So while a simulation's function mode is entered, each Python signal handler is wrapped: during a torch function
call the simulation handles (:class:`memprof.simulate.modes.Rules`) the wrapper only notes the signal; when the
outermost such call returns, the noted signals are raised again (``signal.raise_signal``) and the user's handler
runs where its exception propagates as anywhere else. A Ctrl-C during a simulated backward therefore arrives
when that backward ends. Outside a call, the wrapper calls the handler at once. When the last mode is left, the
wrappers are replaced by the handlers again (one the user's code installed meanwhile is left as it is).

A model's deep copy onto shape-only twins holds signals the same way (:func:`deepcopy_held`): CPython's
``copyreg`` drops any exception at one line a copy of every ``OrderedDict`` and ``set`` runs.

All of this runs in the main thread only: Python runs signal handlers there and only there may they be swapped.
The cost per torch function call is two integer updates and a test. The end of the outermost call is also where
an interrupt a finaliser swallowed is raised again (:mod:`memprof.swallowed`): the user's handler runs at once
outside a torch call, and may run inside a ``__del__``.
"""

from __future__ import annotations

import copy
import signal
import threading
from types import FrameType
from typing import Callable, TypeVar

from ..swallowed import KEPT, raise_kept

__all__ = ["enter", "leave", "entered", "leave_to", "hold", "release", "deepcopy_held"]

# Signals the kernel sends for a fault of the running thread (a handler held back would let the faulting code run
# again), and those no handler can take.
_NOT_HELD = {getattr(signal, name) for name in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGABRT",
                                                "SIGSYS", "SIGKILL", "SIGSTOP") if hasattr(signal, name)}
_HELD = tuple(sorted(s for s in signal.valid_signals() if s not in _NOT_HELD))

Handler = Callable[[int, "FrameType | None"], object]
T = TypeVar("T")


class _State:
    """The main thread's: how many simulation modes are entered, how many torch function calls run, the signals
    noted meanwhile, and each wrapped handler by signal (with its wrapper, to tell whether it is still installed)."""

    entered = 0
    depth = 0
    pending: "list[int]" = []
    wrapped: "dict[int, tuple[Handler, Handler]]" = {}


def _main() -> bool:
    return threading.current_thread() is threading.main_thread()


def _wrapper(handler: Handler) -> Handler:
    def held(signum: int, frame: "FrameType | None") -> object:
        if _State.depth:
            _State.pending.append(signum)
            return None
        return handler(signum, frame)

    return held


def enter() -> None:
    """A simulation's function mode is entered: the first wraps every Python signal handler."""
    if not _main():
        return
    _State.entered += 1
    if _State.entered > 1:
        return
    for s in _HELD:
        handler = signal.getsignal(s)
        if callable(handler):
            wrapper = _wrapper(handler)
            _State.wrapped[s] = (handler, wrapper)
            signal.signal(s, wrapper)


def leave() -> None:
    """A simulation's function mode is left: the last puts every handler back where its wrapper still is.

    The last one puts the handlers back first and only then forgets them and the count: a signal's exception
    landing anywhere in it (Python runs a handler as a function is called) leaves the state saying what is still
    to do, and :func:`leave_to` does it (putting back is idempotent). Forgetting first, as this did, left the
    wrappers installed for good when a Ctrl-C landed in between."""
    if not _main() or _State.entered == 0:
        return
    if _State.entered > 1:
        _State.entered -= 1
        return
    _put_back(list(_State.wrapped.items()))
    _State.wrapped = {}
    _State.entered = 0
    if _State.depth == 0 and _State.pending:
        _raise_left()


def _raise_left() -> None:
    """Signals still noted once the last mode is left: a release raises them one at a time, and stops at the
    first whose handler raises. Each left is raised now, once, its handler the user's again (so that none is
    raised in a later, unrelated simulation, as one was). Each handler runs, and the last one's exception
    propagates with the one before as its context, as two signals tripped together come out of CPython."""
    while _State.pending:
        try:
            signal.raise_signal(_State.pending.pop(0))
        except BaseException:
            _raise_left()  # the others still, then this one's exception
            raise


def _put_back(wrapped: "list[tuple[int, tuple[Handler, Handler]]]") -> None:
    """Each handler back where its wrapper still is. ``signal.signal`` runs a pending signal's handler before it
    changes one: an exception from there (a Ctrl-C) still lets every handler go back, then propagates."""
    for i, (s, (handler, wrapper)) in enumerate(wrapped):
        try:
            if signal.getsignal(s) is wrapper:
                signal.signal(s, handler)
        except BaseException:
            _put_back(wrapped[i:])  # this one again (it was not changed), and the rest
            raise


def entered() -> int:
    """How many simulation modes are entered now (to :func:`leave_to` after an interrupt)."""
    return _State.entered


def leave_to(count: int) -> None:
    """Leave simulation modes until ``count`` are entered (an interrupt landed between a mode's entry and the
    registration of its exit), and no torch function call is held (one cut short never released)."""
    if not _main():
        return  # nothing was entered from here (enter and leave do nothing outside the main thread)
    while _State.entered > count:
        leave()
    if count == 0 and _State.depth:
        _State.depth = 1
        release()  # what was noted is raised now


def hold() -> None:
    """A torch function call begins: signals are noted, not handled, until the outermost call ends."""
    _State.depth += 1


def release() -> None:
    """A torch function call ends; at the outermost, each signal noted meanwhile is raised again, once."""
    _State.depth -= 1
    if _State.depth == 0 and (_State.pending or KEPT) and _main():
        # One at a time, each forgotten as it is raised: a handler that raises leaves the others noted for the
        # next release, where raising them all from a copy would drop them
        _State.pending = list(dict.fromkeys(_State.pending))
        while _State.pending:
            signal.raise_signal(_State.pending.pop(0))
        raise_kept()  # an interrupt a finaliser swallowed outside any torch call (memprof/swallowed.py)


def deepcopy_held(value: T, memo: "dict[int, object]") -> T:
    """``copy.deepcopy(value, memo)`` (a model's copy onto shape-only twins) with signals held until it returns.

    CPython's ``copyreg._slotnames``, which a deep copy runs for every object of a built-in type it reduces
    (``OrderedDict``, ``set``, ``deque`` ...: such a type cannot keep its answer, so it is asked again each time),
    caches that answer inside ``try: ... except: pass``: a handler's exception landing on that line is dropped
    there, and the estimate went on as if uninterrupted (about 1 Ctrl-C in 1,500 at random instants of repeated
    estimates). Held here, a signal is handled when the copy ends: the copy is of the model's modules, its
    parameters and buffers already twins in ``memo``, but a ``__deepcopy__`` of the user's that blocks keeps a
    Ctrl-C waiting, and one that handles a signal of its own (a timeout) sees it only after the copy. The count of
    entered modes and of held calls is put back whatever lands where."""
    if not _main():
        return copy.deepcopy(value, memo)  # no handler runs here, and the held state is the main thread's
    count, depth = entered(), _State.depth
    try:
        enter()
        hold()
        return copy.deepcopy(value, memo)
    finally:
        try:
            _State.depth = depth + 1
            release()  # back to the depth it was; at the outermost, each signal noted during the copy is raised
        finally:
            leave_to(count)
