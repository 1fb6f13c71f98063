"""The emulated autocast of a simulation: which 16-bit dtype its CUDA policy casts to on this thread now.

A simulation that targets CUDA applies CUDA's autocast policy itself, one level above the ops
(:mod:`memprof.simulate.autocast`), since torch's own autocast never reaches shape-only tensors. The
collectors must know it as they know torch's own autocast (the trace records the autocast dtype, and some
ops' fp32 outputs are tagged under it), so the state lives here, beneath both: the simulation writes it,
the collectors read it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["emulated_autocast_dtype", "set_emulated_autocast_dtype"]

_current = threading.local()


def emulated_autocast_dtype() -> "torch.dtype | None":
    """The 16-bit dtype of the emulated CUDA autocast forward running on this thread, if any."""
    return getattr(_current, "dtype", None)


def set_emulated_autocast_dtype(dtype: "torch.dtype | None") -> None:
    """An emulated autocast forward begins on this thread in ``dtype`` (``None``: it ended)."""
    _current.dtype = dtype
