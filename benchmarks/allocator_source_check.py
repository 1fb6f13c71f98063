"""On a CUDA device: is exact mode through the caching allocator's own events (``source="allocator"``: no dispatch
mode, no Python per op) exact, and is it cheap? (``python benchmarks/gpu_validate.py --allocator-source``.)

1. Exactness. The benchmark GPT of ``overhead.py`` runs three steady steps under
   ``memprof.profile(model, opt, mode="exact")`` (the dispatch mode's records), then three more under
   ``memprof.profile(model, opt, source="allocator")`` (records reduced from the allocator's events alone). The
   steps allocate the same shapes, so each phase's start, peak and end, total and every tensor category, are
   compared byte for byte. Where the two differ by design (the forward's end and backward's start: the hooks see
   backward begin at the model's own backward, so the loss function's backward falls in the forward phase; the
   forward's peak, which can be in it; docs/exact-sources.md), the comparison also says whether every other
   moment is byte-equal.
2. Cost. The same steps, timed (``torch.cuda.synchronize()`` around them) in rounds; in each round every
   variant runs once, in an order rotated from round to round, and each variant's time is divided by the bare
   step's of that round; the figure is the median of those paired ratios. Variants: ``bare``; ``null_dispatch``
   (a do-nothing dispatch mode, the floor of any dispatch-mode tracker); ``dispatch_source`` (exact mode,
   ``source="dispatch"``); ``allocator_events`` (exact mode, ``source="allocator"``: memprof's hooks without a
   dispatch mode, the allocator's history recorded without stacks, labelled, drained and reduced at every phase
   boundary). The target: allocator events at most 1.03x a bare step.

Without a CUDA device nothing runs (``gpu_validate.py`` says so and exits 0).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

import memprof
from memprof.vocabulary import TENSOR_CATEGORIES

CATS = tuple(c.value for c in TENSOR_CATEGORIES)
TARGET = 1.03


def _figures(bd: Any) -> dict[str, "int | None"]:
    return {"total": bd.total, **{c: bd[c] for c in CATS}}


#: The moments where the allocator's record differs from the dispatch mode's by design (docs/exact-sources.md).
BOUNDARY = (("forward", "peak"), ("forward", "end"), ("backward", "start"))


def compare_records(dispatch: "list[Any]", allocator: "list[Any]") -> dict[str, Any]:
    """Each phase record of the dispatch source against the allocator source's record of the same step and phase
    (both ``PhaseRecord``), matched in order; for each moment the two figures and whether they are equal."""
    rows = []
    j = 0
    for rec in dispatch:
        while j < len(allocator) and (allocator[j].step, allocator[j].phase) != (rec.step, rec.phase):
            j += 1
        if j == len(allocator):
            rows.append({"step": rec.step, "phase": rec.phase.value, "missing": True})
            continue
        other = allocator[j]
        j += 1
        row: dict[str, Any] = {"step": rec.step, "phase": rec.phase.value}
        for moment in ("start", "peak", "end"):
            d, a = _figures(getattr(rec, moment)), _figures(getattr(other, moment))
            row[moment] = {"dispatch": d, "allocator": a, "equal": d == a,
                           "total_gap": (a["total"] or 0) - (d["total"] or 0)}
        rows.append(row)
    found = [r for r in rows if not r.get("missing")]
    equal = len(found) == len(rows) and all(r[m]["equal"] for r in rows for m in ("start", "peak", "end"))
    elsewhere = len(found) == len(rows) and all(
        r[m]["equal"] for r in rows for m in ("start", "peak", "end") if (r["phase"], m) not in BOUNDARY)
    return {"phases": rows, "all_equal": bool(rows) and equal, "equal_but_at_the_boundary": bool(rows) and elsewhere}


def exactness(build: Callable[[], Any], steps: int = 3) -> dict[str, Any]:
    wl = build()
    for _ in range(2):
        wl.step()
    runs = []
    for source in ("dispatch", "allocator"):
        with memprof.profile(wl.model, wl.optimizer, mode="exact", source=source) as prof:
            for _ in range(steps):
                wl.step()
        runs.append([p for s in prof.trace.steps for p in s.phases])
    return compare_records(*runs)


def wall_clock(build: Callable[[], Any], rounds: int = 9, steps: int = 5) -> dict[str, Any]:
    from overhead import NullDispatchMode

    wl = build()
    for _ in range(3):
        wl.step()
    variants: dict[str, Callable[[], Any]] = {
        "bare": lambda: None,
        "null_dispatch": NullDispatchMode,
        "dispatch_source": lambda: memprof.profile(wl.model, wl.optimizer, mode="exact"),
        "allocator_events": lambda: memprof.profile(wl.model, wl.optimizer, mode="exact", source="allocator"),
    }
    names = list(variants)
    ratios: dict[str, list[float]] = {n: [] for n in names if n != "bare"}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        times: dict[str, float] = {}
        for name in order:
            ctx = variants[name]()
            if ctx is not None:
                ctx.__enter__()
            try:
                wl.step()  # the first step inside a block pays its one-off costs: not timed
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    wl.step()
                torch.cuda.synchronize()
                times[name] = time.perf_counter() - t0
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
        for n in ratios:
            ratios[n].append(times[n] / times["bare"])
    medians = {n: round(statistics.median(v), 4) for n, v in ratios.items()}
    return {"rounds": rounds, "steps": steps, "median_ratio_to_bare": medians,
            "allocator_events_meets_target": medians["allocator_events"] <= TARGET}


def run_check(device: torch.device, quick: bool = False) -> dict[str, Any]:
    from overhead import build_workload

    def build() -> Any:
        return build_workload("gpt", device, quick)

    return {"workload": build().description, "exactness": exactness(build), "wall_clock": wall_clock(build)}


def markdown(result: dict[str, Any]) -> str:
    ex, wc = result["exactness"], result["wall_clock"]
    lines = [f"Allocator events as exact mode's source, on {result['workload']}.", "",
             f"Byte-equal to the dispatch mode at every phase's start, peak and end: "
             f"{'yes' if ex['all_equal'] else 'no'}; everywhere but the forward/backward boundary: "
             f"{'yes' if ex['equal_but_at_the_boundary'] else 'no'}.", "",
             "| step | phase | start gap | peak gap | end gap |", "| --- | --- | ---: | ---: | ---: |"]
    for p in ex["phases"]:
        if p.get("missing"):
            lines.append(f"| {p['step']} | {p['phase']} | no allocator record | | |")
            continue
        lines.append(f"| {p['step']} | {p['phase']} | {p['start']['total_gap']:+,} | {p['peak']['total_gap']:+,} | "
                     f"{p['end']['total_gap']:+,} |")
    lines += ["", f"Wall clock, median of {wc['rounds']} paired ratios to a bare step ({wc['steps']} steps each):", "",
              "| variant | x bare |", "| --- | ---: |"]
    lines += [f"| {n} | {v} |" for n, v in wc["median_ratio_to_bare"].items()]
    lines += ["", f"Allocator events within {TARGET}x a bare step: "
              f"{'yes' if wc['allocator_events_meets_target'] else 'no'}."]
    return "\n".join(lines) + "\n"
