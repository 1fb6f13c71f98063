"""Exports and OOM dumps: how long they take and how large their files are.

1. A ``--steps``-step run (default 10,000) of a small MLP in exact mode, once plain and once with a
   schedule keeping the most detail memprof keeps (2 steps recorded in every 10, so 256 steps in full):
   the time to write the Chrome trace, the memory_viz snapshot and the HTML report (median of
   ``--repeats``), and their sizes.
2. The HTML report of a model with ``--modules`` modules (default 1,000).
3. An OOM dump: a model of ``--modules`` modules whose forward raises ``torch.OutOfMemoryError`` halfway;
   the time from the raise until the exception leaves the ``with`` block, dump written (median of
   ``--repeats``).

Usage: python benchmarks/exports.py [--steps N] [--modules N] [--repeats N] [--quick] [--json PATH] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memprof  # noqa: E402
from _machine import command_line, cpu_model, write_results  # noqa: E402


def _run(steps: int, schedule: Any = None) -> memprof.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    with memprof.profile(model, opt, schedule=schedule) as prof:
        for _ in range(steps):
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    return prof.report()


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def exports(report: memprof.Report, repeats: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": report.num_steps, "steps_kept": len(report.trace.steps),
                           "moments": len(report.trace.timeline)}
    for name, how, ext in (("chrome", "export_chrome_trace", "json"), ("memory_viz", "export_memory_viz", "pickle"),
                           ("html", "export_html", "html")):
        path = os.path.join(folder, f"{name}.{ext}")
        out[f"{name}_seconds"] = _timed(lambda: getattr(report, how)(path), repeats)
        out[f"{name}_bytes"] = os.path.getsize(path)
    return out


def _deep(modules: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(modules // 2)])


def big_html(modules: int, folder: str) -> dict[str, Any]:
    model = _deep(modules)
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt) as prof:
        for _ in range(3):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    path = os.path.join(folder, "big.html")
    began = time.perf_counter()
    prof.report().export_html(path)
    return {"modules": modules, "html_seconds": time.perf_counter() - began, "html_bytes": os.path.getsize(path)}


class _Oom(nn.Module):
    """Raises an OOM once armed: after a full training step, halfway through the next forward."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the benchmark)")
        return x


def oom_dump(modules: int, repeats: int, folder: str) -> dict[str, Any]:
    times = []
    for _ in range(repeats):
        model = _deep(modules)
        layers = list(model)
        trap = _Oom()
        model = nn.Sequential(*layers[: len(layers) // 2], trap, *layers[len(layers) // 2:])
        opt = torch.optim.AdamW(model.parameters())
        began = 0.0
        try:
            with memprof.profile(model, opt, oom_dump=folder):
                model(torch.randn(4, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
                trap.armed = True
                began = time.perf_counter()
                model(torch.randn(4, 16))
        except torch.OutOfMemoryError:
            times.append(time.perf_counter() - began)
    dumps = [f for f in os.listdir(folder) if f.startswith("memprof-oom-")]
    return {"modules": sum(1 for _ in model.modules()), "seconds": statistics.median(times), "dumps": len(dumps),
            "dump_bytes": max(os.path.getsize(os.path.join(folder, f)) for f in dumps)}


def markdown(r: dict[str, Any]) -> str:
    lines = ["| run | steps | kept in full | moments | Chrome trace | memory_viz | HTML |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in ("plain", "scheduled"):
        e = r[name]
        cells = " | ".join(f"{e[k + '_seconds']:.2f} s, {e[k + '_bytes'] / 1024:,.0f} KiB"
                           for k in ("chrome", "memory_viz", "html"))
        lines.append(f"| {name} | {e['steps']:,} | {e['steps_kept']} | {e['moments']:,} | {cells} |")
    h, o = r["big_html"], r["oom"]
    lines += ["", f"HTML report of a {h['modules']:,}-module model: {h['html_seconds']:.2f} s, "
              f"{h['html_bytes'] / 1024:,.0f} KiB.",
              f"OOM dump of a {o['modules']:,}-module model: {o['seconds'] * 1000:.0f} ms from the raise until the "
              f"exception left the block (median of {len(r['oom_repeats'])} runs), dump {o['dump_bytes'] / 1024:,.0f} KiB."]
    return "\n".join(lines) + "\n"


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="steps of the long run (default 10,000; quick 300)")
    ap.add_argument("--modules", type=int, default=None, help="modules of the large model (default 1,000; quick 100)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5; quick 1)")
    ap.add_argument("--quick", action="store_true", help="small counts: a smoke test")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--markdown", metavar="PATH")
    args = ap.parse_args(argv)
    steps = args.steps or (300 if args.quick else 10_000)
    modules = args.modules or (100 if args.quick else 1_000)
    repeats = args.repeats or (1 if args.quick else 5)
    torch.set_num_threads(1)
    info = {"cpu": cpu_model(), "torch": torch.__version__, "memprof": memprof.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command_line(__file__, argv)}
    with tempfile.TemporaryDirectory() as folder:
        result: dict[str, Any] = {
            "plain": exports(_run(steps), repeats, folder),
            "scheduled": exports(_run(steps, memprof.schedule(wait=8, active=2)), repeats, folder),
            "big_html": big_html(modules, folder),
        }
        with tempfile.TemporaryDirectory() as dumps:
            result["oom"] = oom_dump(modules, repeats, dumps)
        result["oom_repeats"] = list(range(repeats))
    md = markdown(result)
    print(md)
    write_results(args.json, {"machine": info, "results": result}, args.markdown, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
