"""What a forked process sends back (:mod:`memprof.simulate.forked`), and what the caller does with it: the
results, or the exception a call raised with the traceback it had there, and the warnings the calls issued.

An exception is raised in the caller as the class it was, with its message, from a :class:`ForkedTraceback` (the
forked process's traceback, its own causes included, as Python printed it there: ``multiprocessing.pool`` raises
its ``RemoteTraceback`` so), since a pickled exception keeps neither its traceback nor its causes. One that does
not survive the way back (a class made inside a function, one whose ``__init__`` takes other arguments than its
message) is a :class:`~memprof.errors.MemprofError` naming it, with the same cause. The warnings are issued again in
the caller, each at its place in the code with its module's registry: the caller's filters decide, and show a
warning once rather than once per process.
"""

from __future__ import annotations

import pickle
import sys
import traceback
import warnings
from typing import Callable, Sequence

from ..errors import MemprofError, is_interrupt

__all__ = ["ForkedTraceback", "Answer", "answer", "delivered"]

#: A warning a forked process issued: its category, its text, and where (file and line).
Warned = tuple[type[Warning], str, str, int]
#: What a forked process sends, pickled: "results" and the list, or "raised", the exception and its traceback there;
#: and the warnings it issued.
Answer = tuple[str, object, "str | None", list[Warned]]

_FIX = "pass processes=1 (--processes 1) to run every part in this process"


class ForkedTraceback(Exception):
    """The traceback of an exception raised in a forked process, as Python printed it there: the cause of the
    exception raised in the caller."""

    def __str__(self) -> str:
        return "\n\n" + str(self.args[0]) if self.args else ""


def answer(calls: "Sequence[Callable[[], object]]") -> bytes:
    """In a forked process: the results of ``calls``, or the exception one raised and its traceback, and the
    warnings they issued, pickled (once: an estimate's records are hundreds of kilobytes) and checked to unpickle,
    else an error saying what could not come back."""
    with warnings.catch_warnings(record=True) as caught:  # the filters stay the parent's: they decide what is caught
        value: object
        tb: "str | None"
        try:
            kind, value, tb = "results", [call() for call in calls], None
        except BaseException as exc:  # sent to the parent, which raises it: nothing is swallowed
            kind, value, tb = "raised", exc, "".join(traceback.format_exception(exc))
    warned = [(_picklable(w.category), str(w.message), w.filename, w.lineno) for w in caught]
    try:
        packed = pickle.dumps((kind, value, tb, warned))
        pickle.loads(packed)  # what cannot make the way back is said here, not failed on there
        return packed
    except Exception as failure:
        if is_interrupt(failure):
            raise
        why = f"{type(failure).__name__}: {failure}"
    if kind == "results":
        error = MemprofError(f"the results of a part run in a process of its own could not be sent back ({why}); "
                             f"{_FIX}")
        return pickle.dumps(("raised", error, None, warned))
    error = MemprofError(f"a part run in a process of its own raised {type(value).__name__}: {value}, which cannot "
                         f"be sent back to be raised as it is ({why}); {_FIX}")
    return pickle.dumps(("raised", error, tb, warned))


def delivered(packed: bytes) -> list[object]:
    """In the caller: the warnings issued again, then the results, or the exception raised from its traceback."""
    got: Answer = pickle.loads(packed)
    kind, value, tb, warned = got
    _warn_here(warned)
    if kind == "raised":
        assert isinstance(value, BaseException)
        if tb is None:
            raise value
        raise value from ForkedTraceback(tb)
    assert isinstance(value, list)
    return value


def _picklable(category: type[Warning]) -> type[Warning]:
    """``category``, or the nearest of its bases that pickles (a class made inside a function does not)."""
    for cls in category.__mro__:
        if issubclass(cls, Warning):
            try:
                pickle.dumps(cls)
                return cls
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                if is_interrupt(exc):
                    raise
    return UserWarning


def _warn_here(warned: "list[Warned]") -> None:
    """Issue here what a forked process issued, each where it was issued: with the registry of the module that
    holds that file, as Python's own ``warn`` would, so a warning the filters show once is shown once."""
    files = {getattr(m, "__file__", None): m for m in list(sys.modules.values())} if warned else {}
    for category, text, filename, lineno in warned:
        module = files.get(filename)
        registry: "dict[str | tuple[str, type[Warning], int], int]" = (
            vars(module).setdefault("__warningregistry__", {}) if module is not None
            else _REGISTRIES.setdefault(filename, {}))
        warnings.warn_explicit(text, category, filename, lineno,
                               module=module.__name__ if module is not None else None, registry=registry)


#: Where a warning was issued from a file no module holds: the registry that shows it once.
_REGISTRIES: "dict[str, dict[str | tuple[str, type[Warning], int], int]]" = {}
