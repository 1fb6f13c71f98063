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

All of this runs in the main thread only: Python runs signal handlers there and only there may they be swapped.
The cost per torch function call is two integer updates and a test.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Callable

__all__ = ["enter", "leave", "entered", "leave_to", "hold", "release"]

# Signals the kernel sends for a fault of the running thread (a handler held back would let the faulting code run
# again), and those no handler can take.
_NOT_HELD = {getattr(signal, name) for name in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGABRT",
                                                "SIGSYS", "SIGKILL", "SIGSTOP") if hasattr(signal, name)}
_HELD = tuple(sorted(s for s in signal.valid_signals() if s not in _NOT_HELD))

Handler = Callable[[int, "FrameType | None"], object]


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
    if _State.depth == 0 and _State.pending and _main():
        # One at a time, each forgotten as it is raised: a handler that raises leaves the others noted for the
        # next release, where raising them all from a copy would drop them
        _State.pending = list(dict.fromkeys(_State.pending))
        while _State.pending:
            signal.raise_signal(_State.pending.pop(0))
