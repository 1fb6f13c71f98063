"""What the planners return: :class:`BatchSizePlan` (:func:`memprof.max_batch_size`'s answer and how it was
found) and :class:`PlanGrid` of :class:`PlanRow` (``memprof plan``'s grid). Plain data, no torch needed to read
them; :mod:`memprof.simulate.planner` and :mod:`memprof.simulate.plan` make them. Their text, table and page are
views registered from above (:mod:`.views`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from .views import show
from .aliases import JSONObject

if TYPE_CHECKING:
    import os

    import pandas as pd

__all__ = ["BatchSizePlan", "PlanRow", "PlanGrid"]


@dataclass(frozen=True)
class BatchSizePlan:
    """The answer of :func:`max_batch_size` (or :func:`max_generation_batch_size`) and how it was found.

    ``batch_size`` is the largest multiple of ``multiple_of`` below which every batch fits (0 when not even
    ``multiple_of`` samples do). ``budget`` is the budget given, or the GPU's capacity without one. ``limit`` is
    what each batch's peak was judged against: the budget, no more than the GPU's capacity, and under a memory
    fraction (``fraction``) no more than what the allocator may reserve (``allocator_limit``, torch's
    ``allowed_memory_maximum``) plus the memory outside torch (``outside_bytes``). ``device_level`` says the peaks
    are device-level (a GPU, ``gpu``, was given), else they are the tensors' peaks.

    ``points`` are the simulated (batch size, peak) pairs, ``peak_bytes`` the one at the answer (None for 0); a
    batch in ``out_of_memory`` is one whose replay predicts an out-of-memory error, its peak the one it needed.
    ``verified`` says the answer fits and the next multiple does not, both simulated. ``fixed_bytes`` and
    ``per_sample_bytes`` describe the judged peak near the answer, as the line through the two simulated batches
    nearest it (``per_sample_bytes`` 0.0 when one batch was simulated); the search itself follows each phase
    moment's own line, not this one. ``notes`` say what was judged and what the limit is made of.
    """

    batch_size: int
    budget: int
    fixed_bytes: int
    per_sample_bytes: float
    peak_bytes: "int | None"
    points: tuple[tuple[int, int], ...]
    verified: bool
    multiple_of: int
    limit: "int | None" = None
    device_level: bool = False
    gpu: "str | None" = None
    fraction: "float | None" = None
    allocator_limit: "int | None" = None
    outside_bytes: "int | None" = None
    out_of_memory: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    def to_text(self) -> str:
        """The answer, the straight line it started from and the batch sizes simulated: what ``print()`` shows."""
        text: str = show(self, "to_text")
        return text

    def __str__(self) -> str:
        return self.to_text()


@dataclass(frozen=True)
class PlanRow:
    """One configuration of the grid and its answer.

    ``max_batch_size`` is one rank's largest batch that fits (0 when not even one sample does). The figures
    are the simulated step's at ``batch`` (``max_batch_size``, or 1 when nothing fits, to say by how much):
    ``peak_bytes`` the tensors' peak, ``device_peak`` the device-level one, ``headroom`` the GPU's capacity
    less it, ``dominant`` the largest category at the peak (allocator overhead and memory outside torch
    included) with its bytes, and the peak's step and phase. ``simulations`` counts the simulated batches;
    ``verified`` says the answer fits and the next batch does not, both simulated. For a pipeline layout the batch
    is the micro-batch's size, the micro-batch count fixed (``microbatches``), and the figures are the worst
    stage's rank (``worst_stage``).
    """

    layout: str
    precision: str
    checkpointing: bool
    max_batch_size: int
    batch: int
    peak_bytes: int
    device_peak: "int | None"
    headroom: "int | None"
    dominant: str
    dominant_bytes: int
    peak_step: "int | None"
    peak_phase: "str | None"
    breakdown: Mapping[str, "int | None"]
    simulations: int
    verified: bool
    #: A pipeline layout's micro-batches per step: the row's batch is then one micro-batch's size (the rank's
    #: step takes ``batch x microbatches`` sequences), None for the other layouts.
    microbatches: "int | None" = None
    #: A pipeline layout's stage whose rank the figures are (the one with the largest device-level peak).
    worst_stage: "int | None" = None
    #: A pipeline layout's stages (its pipeline degree), None for the other layouts.
    stages: "int | None" = None
    #: Why the configuration could not be simulated (the error, one line), None for a row with an answer. A failed
    #: row has no figures: ``max_batch_size`` and the byte figures are 0 there, and the renderers show the reason
    #: in their place (its JSON gives None); the plan's other rows stand.
    failed: "str | None" = None


@dataclass(frozen=True)
class PlanGrid:
    """The plan of one model on one GPU: a row per configuration, in the order searched, and what it assumed."""

    rows: tuple[PlanRow, ...]
    model: str
    gpu: str
    capacity: int
    world_size: int
    seq_len: "int | None"
    seconds: float
    notes: tuple[str, ...] = ()

    def best(self) -> "PlanRow | None":
        """The configuration with the largest batch (the fewest bytes at it breaking ties); None if none fits. A
        pipeline row counts the sequences its rank's share of a step is, micro-batch x micro-batches / stages (the
        pipeline's ``P`` ranks share each sequence), as a data-parallel row's batch is one rank's."""
        fitting = [r for r in self.rows if r.max_batch_size > 0 and r.failed is None]
        return max(fitting, key=lambda r: (r.max_batch_size * (r.microbatches or 1) / (r.stages or 1),
                                           -(r.device_peak or r.peak_bytes)), default=None)

    def to_text(self) -> str:
        """The grid as a terminal table, the best configuration marked, then the notes: what ``print()`` shows."""
        text: str = show(self, "to_text")
        return text

    def __str__(self) -> str:
        return self.to_text()

    def to_frame(self) -> "pd.DataFrame":
        """One row per configuration (``parallel``, ``precision``, ``checkpointing``, ``max_batch_size``,
        ``peak_bytes``, ``device_peak``, ``dominant`` ...)."""
        return show(self, "to_frame")

    def to_dict(self) -> JSONObject:
        """The plan as plain data, ready for ``json.dumps`` (``memprof plan --json`` prints its ``rows``)."""
        data: JSONObject = show(self, "to_dict")
        return data

    def to_html(self) -> str:
        """The grid as one standalone HTML page."""
        page: str = show(self, "to_html")
        return page

    def export_html(self, path: "str | os.PathLike[str]") -> None:
        """Write :meth:`to_html` to ``path``, atomically."""
        from .files import write_text_atomic

        write_text_atomic(path, self.to_html())
