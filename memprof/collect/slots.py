"""What a running profile holds: its model and its thread, each profiled by one profile at a time.

A second profile of the same model would hook every module twice; a second one in the same thread would
push its saved-tensor hooks above the first's and hide every saved tensor from it (dispatch modes and
saved-tensor hooks are per thread). So a profile takes both slots when it starts and frees them when it ends,
and a profile that finds either taken is refused before it installs anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ProfilerStateError
from .weak import WeakIdentitySet

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ACTIVE_MODELS", "ACTIVE_THREADS", "refuse_taken", "take", "free"]

#: Models being profiled now.
ACTIVE_MODELS: "WeakIdentitySet[nn.Module]" = WeakIdentitySet()
#: Profiles active per thread id. A dict rather than a threading.local, so that a profile ended from another
#: thread still frees its thread's slot.
ACTIVE_THREADS: dict[int, int] = {}


def refuse_taken(model: "nn.Module", thread: int) -> None:
    """A ProfilerStateError naming the fix when ``model`` or ``thread`` is being profiled already."""
    if model in ACTIVE_MODELS:
        raise ProfilerStateError(
            "memprof.profile() is already active on this model; exit that block first "
            "(one profiler per model at a time)"
        )
    if ACTIVE_THREADS.get(thread, 0):
        raise ProfilerStateError(
            "another memprof.profile() is active in this thread; profiles cannot nest (the inner one would "
            "hide saved tensors from the outer); profile the outer model once and read report.modules() "
            "for its submodules"
        )


def take(model: "nn.Module", thread: int) -> None:
    """``model`` and ``thread`` are profiled from now on (after :func:`refuse_taken` found both free)."""
    ACTIVE_MODELS.add(model)
    ACTIVE_THREADS[thread] = 1


def free(model: "nn.Module | None", thread: int) -> None:
    """The profile has ended: ``model`` (None when it is gone) and ``thread`` (0: none taken) may be profiled
    again. Safe to run twice."""
    if model is not None:
        ACTIVE_MODELS.discard(model)
    if thread:
        ACTIVE_THREADS.pop(thread, None)
