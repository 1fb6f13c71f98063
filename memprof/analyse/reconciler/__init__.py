"""Holding a measured run against the formulas: the formula side, the named causes, advice.

* :mod:`.formula` -- the textbook breakdown of a recorded run at one moment;
* :mod:`.textbook` -- the figure the literature quotes for the run beside it, the difference named;
* :mod:`.causes` -- the table of named causes, one small function each;
* :mod:`.reconciliation` -- :func:`reconcile` and the :class:`Reconciliation` it returns;
* :mod:`.advice` -- the levers that shrink the largest categories.
"""

from __future__ import annotations

from .context import Cause
from .formula import formula_at, formula_breakdown
from .reconciliation import Reconciliation, Row, Total, reconcile
from .textbook import Textbook, textbook_at

__all__ = ["reconcile", "Reconciliation", "Row", "Total", "Cause", "formula_at", "formula_breakdown",
           "Textbook", "textbook_at"]
