"""A plan's grid (:class:`memprof.simulate.plan.PlanGrid`) and an estimate as text, JSON-ready data, a DataFrame
and a standalone HTML page."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from ..units import format_bytes
from ..record.aliases import JSON, JSONObject
from .common import NOT_MEASURED

if TYPE_CHECKING:
    import pandas as pd

    from ..record.estimate import Estimate, WhatIf
    from ..record.plans import PlanGrid, PlanRow

__all__ = ["estimate_data", "plan_rows", "plan_data", "plan_text", "plan_frame", "plan_page", "what_if_text"]

#: The columns of a plan's rows, in order (``plan_rows``, ``plan_frame``, the JSON of ``memprof plan``).
COLUMNS = ("parallel", "precision", "checkpointing", "max_batch_size", "batch", "peak_bytes", "device_peak",
           "headroom", "dominant", "dominant_bytes", "peak_step", "peak_phase", "simulations", "verified",
           "microbatches", "stages", "worst_stage", "failed")


def estimate_data(est: "Estimate") -> JSONObject:
    """An estimate as plain data (``memprof estimate --json``): the tensors' peak, the bytes of every category at
    the peak (None where not measured), the peak's step and phase, the precision and device, the notes, and with a
    GPU the device-level peak, whether it fits and the headroom."""
    trace = est.trace
    memory = est.device_memory
    return {
        "peak_bytes": est.peak_bytes,
        "breakdown": {c.value: trace.peak[c] for c in trace.peak},
        "peak_step": trace.peak_step,
        "peak_phase": trace.peak_phase_label(),
        "precision": est.precision,
        "device": est.device,
        "world_size": trace.distributed.world_size if trace.distributed is not None else 1,
        "parallel": trace.distributed.layout if trace.distributed is not None else None,
        "device_peak": est.device_peak,
        "fits": est.fits,
        "headroom": est.headroom,
        "gpu": memory.gpu.name if memory is not None and memory.gpu is not None else None,
        "capacity": memory.capacity if memory is not None else None,
        "notes": list(est.notes),
    }


def _row_data(row: "PlanRow") -> JSONObject:
    if row.failed is not None:  # no figures: None where an answered row has them, and why
        return {**dict.fromkeys(COLUMNS), "parallel": row.layout, "precision": row.precision,
                "checkpointing": row.checkpointing, "microbatches": row.microbatches, "breakdown": None,
                "failed": row.failed}
    return {"parallel": row.layout, "precision": row.precision, "checkpointing": row.checkpointing,
            "max_batch_size": row.max_batch_size, "batch": row.batch, "peak_bytes": row.peak_bytes,
            "device_peak": row.device_peak, "headroom": row.headroom, "dominant": row.dominant,
            "dominant_bytes": row.dominant_bytes, "peak_step": row.peak_step, "peak_phase": row.peak_phase,
            "simulations": row.simulations, "verified": row.verified, "microbatches": row.microbatches,
            "stages": row.stages, "worst_stage": row.worst_stage, "breakdown": dict(row.breakdown), "failed": None}


def plan_rows(grid: "PlanGrid") -> list[JSON]:
    """One dict per configuration (:data:`COLUMNS`, plus ``breakdown``: bytes per category at the peak). A
    pipeline row's ``max_batch_size`` and ``batch`` are one micro-batch's sequences, ``microbatches`` of them per
    step over ``stages`` pipeline stages, and its figures the rank of stage ``worst_stage``; the three are None for
    the other rows."""
    return [_row_data(r) for r in grid.rows]


def plan_data(grid: "PlanGrid") -> JSONObject:
    """The whole plan as plain data: what was planned, its rows, the best row's index and the notes."""
    best = grid.best()
    return {"model": grid.model, "gpu": grid.gpu, "capacity": grid.capacity, "world_size": grid.world_size,
            "seq_len": grid.seq_len, "seconds": round(grid.seconds, 3),
            "best": None if best is None else grid.rows.index(best), "rows": plan_rows(grid),
            "notes": list(grid.notes)}


def _size(n: "int | None") -> str:
    return NOT_MEASURED if n is None else format_bytes(n)


def _cells(row: "PlanRow", pipelined: bool = False) -> list[str]:
    if row.failed is not None:  # the reason stands in the figures' place (in full in the lines under the table)
        return [row.layout, row.precision, "on" if row.checkpointing else "off", "failed"] + [""] * (
            len(_HEADERS) - 4 + (len(_PIPELINE_HEADERS) if pipelined else 0))
    # "+": the answer fits, but the batch above it was not simulated (the search's ceiling): it may be larger.
    fits = (f"{row.max_batch_size}{'' if row.verified else '+'}") if row.max_batch_size else "none"
    at = "" if row.max_batch_size else " (at batch 1)"
    cells = [row.layout, row.precision, "on" if row.checkpointing else "off", fits,
             _size(row.device_peak) + at, _size(row.peak_bytes), _size(row.headroom),
             f"{row.dominant} {format_bytes(row.dominant_bytes)}",
             f"step {row.peak_step} {row.peak_phase}" if row.peak_phase else "", str(row.simulations)]
    if pipelined:  # a pipeline row's batch is a micro-batch's: how many per step, and whose rank the figures are
        cells += ["" if row.microbatches is None else str(row.microbatches),
                  "" if row.worst_stage is None else str(row.worst_stage)]
    return cells


_HEADERS = ["layout", "precision", "ckpt", "max batch", "device peak", "tensors", "headroom", "largest at the peak",
            "where", "sims"]
#: The columns a grid with a pipeline row adds (a plan without one prints as it always has).
_PIPELINE_HEADERS = ["micro-batches", "worst stage"]
_RIGHT = {3, 4, 5, 6, 9, 10, 11}


def _headers(grid: "PlanGrid") -> "tuple[list[str], bool]":
    pipelined = any(r.microbatches is not None for r in grid.rows)
    return _HEADERS + (_PIPELINE_HEADERS if pipelined else []), pipelined


def _best_line(best: "PlanRow") -> str:
    what = f"{best.layout}, {best.precision}, checkpointing {'on' if best.checkpointing else 'off'}"
    least = "" if best.verified else "at least "
    if best.microbatches is not None:
        return (f"* the largest batch: {what}: {least}{best.max_batch_size} per micro-batch x {best.microbatches} "
                f"micro-batches per pipeline rank (stage {best.worst_stage}'s rank the fullest)")
    return f"* the largest batch: {what}: {least}{best.max_batch_size} per rank"


def _failures(grid: "PlanGrid") -> list[str]:
    """A line per row that could not be simulated, saying why (under the text table, in the page's notes)."""
    return [f"failed: {r.layout} {r.precision} checkpointing {'on' if r.checkpointing else 'off'}: {r.failed}"
            for r in grid.rows if r.failed is not None]


def plan_text(grid: "PlanGrid") -> str:
    """The grid as a table for a terminal: a line per configuration, the best one marked with ``*``."""
    seq = f", {grid.seq_len} tokens per sequence" if grid.seq_len else ""
    lines = [f"memprof plan: {grid.model} on {grid.world_size} x {grid.gpu} ({format_bytes(grid.capacity)} each)"
             f"{seq}; the largest batch per rank that fits ({grid.seconds:.1f} s)"]
    headers, pipelined = _headers(grid)
    table = [headers] + [_cells(r, pipelined) for r in grid.rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(headers))]
    right = _RIGHT
    best = grid.best()
    for i, cells in enumerate(table):
        mark = "*" if i and grid.rows[i - 1] is best else " "
        lines.append(mark + " " + "  ".join(c.rjust(w) if j in right else c.ljust(w)
                                            for j, (c, w) in enumerate(zip(cells, widths))).rstrip())
    if best is None:
        lines.append("no configuration fits one sample per rank: more ranks, a shorter sequence or a larger GPU")
    else:
        lines.append(_best_line(best))
    lines.extend(_failures(grid))
    if not all(r.verified for r in grid.rows if r.failed is None):
        lines.append("+ an answer the batch above it was not simulated for (the search stopped at its ceiling, "
                     "max_batch): that batch fits, and a larger one may too")
    lines.extend(f"  - {note}" for note in grid.notes)
    return "\n".join(lines)


def plan_frame(grid: "PlanGrid") -> "pd.DataFrame":
    """The grid as a DataFrame, one row per configuration, the columns of :data:`COLUMNS`."""
    import pandas as pd

    frame = pd.DataFrame([[_row_data(r)[c] for c in COLUMNS] for r in grid.rows], columns=list(COLUMNS))
    for col in ("max_batch_size", "batch", "peak_bytes", "device_peak", "headroom", "dominant_bytes", "peak_step",
                "simulations", "microbatches", "stages", "worst_stage"):
        frame[col] = frame[col].astype("Int64")
    return frame


_CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 24px auto;
       max-width: 72em; padding: 0 16px; color: #1f1f1f; background: #ffffff; }
@media (prefers-color-scheme: dark) { body { color: #e6e6e6; background: #1e1e1e; } }
h1 { font-size: 18px; margin: 0 0 4px 0; }
table { border-collapse: collapse; font-size: 12px; margin: 12px 0; }
td, th { padding: 2px 10px; border-bottom: 1px solid rgba(128,128,128,0.25); white-space: nowrap; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
tr.best { font-weight: 600; }
tr.none { opacity: 0.6; }
"""


def plan_page(grid: "PlanGrid") -> str:
    """The grid as one standalone HTML document (inline CSS, no script, every text escaped)."""
    e = html.escape
    best = grid.best()
    headers, pipelined = _headers(grid)
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = []
    for row in grid.rows:
        cls = "best" if row is best else ("none" if not row.max_batch_size else "")
        title = f' title="{e(row.failed)}"' if row.failed is not None else ""
        cells = "".join(f'<td class="n">{e(c)}</td>' if i in _RIGHT else f"<td>{e(c)}</td>"
                        for i, c in enumerate(_cells(row, pipelined)))
        body.append(f'<tr class="{cls}"{title}>{cells}</tr>')
    notes = "".join(f"<li>{e(n)}</li>" for n in (*_failures(grid), *grid.notes))
    title = f"memprof plan: {grid.model} on {grid.world_size} x {grid.gpu}"
    seq = f", {grid.seq_len} tokens per sequence" if grid.seq_len else ""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{e(title)}</title><style>{_CSS}</style></head><body><h1>{e(title)}</h1>"
            f"<p>The largest batch per rank that fits {e(format_bytes(grid.capacity))} at the device level (tensors, "
            f"the caching allocator's segments, memory outside torch){e(seq)}. Bold: the largest batch.</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
            f"<ul>{notes}</ul></body></html>\n")


def what_if_text(result: "WhatIf") -> str:
    """A what-if: the change, then per category the measured run's bytes at its peak, the changed run's at its
    simulated peak and the saving; then the notes."""
    from ..units import format_bytes as fb

    change = ", ".join(f"{k}={v!r}" for k, v in result.changes)
    lines = [f"memprof what-if ({change}; simulated for {result.device}): peak {fb(result.peak_bytes)}"
             + ("" if result.saving_bytes is None else f", saving {fb(result.saving_bytes)} on the measured "
                f"{fb(result.baseline_peak_bytes or 0)}"),
             f"  {'category':<20}{'measured':>14}{'what-if':>14}{'saving':>14}"]
    saving = result.saving
    for c in result.peak:
        old = result.baseline[c] if result.baseline is not None else None
        new, save = result.peak[c], saving[c.value]
        if old is None and new is None:
            continue
        lines.append(f"  {c.value:<20}{_size(old):>14}{_size(new):>14}{_size(save):>14}")
    lines.extend(f"  - {note}" for note in result.notes)
    return "\n".join(lines)
