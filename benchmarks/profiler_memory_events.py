"""CPU's profiler memory events as a source of exact mode's phase records: are they exact, and are they cheaper?

Run from the repository root::

    python benchmarks/profiler_memory_events.py            # the benchmark GPT and CNN of overhead.py
    python benchmarks/profiler_memory_events.py --quick    # the same models, small
    python benchmarks/profiler_memory_events.py --json out.json --markdown out.md

What it does
------------
``torch.profiler.profile(profile_memory=True)`` records every allocation and free of the CPU allocator in C++
(``c10::reportMemoryUsageToProfiler``: address, signed bytes, time), with no Python per op. Two steady
training steps run once inside both memprof's exact mode (the dispatch-mode source) and torch's profiler. At
each of memprof's phase boundaries the time (the profiler's clock: ``time.time_ns()``, the realtime clock) and
what the ledger knows (the address and category of every live storage) are noted; afterwards the profiler's
events are cut at those times and each window is reduced by ``memprof.collect.allocation_events`` (the reducer
``source="allocator"`` uses on CUDA), seeded with what the ledger held at the start. Each window's start, peak
and end, total and by category, is then compared with the dispatch mode's phase record, byte for byte.

The cost is counted, not timed (wall clock on a shared machine moves by more than the differences): Python
calls per op above a bare step (``overhead_counts.count_calls``, ``sys.setprofile``) and cProfile's total for
one step, for the dispatch source (exact mode), for what a profiler source would run (torch's profiler with
memory events, plus memprof's hooks without a dispatch mode: light mode's), and for torch's profiler alone.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import sys
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import memprof  # noqa: E402
from memprof.collect.allocation_events import Live, from_profiler, reduce_window, split_at  # noqa: E402
from memprof.collect.allocator_source import known_addresses  # noqa: E402
from memprof.vocabulary import TENSOR_CATEGORIES  # noqa: E402

import overhead  # noqa: E402
import overhead_counts  # noqa: E402

CATS = tuple(c.value for c in TENSOR_CATEGORIES)


MARK = "memprof::boundary"


def memory_events(tp: Any) -> tuple[list[tuple[int, int, int]], list[int]]:
    """(time_ns, address, signed bytes) of every CPU allocation and free torch's profiler recorded, in order, and
    the times of the boundary marks (:func:`boundary_mark`), on the profiler's own clock."""
    from torch._C._profiler import _EventType

    out: list[tuple[int, int, int]] = []
    marks: list[int] = []
    stack = list(tp.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if str(f.device).startswith("cpu"):
                out.append((e.start_time_ns, f.ptr, f.alloc_size))
        elif e.name == MARK:
            marks.append(e.start_time_ns)
    out.sort(key=lambda x: x[0])  # stable: events at one nanosecond keep the profiler's order
    return out, sorted(marks)


def boundary_mark() -> None:
    """An event in the profiler's own stream at a phase boundary: its clock is the allocations' (the wall clock
    read in Python is not: the profiler converts an approximate clock, and one allocation at a boundary fell on
    the wrong side of time.time_ns()). Python dispatch is off for it, so that memprof's mode sees no op."""
    with torch._C._DisableTorchDispatch():
        with torch.profiler.record_function(MARK):
            pass


def _figures(bd: Any) -> dict[str, int]:
    return {"total": bd.total, **{c: bd[c] for c in CATS}}


def compare(wl: overhead.Workload, steps: int = 2) -> dict[str, Any]:
    """Both sources over the same ``steps`` steady steps; one row per phase record of the dispatch mode."""
    for _ in range(2):
        wl.step()  # steady: the optimizer's state exists
    marks: list[tuple[int, str, dict[int, list[Any]]]] = []
    with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as tp:
        with memprof.profile(wl.model, wl.optimizer, mode="exact") as prof:
            seed = known_addresses(prof.ledger)
            run, ledger = prof.run, prof.ledger

            def mark(*_: Any) -> None:
                known = known_addresses(ledger)
                boundary_mark()
                marks.append((run.step, run.phase.value, known))

            assert prof.collectors is not None
            prof.collectors.phases.on_begin.append(mark)
            prof.collectors.phases.on_step_end.append(mark)
            for _ in range(steps):
                wl.step()
            mark()  # the phase in progress when the block ends
    raw, times = memory_events(tp)
    if len(times) != len(marks):
        raise SystemExit(f"{len(marks)} phase boundaries but {len(times)} marks in the profiler's events")
    events = from_profiler(raw)
    windows = split_at(events, times, key="time_ns")
    live = Live({a: list(v) for a, v in seed.items()})
    reduced = []
    for (step, phase, known), evs in zip(marks, windows):
        reduced.append((step, phase, reduce_window(evs, live, {a: v[1] for a, v in known.items()},
                                                   sizes={a: v[0] for a, v in known.items()})))
    rows = []
    j = 0
    for rec in (p for s in prof.trace.steps for p in s.phases):
        while j < len(reduced) and (reduced[j][0], reduced[j][1]) != (rec.step, rec.phase.value):
            j += 1
        if j == len(reduced):
            break
        w = reduced[j][2]
        j += 1
        row: dict[str, Any] = {"step": rec.step, "phase": rec.phase.value, "occurrence": rec.occurrence}
        for moment in ("start", "peak", "end"):
            d, p = _figures(getattr(rec, moment)), _figures(getattr(w, moment))
            row[moment] = {"dispatch": d, "profiler": p, "equal": d == p,
                           "total_gap": (p["total"] or 0) - (d["total"] or 0)}
        row["unmatched_frees"] = w.unmatched_frees
        rows.append(row)
    return {"phases": rows, "events": len(events), "boundaries": len(marks),
            "all_equal": all(r[m]["equal"] for r in rows for m in ("start", "peak", "end"))}


def _cprofile_calls(fn: Callable[[], Any]) -> int:
    p = cProfile.Profile()
    p.runcall(fn)
    return pstats.Stats(p).total_calls  # type: ignore[attr-defined]


def costs(wl: overhead.Workload) -> dict[str, Any]:
    """Python calls per op above a bare step, and cProfile's total per step, for each way of measuring."""
    step = wl.step
    for _ in range(2):
        step()
    ops = overhead_counts.ops_per_step(step)
    bare = min(overhead_counts.count_calls(step).total for _ in range(3))
    bare_cp = min(_cprofile_calls(step) for _ in range(3))

    def under(ctx: Callable[[], Any]) -> tuple[int, int]:
        with ctx():
            step()
            calls = min(overhead_counts.count_calls(step).total for _ in range(3))
            cp = min(_cprofile_calls(step) for _ in range(3))
        return calls, cp

    def profiler_only() -> Any:
        return torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    class Both:
        """torch's profiler with memory events and memprof's hooks without a dispatch mode (light mode)."""

        def __enter__(self) -> None:
            self.tp = profiler_only().__enter__()
            self.mp = memprof.profile(wl.model, wl.optimizer, mode="light").__enter__()

        def __exit__(self, *exc: Any) -> None:
            self.mp.__exit__(*exc)
            self.tp.__exit__(*exc)

    variants: dict[str, Callable[[], Any]] = {
        "dispatch source (exact mode)": lambda: memprof.profile(wl.model, wl.optimizer, mode="exact"),
        "profiler source (torch profiler + hooks)": Both,
        "torch profiler alone (profile_memory=True)": profiler_only,
        "do-nothing dispatch mode": overhead.NullDispatchMode,
    }
    out: dict[str, Any] = {"ops_per_step": ops, "bare_calls": bare, "bare_cprofile_calls": bare_cp, "variants": {}}
    for name, ctx in variants.items():
        calls, cp = under(ctx)
        out["variants"][name] = {"calls_per_op": round((calls - bare) / ops, 2), "cprofile_calls": cp,
                                 "cprofile_calls_above_bare": cp - bare_cp}
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for name, r in result["workloads"].items():
        c = r["compare"]
        lines.append(f"**{name}** ({r['description']}): {c['events']} profiler memory events, {len(c['phases'])} "
                     f"phases, all byte-equal: {'yes' if c['all_equal'] else 'no'}")
        lines.append("")
        lines.append("| step | phase | start gap | peak gap | end gap | peak, dispatch | peak, profiler | "
                     "temporaries at peak, dispatch / profiler |")
        lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for p in c["phases"]:
            pk = p["peak"]
            lines.append(f"| {p['step']} | {p['phase']} | {p['start']['total_gap']:+,} | {pk['total_gap']:+,} | "
                         f"{p['end']['total_gap']:+,} | {pk['dispatch']['total']:,} | {pk['profiler']['total']:,} | "
                         f"{pk['dispatch']['temporaries']:,} / {pk['profiler']['temporaries']:,} |")
        lines.append("")
        k = r["costs"]
        lines.append(f"{k['ops_per_step']} ops per step; a bare step makes {k['bare_calls']:,} Python calls "
                     f"({k['bare_cprofile_calls']:,} by cProfile).")
        lines.append("")
        lines.append("| way of measuring | Python calls per op above bare | cProfile calls per step above bare |")
        lines.append("| --- | ---: | ---: |")
        for v, f in k["variants"].items():
            lines.append(f"| {v} | {f['calls_per_op']} | {f['cprofile_calls_above_bare']:,} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small models (seconds)")
    ap.add_argument("--workloads", default="gpt,cnn")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "torch": torch.__version__, "quick": args.quick, "workloads": {}}
    for name in args.workloads.split(","):
        wl = overhead.build_workload(name, torch.device("cpu"), args.quick)
        result["workloads"][name] = {"description": wl.description, "compare": compare(wl)}
        wl = overhead.build_workload(name, torch.device("cpu"), args.quick)
        result["workloads"][name]["costs"] = costs(wl)
    text = markdown(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
