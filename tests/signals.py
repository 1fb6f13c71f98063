"""What the tests of memprof's signal handling share: a preemption handler's exception, the handler, and a copy
that drops a handler's exception as CPython's ``copyreg._slotnames`` does. (Imports nothing of memprof.)"""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator


class Preempted(Exception):
    """What a preemption handler raises (to save a checkpoint, say)."""


def preempted(signum: int, frame: object) -> None:
    raise Preempted


@contextlib.contextmanager
def preemption_handler(signum: int = signal.SIGUSR1) -> Iterator[None]:
    """:func:`preempted` installed for ``signum`` inside the block, the handler before it put back after."""
    previous = signal.signal(signum, preempted)
    try:
        yield
    finally:
        signal.signal(signum, previous)


class SwallowsInCopy:
    """Its deep copy sends SIGUSR1 to this process and drops whatever the handler raised, as CPython's
    ``copyreg._slotnames`` does at the line that caches its answer (``try: ... except: pass``), which a deep copy runs
    for every object of a built-in type it reduces. ``copies`` counts the copies that ran to their end."""

    copies = 0

    def __deepcopy__(self, memo: "dict[int, object]") -> "SwallowsInCopy":
        try:
            signal.raise_signal(signal.SIGUSR1)
        except:  # noqa: E722  # as copyreg's
            pass
        SwallowsInCopy.copies += 1
        return SwallowsInCopy()
