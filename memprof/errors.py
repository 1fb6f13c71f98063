"""Errors raised by memprof.

Every refusal is a :class:`MemprofError` subclass whose message names the
problem and the fix, so a user never has to read a traceback from inside torch.
"""

from __future__ import annotations

import re
import signal
import types
from typing import Mapping, Protocol

__all__ = [
    "MemprofError",
    "ProfilerStateError",
    "InvalidArgumentError",
    "UnknownNameError",
    "SizeParseError",
    "NotMeasuredError",
    "TraceFormatError",
    "RegistryError",
    "MissingExtraError",
    "ConfigNotFoundError",
    "SimulationError",
    "MergeError",
    "TraceNotFoundError",
    "AllocatorConfigError",
    "SimulatedOutOfMemoryError",
    "MemprofWarning",
    "MemoryBudgetExceeded",
    "BudgetNotMeasured",
    "MemoryGrewError",
    "is_interrupt",
    "remember_signal_handlers",
]


class MemprofError(Exception):
    """Base class of every error memprof raises on purpose."""


class ProfilerStateError(MemprofError):
    """The profiler was used out of order (nested, re-entered, read before it ran)."""


class InvalidArgumentError(MemprofError, TypeError):
    """An argument has the wrong type or an impossible value.

    Also a ``TypeError`` so that code catching the builtin keeps working.
    """


class UnknownNameError(MemprofError, ValueError):
    """A category, phase, mode or similar name is not one memprof knows."""


class SizeParseError(MemprofError, ValueError):
    """A memory size string could not be parsed."""


class NotMeasuredError(MemprofError):
    """A figure was asked for that this run did not measure."""


class TraceFormatError(MemprofError, ValueError):
    """A file is not a memprof trace, or is from a newer schema."""


class RegistryError(MemprofError):
    """A formula registry was used wrongly (for example, registered twice)."""


class TraceNotFoundError(MemprofError, FileNotFoundError):
    """No trace file at the path given (also a ``FileNotFoundError``)."""

    def __str__(self) -> str:
        return str(self.strerror)


class SimulationError(MemprofError, RuntimeError):
    """A simulated step (``estimate``, ``max_batch_size``) could not run the model on shape-only tensors.

    The message names what failed (an op without a fake kernel, code that reads tensor values) and the
    fix; the error torch raised is chained as ``__cause__``. Also a ``RuntimeError``.
    """


class MergeError(MemprofError, ValueError):
    """The reports given to :func:`memprof.merge` are not the ranks of one run (duplicate ranks, different
    world sizes or models, a report without a rank). Also a ``ValueError``."""


class AllocatorConfigError(MemprofError, ValueError):
    """A ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` string that torch would refuse at start-up
    (an unknown key, a missing value, a value out of range); the message names the key and the fix.
    Also a ``ValueError``."""


class SimulatedOutOfMemoryError(MemprofError, RuntimeError):
    """The model of the CUDA caching allocator could not serve a request within the device capacity it
    was given, after the same frees and retries torch tries before raising ``OutOfMemoryError``.

    ``requested``, ``allocated``, ``reserved`` and ``capacity`` (bytes) say where it stopped. Also a
    ``RuntimeError``.
    """

    def __init__(self, message: str, *, requested: int, allocated: int, reserved: int,
                 capacity: int | None) -> None:
        super().__init__(message)
        self.requested = requested
        self.allocated = allocated
        self.reserved = reserved
        self.capacity = capacity


class ConfigNotFoundError(MemprofError, FileNotFoundError):
    """No model configuration where one was asked for (a folder without ``config.json``, a hub id neither cached
    nor reachable); the message names what to give instead."""


class MissingExtraError(MemprofError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class _Overrun(Protocol):
    """A budget and the figure that exceeded it: a :class:`~memprof.analyse.budget.Judged`, which this module,
    below analyse (imports run one way), names by what it has."""

    @property
    def budget(self) -> int: ...
    @property
    def measured(self) -> int: ...
    @property
    def headroom(self) -> int: ...


class _Growth(Protocol):
    """A figure that grew: a :class:`~memprof.analyse.budget.Growth`, named by what it has (as :class:`_Overrun`)."""

    @property
    def name(self) -> str: ...
    @property
    def baseline(self) -> int: ...
    @property
    def measured(self) -> int: ...
    @property
    def delta(self) -> int: ...
    def describe(self) -> str: ...


class MemoryBudgetExceeded(MemprofError, AssertionError):
    """A measured figure is above its budget (:func:`memprof.check_budget`, the ``memory_budget`` marker).

    An ``AssertionError`` so that test frameworks report it as a failed
    assertion. ``overruns`` holds one :class:`~memprof.analyse.budget.Judged` (budget, measured) per
    exceeded budget, keyed by name (``"total"`` or a category value).
    """

    def __init__(self, message: str, overruns: "Mapping[str, _Overrun] | None" = None) -> None:
        super().__init__(message)
        self.overruns: dict[str, _Overrun] = dict(overruns or {})


class BudgetNotMeasured(NotMeasuredError):
    """A budget names a figure this run did not measure, so it cannot be judged.

    ``names`` lists the budgets concerned (``"total"`` or category values).
    """

    def __init__(self, message: str, names: "tuple[str, ...]" = ()) -> None:
        super().__init__(message)
        self.names = tuple(names)


class MemoryGrewError(MemprofError, AssertionError):
    """Figures grew beyond the tolerance compared with a baseline report.

    ``growths`` holds one :class:`~memprof.analyse.budget.Growth` per figure that grew too much.
    """

    def __init__(self, message: str, growths: "tuple[_Growth, ...]" = ()) -> None:
        super().__init__(message)
        self.growths = tuple(growths)


class MemprofWarning(UserWarning):
    """Something memprof does on the side failed (a side file could not be written) and the run went on:
    a profiler must never end the run it measures. The message names what failed and where."""


_MAX_TEXT = 4000
_SURROGATE = re.compile("[\ud800-\udfff]")


def error_text(exc: BaseException, *, first_line: bool = False) -> str:
    """``"TypeName: message"`` for a record, whatever the exception: its ``__str__`` may raise or return a
    non-string (then the text says so), the message may be megabytes long (cut to 4,000 characters)
    or hold lone surrogates, which no UTF-8 file can hold (each becomes U+FFFD). ``first_line``: the
    message's first non-blank line only, the type's name when it has none."""
    text = _str(exc).strip()
    if first_line:
        text = text.splitlines()[0].strip() if text else type(exc).__name__
    if len(text) > _MAX_TEXT:
        text = f"{text[:_MAX_TEXT]}... ({len(text) - _MAX_TEXT:,} more characters)"
    return _SURROGATE.sub("\ufffd", f"{type(exc).__name__}: {text}")


def _str(exc: BaseException) -> str:
    # An exception whose __str__ fails must not turn into a second exception in the profile's exit,
    # which would replace the user's own.
    try:
        text = str(exc)
    except Exception as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception is the user's, even while memprof reads an error's text
        return f"<its message could not be read: str() raised {type(failure).__name__}>"
    return text if type(text) is str else str.__str__(text)


def is_interrupt(exc: BaseException) -> bool:
    """Is ``exc`` the user's interruption rather than a failure memprof may contain: anything that is not an
    ``Exception`` (Ctrl-C's ``KeyboardInterrupt``, ``SystemExit``), or an exception raised by a Python signal
    handler installed now (a preemption handler that raises to save a checkpoint). Python runs a handler at
    the next bytecode of the main thread, wherever that is, memprof's own code included; an exception it
    raises there belongs to the user, and every place where memprof contains its own failures lets it through.

    Told by the traceback: the handler's frame is among the frames the exception came through, the handler
    being one installed now or when memprof last looked (:func:`remember_signal_handlers`: a handler that
    uninstalls itself before it raises, as "the second Ctrl-C kills" handlers do, is still known). Run only when
    something was raised, never on a path that succeeds.
    """
    if not isinstance(exc, Exception):
        return True
    tb = exc.__traceback__
    if tb is None or tb.tb_next is None:
        # Raised by a C call in the frame that catches it (a storage read, a lookup): no handler ran beneath.
        # The common case where memprof expects an exception, answered without reading the handlers.
        return False
    codes = remember_signal_handlers()
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False


#: The code objects of every Python signal handler memprof has seen installed (a handler may uninstall itself
#: before it raises). Only grows by the user's distinct handler functions.
_SEEN_HANDLERS: "set[types.CodeType]" = set()


def remember_signal_handlers() -> "set[types.CodeType]":
    """Note the Python signal handlers installed now (memprof's entry points call this: a profile's start, every
    public function, the command line), so that :func:`is_interrupt` knows them even once they are gone; every
    handler's code object seen so far."""
    _SEEN_HANDLERS.update(_handler_codes())
    return _SEEN_HANDLERS


def _handler_codes() -> "set[types.CodeType]":
    """The code objects of the Python functions installed as signal handlers (a bound method's function, a
    partial's, a callable object's ``__call__``)."""
    codes: "set[types.CodeType]" = set()
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (ValueError, OSError) as failure:  # a signal Python cannot read the handler of here
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            continue
        if not callable(handler) or handler is signal.default_int_handler:
            continue  # SIG_DFL, SIG_IGN, None (set from C), or Ctrl-C's default (C: its KeyboardInterrupt counts)
        target = getattr(handler, "func", handler)  # functools.partial
        target = getattr(target, "__func__", target)  # a bound method
        code = getattr(target, "__code__", None)
        if code is None:  # a callable object: its class's __call__
            code = getattr(getattr(type(target), "__call__", None), "__code__", None)  # noqa: B004
        if code is not None:
            codes.add(code)
    return codes
