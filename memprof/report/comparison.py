"""Two runs compared: :func:`diff` and the :class:`Diff` it returns, with its text, tables and HTML."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..analyse import compare
from ..render.common import signed
from .wrap import promote, same_as

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Diff", "diff"]


class Diff(compare.Diff):
    __doc__ = compare.Diff.__doc__

    def to_frame(self) -> "pd.DataFrame":
        """Categories as rows (index ``category``), columns ``a``, ``b``, ``delta``, ``delta_pct``.

        Bytes are nullable ``Int64`` (``<NA>`` where not measured),
        ``delta_pct`` is ``Float64`` percent of ``a``. The total is not a row
        (summing the column stays honest); it is :attr:`total`.
        """
        from ..render.frames import diff_frame

        return diff_frame(self)

    def phases_frame(self) -> "pd.DataFrame":
        """Matched phases as rows: ``step``, ``phase``, ``occurrence``, ``a``, ``b``, ``delta``, ``delta_pct``
        (peak totals)."""
        from ..render.frames import diff_phases_frame

        return diff_phases_frame(self)

    def to_text(self, *, max_phases: int = 20) -> str:
        """What ``print(diff)`` shows: the categories, then at most ``max_phases`` matched phases."""
        from ..render.text import diff_text

        return diff_text(self, max_phases=max_phases)

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        from ..render.html import diff_html

        return diff_html(self)

    def __repr__(self) -> str:
        return (f"<memprof.Diff {self.labels[0]} -> {self.labels[1]} {self.at} total "
                f"{signed(self.total.delta, 'not measured')}>")


@same_as(compare.diff)
def diff(a: "Any | str | os.PathLike[str]", b: "Any | str | os.PathLike[str]", **options: Any) -> Diff:
    return promote(Diff, compare.diff(a, b, **options))
