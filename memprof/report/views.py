"""The views of every result, registered on its record (:mod:`memprof.record.views`): the one place that pairs
a record with the renderers that show it and the analyses those renderers are handed.

Each view is a function of the record. The renderers (:mod:`memprof.render`) run no analysis: what they show
beside a record that an analysis computes (an estimate's formula column, textbook figure and mixed-layer gap; a
report's levers, :func:`memprof.report.reports.levers`) is computed in the facade and handed to them. Renderers
and analyses that import torch load on the first view that needs them, so that ``import memprof``, which runs
this module, stays free of torch. A reconciliation's views are registered by :mod:`.reconciliation`, which loads
with the analysis that makes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..analyse.compare import Diff
from ..analyse.merge import Merged
from ..record.device_memory import DeviceMemory
from ..record.estimate import Estimate, WhatIf
from ..record.plans import BatchSizePlan, PlanGrid
from ..record.aliases import Above, JSONObject
from ..record.views import register
from ..render.common import signed
from .reports import Report

if TYPE_CHECKING:
    import pandas as pd

    from ..analyse.reconciler import Textbook
    from ..record.trace import Breakdown

__all__ = ["estimate_text"]


# -- an estimate ---------------------------------------------------------------------------------------------------

def _formula(est: Estimate) -> "Breakdown":
    from ..analyse.reconciler import formula_at

    # No precision of its own: `precision` is the user's word for the configuration ("mixed", "amp",
    # "mixed-fp16" are one regime of bytes), and any choice here could differ from the reconciliation's.
    return formula_at(est.trace, "peak")


def _textbook(est: Estimate) -> "Textbook":
    from ..analyse.reconciler import textbook_at

    return textbook_at(est.trace, "peak")


def _report(est: Estimate) -> Report:
    return Report(est.trace)


def estimate_text(est: Estimate) -> str:
    """What ``print(est)`` shows: the formula and estimate columns at the simulated peak, the textbook line, the
    mixed-layer gap and the notes, each analysis run here and handed to :func:`memprof.render.text.estimate_text`."""
    from ..analyse.reconciler.mixed_layers import mixed_layer_gap
    from ..render.text import estimate_text as text

    return text(est, est.formula, est.textbook, mixed_layer_gap(est.trace))


def _what_if_text(result: WhatIf) -> str:
    from ..render.plan import what_if_text

    return what_if_text(result)


# -- plans and device memory ---------------------------------------------------------------------------------------

def _batch_size_text(plan: BatchSizePlan) -> str:
    from ..render.text import plan_text

    return plan_text(plan)


def _device_memory_text(memory: DeviceMemory) -> str:
    from ..render.text import device_memory_text

    return device_memory_text(memory)


def _grid_text(grid: PlanGrid) -> str:
    from ..render.plan import plan_text

    return plan_text(grid)


def _grid_frame(grid: PlanGrid) -> "pd.DataFrame":
    from ..render.plan import plan_frame

    return plan_frame(grid)


def _grid_data(grid: PlanGrid) -> JSONObject:
    from ..render.plan import plan_data

    return plan_data(grid)


def _grid_page(grid: PlanGrid) -> str:
    from ..render.plan import plan_page

    return plan_page(grid)


# -- a diff and merged ranks ---------------------------------------------------------------------------------------

def _diff_frame(d: Diff) -> "pd.DataFrame":
    from ..render.frames import diff_frame

    return diff_frame(d)


def _diff_phases_frame(d: Diff) -> "pd.DataFrame":
    from ..render.frames import diff_phases_frame

    return diff_phases_frame(d)


def _diff_text(d: Diff, *, max_phases: int = 20) -> str:
    from ..render.text import diff_text

    return diff_text(d, max_phases=max_phases)


def _diff_html(d: Diff) -> str:
    from ..render.html import diff_html

    return diff_html(d)


def _diff_repr(d: Diff) -> str:
    return f"<memprof.Diff {d.labels[0]} -> {d.labels[1]} {d.at} total {signed(d.total.delta, 'not measured')}>"


def _merged_frame(m: Merged) -> "pd.DataFrame":
    from ..render.frames import merged_frame

    return merged_frame(m)


def _merged_text(m: Merged) -> str:
    from ..render.text import merged_text

    return merged_text(m)


def _merged_html(m: Merged) -> str:
    from ..render.html import merged_html

    return merged_html(m)


_VIEWS: "tuple[tuple[type, str, Callable[..., Above]], ...]" = (
    (Estimate, "formula", _formula),
    (Estimate, "textbook", _textbook),
    (Estimate, "report", _report),
    (Estimate, "to_text", estimate_text),
    (WhatIf, "to_text", _what_if_text),
    (BatchSizePlan, "to_text", _batch_size_text),
    (DeviceMemory, "to_text", _device_memory_text),
    (PlanGrid, "to_text", _grid_text),
    (PlanGrid, "to_frame", _grid_frame),
    (PlanGrid, "to_dict", _grid_data),
    (PlanGrid, "to_html", _grid_page),
    (Diff, "to_frame", _diff_frame),
    (Diff, "phases_frame", _diff_phases_frame),
    (Diff, "to_text", _diff_text),
    (Diff, "_repr_html_", _diff_html),
    (Diff, "__repr__", _diff_repr),
    (Merged, "to_frame", _merged_frame),
    (Merged, "to_text", _merged_text),
    (Merged, "_repr_html_", _merged_html),
)

for _cls, _name, _view in _VIEWS:
    register(_cls, _name, _view)
