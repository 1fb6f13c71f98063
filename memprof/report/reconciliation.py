"""A run held against the formulas: :func:`reconcile` and the :class:`Reconciliation` it returns, with its
table, text, HTML and waterfall."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..analyse.reconciler import reconciliation
from .wrap import promote, same_as

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Reconciliation", "reconcile"]


class Reconciliation(reconciliation.Reconciliation):
    __doc__ = reconciliation.Reconciliation.__doc__

    def to_frame(self) -> "pd.DataFrame":
        """DataFrame indexed by category value (plus ``total``): formula, estimate, measured, gap, gap_pct."""
        from ..render.frames import reconciliation_frame

        return reconciliation_frame(self)

    def to_text(self) -> str:
        """The table, the causes of its gaps, the notes and the advice: what ``print(rec)`` shows."""
        from ..render.text import reconciliation_text

        return reconciliation_text(self)

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        from ..render.html import reconciliation_html

        return reconciliation_html(self)

    def plot(self, ax: Any = None) -> Any:
        """A waterfall from the formula total to the measured total through the named causes (matplotlib)."""
        from ..render.plot import plot_reconciliation

        return plot_reconciliation(self, ax=ax)


@same_as(reconciliation.reconcile)
def reconcile(trace: Any, **options: Any) -> Reconciliation:
    return promote(Reconciliation, reconciliation.reconcile(trace, **options))
