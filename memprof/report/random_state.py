"""The process's global random generators, left as memprof found them.

A script that seeds ``random``, NumPy or torch for its data order and calls memprof first (an estimate before
training, a plan) must then train on the order it seeded. Much of what a call of memprof runs draws from those
generators without saying so: torch's fake process group, on which a user's ``parallelize`` function runs, calls
``random.randint`` for every collective (its work items' ids); a model built from its config initialises its
weights; a transformers helper may shuffle. Rather than chase each draw, every public function of the facade
(:func:`memprof.report.wrap.same_as`) runs inside :func:`random_state_kept`, which puts back what it found.

Imports nothing heavy: a generator whose library the process has not imported cannot have been seeded by it.
"""

from __future__ import annotations

import contextlib
import random
import sys
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from ..record.aliases import Generators

__all__ = ["random_state_kept"]


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """On exit, also when the body raises, every global random generator as it was on entry: Python's
    ``random``, NumPy's legacy global one (``np.random.seed``), torch's CPU generator and, where CUDA was
    initialised, each CUDA device's. torch imported inside the body gets its generators back as a fresh import
    leaves them (seeded with ``torch.initial_seed()``); CUDA initialised inside it, its devices' likewise.
    Another thread that draws while the body runs has its draws undone too: the generators are the process's."""
    saved = _states()
    try:
        yield
    finally:
        _restore(saved)


def _states() -> "dict[str, Generators]":
    out: dict[str, Generators] = {"python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        out["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_rng_state"):  # not torch half-way through its own import
        out["torch"] = torch.get_rng_state()
        if torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _restore(saved: "dict[str, Generators]") -> None:
    random.setstate(saved["python"])
    if "numpy" in saved:
        sys.modules["numpy"].random.set_state(saved["numpy"])
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "set_rng_state"):
        return
    if "torch" in saved:
        torch.set_rng_state(saved["torch"])
    else:  # imported inside: as a fresh import leaves it
        torch.default_generator.manual_seed(torch.default_generator.initial_seed())
    if "cuda" in saved:
        torch.cuda.set_rng_state_all(saved["cuda"])
    elif torch.cuda.is_initialized():  # initialised inside: each device's generator as initialisation seeds it
        for generator in torch.cuda.default_generators:
            generator.manual_seed(generator.initial_seed())
