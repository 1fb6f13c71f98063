"""The process's heap kept out of the garbage collector's full passes while a simulation runs.

A simulation makes hundreds of thousands of short-lived objects (fake tensors, autograd nodes, ledger entries),
enough to start several of CPython's full collections per estimate; each full collection walks every object
in the process, torch's and transformers' modules included (about 380,000 after building a Llama from its
config): 0.5 s of a 7 s pipeline stage's estimate, where the objects the simulation made are a few thousand at
each pass. :func:`frozen` moves the objects that exist when the simulation starts to the collector's permanent
generation (``gc.freeze()``) and back to its oldest one after (``gc.unfreeze()``), so the passes meanwhile walk
what the simulation made. Nothing is collected differently: an object frozen here that became garbage meanwhile
is collected by the next full pass after.

The heap is left as it is where the collector is off or objects are frozen already: by an outer simulation (a
plan's estimates, a pipeline's forked rank classes), or by the user's own ``gc.freeze()``, whose objects an
unfreeze here would hand back to the collector.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["frozen"]


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """The block with the objects that exist on entry frozen (the module docstring), unfrozen on leaving it
    however it leaves."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
