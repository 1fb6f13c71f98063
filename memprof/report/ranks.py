"""The ranks of one distributed run: :func:`merge` and the :class:`Merged` it returns, each rank a Report."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterable

from ..analyse import merge as merging
from .reports import Report
from .wrap import promote, same_as

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Merged", "merge"]


class Merged(merging.Merged):
    """Reports of the ranks of one run. ``ranks`` maps each rank to its :class:`~memprof.Report`;
    ``missing`` lists ranks of the world that were not given; ``notes`` say what else to know."""

    ranks: "dict[int, Report]"

    def to_frame(self) -> "pd.DataFrame":
        """One row per rank: the peak total, the step and phase of the peak, and each category at the peak."""
        from ..render.frames import merged_frame

        return merged_frame(self)

    def to_text(self) -> str:
        """Each rank's peak, where it was and its largest categories, and the spread: what ``print()`` shows."""
        from ..render.text import merged_text

        return merged_text(self)

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        from ..render.html import merged_html

        return merged_html(self)


@same_as(merging.merge)
def merge(reports: "Iterable[Any | str | os.PathLike[str]]", *, mixed: bool = False) -> Merged:
    data = merging.merge(reports, mixed=mixed)
    return promote(Merged, data, ranks={rank: Report(trace) for rank, trace in data.ranks.items()})
