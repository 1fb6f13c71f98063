"""Context managers an interrupt left entered, finished while the simulation can still put the thread back.

A signal handler's exception (Ctrl-C's ``KeyboardInterrupt``) lands at any bytecode: in a generator-based context
manager's ``__enter__`` after its generator reached ``yield``, or at the first line of its ``__exit__``. That
``with`` is then abandoned: nothing will call its exit, and the generator stays suspended inside its own ``with``
blocks, held by the frames of the exception's traceback. Python closes it only when the traceback dies, in the
user's code after the ``except`` that caught the interrupt, and its ``finally`` runs there.

torch's fake-tensor mode enters such a context manager around each kernel (``in_kernel_invocation_manager``,
torch/_subclasses/fake_tensor.py), and it holds a ``_PreserveDispatchKeyGuard``, whose exit puts back the whole
thread-local dispatch key set it saw on entry: inside the dispatch of an op, where torch's Python key excludes
autograd. Closed late, it left autograd excluded for good, and every later estimate of the process failed ("element
0 of tensors does not require grad"). :func:`finish_abandoned` closes those generators at once, from the simulation's
cleanup (:class:`memprof.simulate.stages.NothingLeftBehind`), which then puts the thread's state back as it was.
"""

from __future__ import annotations

import contextlib
import inspect
from types import TracebackType
from typing import Generator

from ..errors import is_interrupt

__all__ = ["finish_abandoned"]


def finish_abandoned(tb: "TracebackType | None") -> None:
    """Close every generator-based context manager (``contextlib.contextmanager``) that a frame of ``tb`` holds
    in a local while its generator is suspended, innermost first, as unwinding would have exited them.

    A ``with`` whose body the exception left has already run its exit, so its generator has finished: only those
    an exception cut off between their entry and their exit are still suspended. A user's interruption that one of
    their ``finally`` blocks raises is raised once the others are closed; any other failure there is what
    Python would have reported as ignored when the traceback died, and is left out as Python goes on."""
    found: "list[Generator[object, None, None]]" = []
    seen: "set[int]" = set()
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            gen = getattr(value, "gen", None) if isinstance(value, contextlib._GeneratorContextManager) else None
            if gen is not None and id(gen) not in seen and inspect.getgeneratorstate(gen) == inspect.GEN_SUSPENDED:
                seen.add(id(gen))
                found.append(gen)
        tb = tb.tb_next
    _close(found[::-1])


def _close(gens: "list[Generator[object, None, None]]") -> None:
    for i, gen in enumerate(gens):
        try:
            gen.close()
        except BaseException as failure:
            if not is_interrupt(failure):
                continue  # what Python's own closing would have reported as ignored, and gone on
            _close(gens[i + 1:])  # the others still, then the user's interruption
            raise
