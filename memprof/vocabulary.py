"""The words every floor shares: the categories a byte can belong to, the phases of a training step, and
the moments a breakdown is read at (the ``at=`` of every API)."""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

from .errors import InvalidArgumentError, UnknownNameError, is_interrupt

__all__ = ["Category", "Phase", "TENSOR_CATEGORIES", "DEVICE_CATEGORIES", "PEAK", "START", "END", "STEADY",
           "PHASE_MOMENTS", "BUDGET_MOMENTS", "RECONCILE_MOMENTS", "parse_moment"]


class Category(str, Enum):
    """What a byte of memory is for. A storage has exactly one category at a time."""

    WEIGHTS = "weights"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATES = "optimizer_states"
    ACTIVATIONS = "activations"
    INPUTS = "inputs"
    KV_CACHE = "kv_cache"
    COMMUNICATION = "communication"
    TEMPORARIES = "temporaries"
    ALLOCATOR_OVERHEAD = "allocator_overhead"
    OUTSIDE_TORCH = "outside_torch"

    def __str__(self) -> str:  # str(Category.WEIGHTS) == "weights", as users print it
        return self.value

    @classmethod
    def parse(cls, value: "Category | str") -> "Category":
        """Accept a Category or its value; raise :class:`UnknownNameError` otherwise."""
        return _parse(cls, value, "category")


class Phase(str, Enum):
    """The part of a training step a moment belongs to.

    ``forward`` runs from the model's first forward call until backward starts
    (the loss computation belongs to it); ``backward`` is autograd's work;
    ``optimizer`` is ``optimizer.step()``; ``other`` is everything between
    (``zero_grad``, data movement, evaluation outside the model's forward).
    In inference with a KV cache, ``prefill`` is the forward that fills the cache
    from the prompt and ``decode`` each forward that reads it back and appends a
    token; a generation has no backward and no optimizer phase.
    """

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    OTHER = "other"
    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "Phase | str") -> "Phase":
        """Accept a Phase or its value; raise :class:`UnknownNameError` otherwise."""
        return _parse(cls, value, "phase")


_E = TypeVar("_E", bound=Enum)


def _parse(cls: type[_E], value: object, what: str) -> _E:
    """The member of ``cls`` named by ``value`` (any case, spaces around ignored), or an error listing them."""
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).strip().lower())
    except ValueError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        known = ", ".join(m.value for m in cls)
        raise UnknownNameError(f"unknown {what} {value!r}; use one of: {known}") from None


#: Categories measured from tensors (every mode, every device).
TENSOR_CATEGORIES: tuple[Category, ...] = (
    Category.WEIGHTS,
    Category.BUFFERS,
    Category.GRADIENTS,
    Category.OPTIMIZER_STATES,
    Category.ACTIVATIONS,
    Category.INPUTS,
    Category.KV_CACHE,
    Category.COMMUNICATION,
    Category.TEMPORARIES,
)

#: Categories that only an accelerator's allocator and driver can report.
DEVICE_CATEGORIES: tuple[Category, ...] = (
    Category.ALLOCATOR_OVERHEAD,
    Category.OUTSIDE_TORCH,
)


# -- moments: one vocabulary for "at which instant", the ``at=`` of every API -----------------------

#: A phase's (or the run's) highest total, its first and its last moment.
PEAK, START, END = "peak", "start", "end"
#: The end of the last optimizer step: every model state exists (reconciliation only).
STEADY = "steady"
#: Where each API reads its figures: a phase or the run (Report.breakdown, breakdown_frame, diff), a budget
#: (check_budget, the memory_budget marker), a reconciliation.
PHASE_MOMENTS = (PEAK, START, END)
BUDGET_MOMENTS = (PEAK, END)
RECONCILE_MOMENTS = (PEAK, STEADY)


def parse_moment(value: object, allowed: tuple[str, ...], name: str = "at") -> str:
    """``value`` if it is one of ``allowed`` moments; else an InvalidArgumentError that lists them."""
    if isinstance(value, str) and value.strip().lower() in allowed:
        return value.strip().lower()
    natural = ", ".join(allowed[:-1]) + f" or {allowed[-1]}" if len(allowed) > 1 else allowed[0]
    raise InvalidArgumentError(f"{name} must be {natural} (one of {', '.join(allowed)}), got {value!r}")
