"""A run as a Chrome trace (Trace Event Format), for ui.perfetto.dev and chrome://tracing.

What the file holds, all on one process ("memprof"):

* a counter track per measured category and one for the total (``ph: "C"``), bytes over time;
  a value is written when it changes, so a flat category costs nothing;
* duration spans (``ph: "X"``) for steps, phases and module calls (forward and backward on
  their own tracks, each properly nested, as both viewers require);
* an instant event (``ph: "i"``) at each phase's peak, and one at the run's peak, with the
  composition in ``args``;
* ``otherData``: the versions, the device, the notes, and what the time axis is.

Times are microseconds since the profile started (the format's unit). A category that was not
measured has no track: it is never drawn as 0. Format reference: "Trace Event Format", Google,
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..vocabulary import Category
from ..record.trace import Breakdown, as_trace
from ..units import format_bytes
from .curve import curve, phase_times

if TYPE_CHECKING:
    from ..record.aliases import JSON, JSONObject
    from ..record.trace import Trace
    from .curve import Point

__all__ = ["chrome_trace", "TRACKS", "BACKWARD_TID"]

_PID = 1
#: Thread ids of the span tracks, with their names.
TRACKS = {1: "steps", 2: "phases", 3: "modules (forward)", 5: "modules (overlapping)"}
#: Backward module calls: one track per depth of the module tree, from this thread id on.
BACKWARD_TID = 10


def _composition(bd: Breakdown) -> "JSONObject":
    out: "JSONObject" = {c.value: v for c, v in bd.measured().items()}
    out["total"] = bd.total
    out["readable"] = ", ".join(f"{c.value} {format_bytes(v)}" for c, v in bd.measured().items() if v)
    return out


def chrome_trace(trace: "Trace") -> "JSONObject":
    """The run as a Trace Event Format document (a dict ready for ``json.dump``): JSON objects throughout, each
    event of the keys its phase (``ph``) takes."""
    t = as_trace(trace)
    cv = curve(t)
    events: "list[JSON]" = [
        {"ph": "M", "pid": _PID, "name": "process_name",
         "args": {"name": f"memprof: {t.device.name or t.device.type} ({t.mode} mode)"}},
    ]
    modules = _modules(cv.points)
    tracks = dict(TRACKS)
    for tid in sorted({n for e in modules if isinstance(n := e["tid"], int) and n >= BACKWARD_TID}):
        tracks[tid] = f"modules (backward, depth {tid - BACKWARD_TID})"
    events += [{"ph": "M", "pid": _PID, "tid": tid, "name": "thread_name", "args": {"name": name}}
               for tid, name in tracks.items()]
    events += [{"ph": "M", "pid": _PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}}
               for tid in tracks]
    events += _counters(cv.points)
    events += _steps_and_phases(t)
    events += modules
    last = max((p.time_us for p in cv.points), default=0.0)
    if t.error:
        events.append({"ph": "i", "s": "g", "pid": _PID, "tid": 2, "ts": last, "name": "error",
                       "args": {"error": t.error}})
    measured = {c.value for c in Category if t.peak[c] is not None}
    other: "JSONObject" = {
        "memprof_version": t.memprof_version,
        "torch_version": t.torch_version,
        "mode": t.mode,
        "device": t.device.name or t.device.type,
        "steps": t.num_steps,
        "steps_kept": [s.index for s in t.steps],
        "not_measured": [c.value for c in Category if c.value not in measured],
        "time_axis": ("microseconds since the profile started" if cv.timed else
                      "no clock in this trace (saved before memprof recorded times): each phase is drawn "
                      "1 ms long, one after another, and the module samples are left out"),
        "notes": list(t.notes),
    }
    if t.schedule is not None:
        other["schedule"] = t.schedule
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _counters(points: "Sequence[Point]") -> "list[JSONObject]":
    out: "list[JSONObject]" = []
    last: dict[str, "int | None"] = {}
    for pt in points:
        values = {c.value: v for c, v in pt.breakdown.measured().items()}
        if pt.breakdown.total is not None:
            values["total"] = pt.breakdown.total
        for name, v in values.items():
            if last.get(name) != v:
                last[name] = v
                out.append({"ph": "C", "pid": _PID, "name": name, "ts": pt.time_us, "args": {"bytes": v}})
    return out


def _steps_and_phases(t: "Trace") -> "list[JSONObject]":
    out: "list[JSONObject]" = []
    spans: dict[int, list[float]] = {}
    times = phase_times(t)
    for p, start, peak, end in times:
        span = spans.setdefault(p.step, [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
        name = p.phase.value if p.occurrence == 0 else f"{p.phase.value} #{p.occurrence}"
        out.append({"ph": "X", "pid": _PID, "tid": 2, "ts": start, "dur": max(end - start, 0.0), "name": name,
                    "args": {"step": p.step, "start": p.start.total, "peak": p.peak.total, "end": p.end.total,
                             "ops": p.ops}})
        out.append({"ph": "i", "s": "t", "pid": _PID, "tid": 2, "ts": peak,
                    "name": f"peak of {name} (step {p.step})", "args": _composition(p.peak)})

    # The run's peak: at the peak of the phase that holds it.
    held = t.peak_record()
    for p, _, peak, _ in times:
        if p is not held:
            continue
        out.append({"ph": "i", "s": "g", "pid": _PID, "tid": 2, "ts": peak, "name": "peak of the run",
                    "args": dict(_composition(t.peak), module=t.peak_module)})
    for step, (start, end) in spans.items():
        out.append({"ph": "X", "pid": _PID, "tid": 1, "ts": start, "dur": max(end - start, 0.0),
                    "name": f"step {step}", "args": {"step": step}})
    return out


def _depth(path: str) -> int:
    return 0 if path == "<model>" else path.count(".") + 1


def _modules(points: "Sequence[Point]") -> "list[JSONObject]":
    """Module calls from the timeline's enter/exit samples.

    Forward calls nest, so they share one track (a call that would cross its parent's end goes to
    the overlapping track). In backward a module's frame closes when the gradient of its input is
    computed, which can come a few microseconds before its first child's closes: so each depth of the
    module tree has its own backward track, where calls never overlap. A call whose exit was never
    recorded (in backward: no gradient flowed to its inputs, as for the first layer and the root; or an
    error mid-forward) is drawn to the end of its phase, and its ``args`` say so.
    """
    open_calls: dict[tuple[int, str, str], list[float]] = {}
    spans: list[tuple[float, float, str, str, int, bool]] = []
    for pt in points:
        if pt.kind == "end":  # the phase is over: whatever is still open ends here, unrecorded
            for key in [k for k in open_calls if k[0] == pt.step and k[1] == pt.phase.value]:
                for start in open_calls.pop(key):
                    spans.append((start, pt.time_us, key[2], key[1], key[0], False))
            continue
        if pt.module is None:
            continue
        key = (pt.step, pt.phase.value, pt.module)
        if pt.kind == "enter":
            open_calls.setdefault(key, []).append(pt.time_us)
        elif pt.kind == "exit" and open_calls.get(key):
            spans.append((open_calls[key].pop(), pt.time_us, pt.module, pt.phase.value, pt.step, True))
    out: "list[JSONObject]" = []
    forward: list[float] = []
    for start, end, module, phase, step, closed in sorted(spans, key=lambda s: (s[0], -(s[1] - s[0]))):
        if phase == "backward":
            tid = BACKWARD_TID + _depth(module)
        else:
            tid = 3
            while forward and forward[-1] <= start:
                forward.pop()
            if forward and end > forward[-1]:
                tid = 5  # crosses its enclosing call's end: a track of its own
            else:
                forward.append(end)
        args: "JSONObject" = {"step": step, "phase": phase}
        if not closed:
            args["end"] = "not recorded: drawn to the end of the phase"
        out.append({"ph": "X", "pid": _PID, "tid": tid, "ts": start, "dur": max(end - start, 0.0),
                    "name": module, "args": args})
    return out
