"""Leaving memprof on for a whole run: memory it holds, the saved trace, the printed report.

Three measurements on the CPU:

1. exact mode, a small MLP, ``--steps`` steps (default 10,000): the Python heap memprof keeps growing
   from step 500 to the end (tracemalloc, started at step 500: bytes allocated since and still held,
   minus the same for the bare loop), the size of the saved trace and the lines of ``str(report)``;
2. light mode, a tiny model, 1,000 and ``--light-steps`` (default 100,000) steps: memprof's heap at the
   end of each run (tracemalloc from the profile's start), which must not grow with the run;
3. the same exact run with a schedule recording 2 steps in 100, for the heap and the trace.

Usage: python benchmarks/long_run.py [--steps N] [--light-steps N] [--quick] [--json PATH] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import tempfile
import time
import tracemalloc
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memprof  # noqa: E402
from _machine import command_line, cpu_model, write_results  # noqa: E402


def _mlp() -> "tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]":
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), torch.randn(16, 32), torch.randn(16, 8)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def growth(steps: int, profiled: bool, schedule: Any = None) -> dict[str, Any]:
    """Bytes allocated after step 500 and still held at the end (tracemalloc, one frame)."""
    model, opt, x, y = _mlp()
    ctx = memprof.profile(model, opt, mode="exact", schedule=schedule) if profiled else contextlib.nullcontext()
    began = time.perf_counter()
    with ctx as prof:
        for i in range(steps):
            _step(model, opt, x, y)
            if i == 499:
                gc.collect()
                tracemalloc.start(1)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
    out: dict[str, Any] = {"steps": steps, "held_since_500_bytes": held, "seconds": time.perf_counter() - began}
    if profiled:
        rep = prof.report()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "run.json")
            rep.save(path)
            out["trace_bytes"] = os.path.getsize(path)
        out["report_lines"] = len(str(rep).splitlines())
        out["steps_kept_in_full"] = len(rep.trace.steps)
    return out


def light_heap(steps: int) -> dict[str, Any]:
    """memprof's heap at the end of a light-mode run of ``steps`` steps of a tiny model."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    gc.collect()
    tracemalloc.start(1)
    began = time.perf_counter()
    with memprof.profile(model, opt, mode="light") as prof:
        for _ in range(steps):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"steps": steps, "held_bytes": held, "seconds": time.perf_counter() - began,
            "num_steps": prof.report().num_steps}


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def markdown(r: dict[str, Any]) -> str:
    g, b, s = r["exact"], r["bare"], r["scheduled"]
    lines = [
        "| run | steps | heap held since step 500 | memprof's share | saved trace | `str(report)` lines | steps kept in full |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| bare loop | {b['steps']:,} | {_kib(b['held_since_500_bytes'])} | | | | |",
        f"| exact mode | {g['steps']:,} | {_kib(g['held_since_500_bytes'])} | "
        f"{_kib(g['held_since_500_bytes'] - b['held_since_500_bytes'])} | {_kib(g['trace_bytes'])} | "
        f"{g['report_lines']} | {g['steps_kept_in_full']} |",
        f"| exact, schedule(wait=98, active=2) | {s['steps']:,} | {_kib(s['held_since_500_bytes'])} | "
        f"{_kib(s['held_since_500_bytes'] - b['held_since_500_bytes'])} | {_kib(s['trace_bytes'])} | "
        f"{s['report_lines']} | {s['steps_kept_in_full']} |",
        "",
        "| light mode, tiny model | steps | memprof heap at the end |",
        "| --- | ---: | ---: |",
    ]
    for run in r["light"]:
        lines.append(f"| | {run['steps']:,} | {_kib(run['held_bytes'])} |")
    return "\n".join(lines) + "\n"


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="steps of the exact runs (default 10,000; quick 800)")
    ap.add_argument("--light-steps", type=int, default=None, help="steps of the long light run (default 100,000)")
    ap.add_argument("--quick", action="store_true", help="small counts: a smoke test")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--markdown", metavar="PATH")
    args = ap.parse_args(argv)
    steps = args.steps or (800 if args.quick else 10_000)
    light_steps = args.light_steps or (2_000 if args.quick else 100_000)
    torch.set_num_threads(1)
    info = {"cpu": cpu_model(), "torch": torch.__version__, "memprof": memprof.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command_line(__file__, argv)}
    result: dict[str, Any] = {"bare": growth(steps, False), "exact": growth(steps, True)}
    result["scheduled"] = growth(steps, True, memprof.schedule(wait=98, active=2))
    result["light"] = [light_heap(1_000 if not args.quick else 500), light_heap(light_steps)]
    md = markdown(result)
    print(md)
    write_results(args.json, {"machine": info, "results": result}, args.markdown, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
