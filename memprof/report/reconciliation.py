"""A run held against the formulas: :func:`reconcile` and the :class:`Reconciliation` it returns, with the views
registered on it here (its table, text, HTML and waterfall): here rather than in :mod:`.views`, since the
analysis that makes it imports torch, and this module loads with it (``memprof.reconcile``,
``Report.reconcile``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..analyse.reconciler import reconciliation
from ..analyse.reconciler.reconciliation import Reconciliation
from ..record.aliases import Drawing
from ..record.views import register
from .wrap import same_as, Forwarded

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Reconciliation", "reconcile"]


def _frame(rec: Reconciliation) -> "pd.DataFrame":
    from ..render.frames import reconciliation_frame

    return reconciliation_frame(rec)


def _text(rec: Reconciliation) -> str:
    from ..render.text import reconciliation_text

    return reconciliation_text(rec)


def _html(rec: Reconciliation) -> str:
    from ..render.html import reconciliation_html

    return reconciliation_html(rec)


def _plot(rec: Reconciliation, ax: "Drawing | None" = None) -> Drawing:
    from ..render.plot import plot_reconciliation

    return plot_reconciliation(rec, ax=ax)


for _name, _view in (("to_frame", _frame), ("to_text", _text), ("_repr_html_", _html), ("plot", _plot)):
    register(Reconciliation, _name, _view)


@same_as(reconciliation.reconcile)
def reconcile(trace: Forwarded, **options: Forwarded) -> Reconciliation:
    return reconciliation.reconcile(trace, **options)
