"""pandas DataFrames: phases, modules, operations, a breakdown, a reconciliation, a diff, merged ranks.

Byte columns are nullable ``Int64``: a figure that was not measured is
``<NA>``, never 0. pandas is imported inside each function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..vocabulary import PHASE_MOMENTS, Category, parse_moment
from ..errors import InvalidArgumentError, NotMeasuredError
from ..record.aliases import UserObject
from ..record.trace import as_trace

if TYPE_CHECKING:
    import pandas as pd

    from ..analyse.compare import Diff
    from ..analyse.merge import Merged
    from ..analyse.reconciler import Reconciliation
    from ..record.trace import Trace

__all__ = ["phases_frame", "phase_stats_frame", "modules_frame", "operations_frame", "breakdown_frame",
           "reconciliation_frame", "diff_frame", "diff_phases_frame", "merged_frame", "snapshot_frame"]


def phases_frame(trace: "Trace") -> "pd.DataFrame":
    """One row per (step, phase, occurrence): start, peak, end, ops and the composition at the peak."""
    import pandas as pd

    rows = []
    for rec in as_trace(trace).phases:
        row: dict[str, object] = {"step": rec.step, "phase": rec.phase.value, "occurrence": rec.occurrence,
                               "start": rec.start.total, "peak": rec.peak.total, "end": rec.end.total,
                               "ops": rec.ops}
        for cat in Category:
            row[cat.value] = rec.peak[cat]
        rows.append(row)
    columns = ["step", "phase", "occurrence", "start", "peak", "end", "ops"] + [c.value for c in Category]
    frame = pd.DataFrame(rows, columns=columns)
    for col in columns:
        if col != "phase":
            frame[col] = frame[col].astype("Int64")
    return frame


def phase_stats_frame(trace: "Trace") -> "pd.DataFrame":
    """One row per (phase, occurrence, moment, category or total) over every step of the run."""
    import pandas as pd

    from ..record.stats import STAT_KEYS

    rows = []
    for ps in as_trace(trace).phase_stats:
        for moment in ("peak", "end"):
            for key in STAT_KEYS:
                st = ps.at(moment, key)
                rows.append({"phase": ps.phase.value, "occurrence": ps.occurrence, "moment": moment,
                             "category": key, "count": ps.count, "min": st.min if st else None,
                             "median": st.median if st else None, "max": st.max if st else None,
                             "median_exact": ps.median_exact})
    cols = ["phase", "occurrence", "moment", "category", "count", "min", "median", "max", "median_exact"]
    frame = pd.DataFrame(rows, columns=cols)
    for col in ("occurrence", "count", "min", "median", "max"):
        frame[col] = frame[col].astype("Int64")
    return frame


def modules_frame(trace: "Trace") -> "pd.DataFrame":
    """One row per module path (the index; the root is ``"<model>"``)."""
    import pandas as pd

    cols = ["path", "type", "calls", "parameters", "gradients", "activations",
            "peak_forward", "temporaries_forward", "peak_backward", "temporaries_backward"]
    rows = [{c: getattr(m, c) for c in cols} for m in as_trace(trace).modules]
    frame = pd.DataFrame(rows, columns=cols)
    for col in cols[2:]:
        frame[col] = frame[col].astype("Int64")
    return frame.set_index("path")


def operations_frame(trace: "Trace", by: str = "op") -> "pd.DataFrame":
    """Per (phase, class, op), or per (phase, class) with ``by="class"``: counts, flops, bytes moved."""
    import pandas as pd

    trace = as_trace(trace)
    ops = trace.operations
    if ops is None:
        if trace.mode == "light":
            raise NotMeasuredError(
                "operations were not recorded: this run was in light mode, which sees no ops; profile with "
                "memprof.profile(model, optimizer, mode='exact', operations=True)")
        raise NotMeasuredError(
            "operations were not recorded; profile with memprof.profile(model, optimizer, operations=True)"
        )
    cols = ["phase", "class", "op", "count", "flops", "bytes_read", "bytes_written"]
    frame = pd.DataFrame([(o.phase, o.cls, o.op, o.count, o.flops, o.bytes_read, o.bytes_written)
                          for o in ops], columns=cols)
    if by == "class":
        return frame.groupby(["phase", "class"], as_index=False)[cols[3:]].sum()
    if by != "op":
        raise InvalidArgumentError(f"by must be 'op' or 'class', got {by!r}")
    return frame


def breakdown_frame(trace: "Trace", at: str = "peak") -> "pd.DataFrame":
    """The run's breakdown at ``at`` (``"peak"``, ``"start"``, ``"end"``): bytes and share per category."""
    import pandas as pd

    trace = as_trace(trace)
    at = parse_moment(at, PHASE_MOMENTS)
    bd = {"peak": trace.peak, "start": trace.start, "end": trace.end}[at]
    rows = []
    for cat in Category:
        v = bd[cat]
        share = (v / bd.total) if (v is not None and bd.total) else None
        rows.append({"category": cat.value, "bytes": v, "share": share})
    frame = pd.DataFrame(rows).set_index("category")
    frame["bytes"] = frame["bytes"].astype("Int64")
    frame["share"] = frame["share"].astype("Float64")
    return frame


def reconciliation_frame(rec: "Reconciliation") -> "pd.DataFrame":
    """Indexed by category value plus ``total``: formula, estimate, measured, gap, gap_pct."""
    import pandas as pd

    records = [{"category": r.category.value, "formula": r.formula, "estimate": r.estimate,
                "measured": r.measured, "gap": r.gap, "gap_pct": r.gap_pct} for r in rec.rows]
    t = rec.total
    records.append({"category": "total", "formula": t.formula, "estimate": t.estimate, "measured": t.measured,
                    "gap": t.gap, "gap_pct": t.gap_pct})
    frame = pd.DataFrame(records).set_index("category")
    for col in ("formula", "estimate", "measured", "gap"):
        frame[col] = frame[col].astype("Int64")
    frame["gap_pct"] = frame["gap_pct"].astype("Float64")
    return frame


def diff_frame(diff: "Diff") -> "pd.DataFrame":
    """Categories as rows (index ``category``): ``a``, ``b``, ``delta``, ``delta_pct``; no total row."""
    import pandas as pd

    frame = pd.DataFrame(
        [{"category": c.name, "a": c.a, "b": c.b, "delta": c.delta, "delta_pct": c.delta_pct}
         for c in diff.categories],
        columns=["category", "a", "b", "delta", "delta_pct"],
    ).set_index("category")
    for col in ("a", "b", "delta"):
        frame[col] = frame[col].astype("Int64")
    frame["delta_pct"] = frame["delta_pct"].astype("Float64")
    return frame


def diff_phases_frame(diff: "Diff") -> "pd.DataFrame":
    """Matched phases as rows: step, phase, occurrence, a, b, delta, delta_pct (peak totals)."""
    import pandas as pd

    cols = ["step", "phase", "occurrence", "a", "b", "delta", "delta_pct"]
    frame = pd.DataFrame(
        [{"step": p.step, "phase": p.phase.value, "occurrence": p.occurrence, "a": p.a, "b": p.b,
          "delta": p.delta, "delta_pct": p.delta_pct} for p in diff.phases],
        columns=cols,
    )
    for col in ("step", "occurrence", "a", "b", "delta"):
        frame[col] = frame[col].astype("Int64")
    frame["delta_pct"] = frame["delta_pct"].astype("Float64")
    return frame


def merged_frame(merged: "Merged") -> "pd.DataFrame":
    """One row per rank (index ``rank``): the peak total, the step and phase of the peak, and each category
    at the peak. ``merged.ranks`` may hold Traces or Reports."""
    import pandas as pd

    rows = []
    for rank in sorted(merged.ranks):
        t = as_trace(merged.ranks[rank])
        row: dict[str, object] = {"rank": rank, "peak": t.peak.total, "peak_step": t.peak_step,
                               "peak_phase": t.peak_phase.value if t.peak_phase is not None else None}
        row.update({c.value: t.peak[c] for c in Category})
        rows.append(row)
    return pd.DataFrame(rows).set_index("rank")


def snapshot_frame(trace: "Trace", snapshot: UserObject) -> "pd.DataFrame":
    """A real CUDA memory snapshot's active blocks with memprof's category and module, one row each
    (``address``, ``size``, ``requested_size``, ``category``, ``module``, ``device``): see
    :func:`memprof.render.memory_viz.attribute_snapshot`. ``snapshot``: the dict or its pickle's path."""
    import pandas as pd

    from .memory_viz import attribute_snapshot, read_snapshot

    columns = ["address", "size", "requested_size", "category", "module", "device"]
    return pd.DataFrame(attribute_snapshot(trace, read_snapshot(snapshot)), columns=columns)
