"""The facade, top floor: the only place that pairs results with their renderers.

The floors below return records (a :class:`~memprof.record.trace.Trace`, a reconciliation, a diff, an
estimate, a plan), each one frozen class. :class:`Report` wraps a Trace with its views; the other results are
returned as they are, and the views a user reads of them (``print()``, ``_repr_html_``, ``to_frame()``,
``plot()``, ``report()`` ...) are functions of the record that :mod:`.views` registers on its class
(:mod:`memprof.record.views`), handing :mod:`memprof.render` what :mod:`memprof.analyse` computes. Each public
function here returns one of them:

* :mod:`.reports` -- :class:`Report` and :func:`load`;
* :mod:`.comparison` -- :func:`diff` and :class:`Diff`;
* :mod:`.ranks` -- :func:`merge` and :class:`Merged`;
* :mod:`.reconciliation` -- :func:`reconcile` and :class:`Reconciliation`;
* :mod:`.estimates` -- :func:`estimate`, :func:`estimate_generation`, the planners, :class:`Estimate`
  and :class:`BatchSizePlan`;
* :mod:`.planning` -- :func:`estimate_hf` and :func:`plan` from a model's config, :class:`Plan`, and the
  what-if of a measured run (``Report.what_if``);
* :mod:`.profiling` -- :func:`profile` and :class:`Profiler`, whose ``report()`` gives the Report.

The last four import torch, so they load on first use: importing memprof stays free of it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import views  # noqa: F401  (registers every torch-free record's views)
from .comparison import Diff, diff
from .ranks import Merged, merge
from .reports import Report, load

if TYPE_CHECKING:
    from ..record.aliases import LazyName

__all__ = ["Report", "load", "Diff", "diff", "Merged", "merge", "Reconciliation", "reconcile", "Estimate",
           "BatchSizePlan", "estimate", "estimate_generation", "max_batch_size", "max_generation_batch_size",
           "Profiler", "profile", "estimate_hf", "plan"]

#: The names whose modules import torch, and those modules.
LAZY = {
    "Reconciliation": "reconciliation",
    "reconcile": "reconciliation",
    "Estimate": "estimates",
    "BatchSizePlan": "estimates",
    "estimate": "estimates",
    "estimate_generation": "estimates",
    "max_batch_size": "estimates",
    "max_generation_batch_size": "estimates",
    "Pipeline": "estimates",
    "estimate_hf": "planning",
    "plan": "planning",
    "Profiler": "profiling",
    "profile": "profiling",
}


def __getattr__(name: str) -> "LazyName":
    module = LAZY.get(name)
    if module is None:
        # A submodule spelled from the package (memprof.report.planning.plan_grid, as the docs spell it) loads
        # on first use, as the lazy names do, rather than only after something else imported it.
        from importlib.util import find_spec

        if not name.startswith("_") and find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
