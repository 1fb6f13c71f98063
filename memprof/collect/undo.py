"""Leaving a profile whatever goes wrong: every undo step runs, and the user's exception stays theirs.

A profile ends while the user's exception unwinds, or while a second Ctrl-C may land at any line.
Each step of leaving therefore runs on its own: a step that raises is recorded and the next one
runs anyway, so that no hook, saved-tensor pair or dispatch mode stays installed because an earlier
step failed. An undo step that raises is run once more: a ``KeyboardInterrupt`` that cut it short
must not leave its hooks behind, and every undo step is written to be safe to repeat (removing a
removed handle does nothing).

Formatting the user's exception runs the user's ``__str__``, which may raise too;
:func:`memprof.errors.error_text` never lets that replace the exception being described.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from ..errors import is_interrupt

__all__ = ["UndoStack", "Failure", "Failures", "attempt", "undo"]


class Failure(NamedTuple):
    """A step of leaving a profile that raised: what memprof was doing, the exception, and whether the
    step's work got done all the same (an undo step that succeeded when run once more)."""

    what: str
    exc: BaseException
    done: bool = False


Failures = list[Failure]


class UndoStack:
    """What a profile installed, undone last-in first-out by :meth:`close`, each step whatever the others
    raise. ``callback(fn, *args)`` registers a step, as ``contextlib.ExitStack.callback`` does."""

    def __init__(self) -> None:
        self._steps: list[tuple[Callable[..., object], tuple[object, ...], dict[str, object]]] = []

    def callback(self, fn: Callable[..., object], /, *args: object, **kwargs: object) -> Callable[..., object]:
        self._steps.append((fn, args, kwargs))
        return fn

    def close(self) -> Failures:
        """Run every step, newest first; a step that raises runs once more. What still failed, in order."""
        failures: Failures = []
        while self._steps:
            fn, args, kwargs = self._steps[-1]  # forgotten once run: closing again after an interrupt redoes it
            undo(failures, f"removing what it installed ({_name(fn)})", fn, *args, **kwargs)
            self._steps.pop()
        return failures


def undo(failures: Failures, what: str, fn: Callable[..., object], *args: object, **kwargs: object) -> None:
    """Run the undo step ``fn(*args, **kwargs)``, and once more if it raises (an interrupt cut it short,
    or it failed on something passing); a failure is recorded in ``failures``, done if the second run
    succeeded."""
    first = _run(fn, args, kwargs)
    if first is not None:
        again = _run(fn, args, kwargs)
        if again is not None and is_interrupt(first) and not is_interrupt(again):
            # The user's interruption is raised whatever the retry's own failure was: that one, which replaced
            # it here, lost a Ctrl-C that cut torch's mode exit short. Both are recorded.
            failures.append(Failure(what, first))
        failures.append(Failure(what, again or first, again is None))


def _run(fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]) -> "BaseException | None":
    try:
        fn(*args, **kwargs)
    except BaseException as exc:  # a second Ctrl-C included: the next step must run
        return exc
    return None


def attempt(failures: Failures, what: str, fn: Callable[..., object], *args: object) -> bool:
    """Run ``fn(*args)``; if it raises (anything, ``KeyboardInterrupt`` included) record it in ``failures``
    and return False."""
    try:
        fn(*args)
    except BaseException as exc:
        failures.append(Failure(what, exc))
        return False
    return True


def _name(fn: Callable[..., object]) -> str:
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return f"{type(owner).__name__}.{name}" if owner is not None else name
