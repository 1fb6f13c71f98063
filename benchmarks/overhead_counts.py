"""What exact and light mode cost, counted in Python calls: a figure that load cannot blur.

Run from the repository root::

    python benchmarks/overhead_counts.py                   # the benchmark GPT of overhead.py, about 1 minute
    python benchmarks/overhead_counts.py --small           # the same model at width 32, seq 16, batch 2
    python benchmarks/overhead_counts.py --json out.json --markdown out.md
    python benchmarks/overhead_counts.py --bytecodes       # also the bytecodes a step executes (a few minutes)

What is counted
---------------
Wall-clock ratios on a shared machine move by several per cent from one run to
the next; the number of Python frames a step runs does not. Every Python
function call (a ``"call"`` event of ``sys.setprofile``) in one steady training
step is counted, once bare and once inside ``memprof.profile(mode=...)``, and
the difference is divided by the ops a dispatch mode sees in that step. One
frame added to memprof's per-op path adds 1.0 to the figure.

Each call is also charged to the memprof entry point it ran under (the
outermost memprof frame on the stack: the dispatch handler, a saved-tensor
pack or unpack, a module hook, a weak-reference callback ...), which gives the
calls per saved tensor and per module call. The counted steps are steady ones,
after ``warmup`` steps inside the profile: in exact mode their optimizer step is
carried (measured once, then run without memprof's dispatch mode and replayed), as
in any run past its first steps. Calls outside any memprof frame
that a dispatch mode causes (torch's per-op lookups of Python dispatch rules,
``torch/_library/simple_registry.py``) appear only in the total.

The reference is a do-nothing ``TorchDispatchMode`` (``overhead.NullDispatchMode``):
the floor of any tracker built on a Python dispatch mode, as torch wraps it.

The smaller model (``--small``) runs the same ops and hooks per step as the
full-size one, so its figures per op are close to the full size's;
``tests/integration/test_overhead_counts.py`` holds them to a budget.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from torch.utils._python_dispatch import TorchDispatchMode

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # run as a script from anywhere, or loaded by path from the tests
    sys.path.insert(0, _HERE)

import memprof  # noqa: E402

_MEMPROF_DIR = os.path.dirname(os.path.abspath(memprof.__file__)) + os.sep

#: Entry points (``file:function``) charged to the saved tensors autograd keeps, and to the module calls.
SAVED_ENTRIES = frozenset({"saved.py:pack", "saved.py:unpack", "saved_hooks.py:pack", "saved_hooks.py:unpack",
                           "saved_hooks.py:__del__"})
MODULE_ENTRIES = frozenset({"modules.py:pre_hook", "modules.py:post_hook", "frames.py:enter", "frames.py:exit_"})
HANDLER = "dispatch.py:__torch_dispatch__"
FREED = "ledger.py:_freed"


@dataclass
class Counts:
    """The Python calls one run of a function made, split by the memprof entry point they ran under."""

    total: int = 0
    #: entry point (``file:function``) -> calls made under it (its own frame included)
    under: "collections.Counter[str]" = field(default_factory=collections.Counter)
    #: entry point -> times it was entered from outside memprof
    entries: "collections.Counter[str]" = field(default_factory=collections.Counter)


def count_calls(fn: Callable[[], Any]) -> Counts:
    """Run ``fn`` once under ``sys.setprofile`` and count its Python calls."""
    out = Counts()
    under, entries = out.under, out.entries
    depth = 0
    entry = ""
    total = 0
    prefix = _MEMPROF_DIR

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal depth, entry, total
        if event == "call":
            total += 1
            ours = frame.f_code.co_filename.startswith(prefix)
            if depth:
                under[entry] += 1
                if ours:
                    depth += 1
            elif ours:
                code = frame.f_code
                entry = f"{os.path.basename(code.co_filename)}:{code.co_name}"
                entries[entry] += 1
                under[entry] += 1
                depth = 1
        elif event == "return" and depth and frame.f_code.co_filename.startswith(prefix):
            depth -= 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    out.total = total
    return out


def count_bytecodes(fn: Callable[[], Any]) -> tuple[int, int]:
    """Run ``fn`` once under ``sys.settrace`` with opcode events: the bytecodes it executed in every Python
    frame, and of those in memprof's own files. Finer than calls (a frame's length counts, not only its
    existence), and as deaf to load."""
    counts = [0, 0]

    def opcode(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            counts[0] += 1
        return opcode

    def opcode_mine(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            counts[0] += 1
            counts[1] += 1
        return opcode_mine

    def call(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return opcode_mine if frame.f_code.co_filename.startswith(_MEMPROF_DIR) else opcode

    sys.settrace(call)
    try:
        fn()
    finally:
        sys.settrace(None)
    return counts[0], counts[1]


def _fewest(fn: Callable[[], Any], times: int) -> Counts:
    # The fewest calls of a few runs: a garbage collection or a cache filled once adds calls to one run only.
    return min((count_calls(fn) for _ in range(times)), key=lambda c: c.total)


class _OpCounter(TorchDispatchMode):
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        _OpCounter.n += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(step: Callable[[], Any]) -> int:
    """The ops a dispatch mode sees in one step."""
    _OpCounter.n = 0
    with _OpCounter():
        step()
    return _OpCounter.n


def measure(step: Callable[[], Any], model: Any, optimizer: Any, modes: tuple[str, ...] = ("exact", "light"),
            null_mode: "type | None" = None, warmup: int = 2, times: int = 3,
            bytecodes: bool = False) -> dict[str, Any]:
    """Calls per op above a bare step for each mode (and the do-nothing dispatch mode ``null_mode``), with
    calls per saved tensor and per module call; ``step`` must be steady after ``warmup`` steps. With
    ``bytecodes``, also the bytecodes a steady step executes above a bare one (all frames, and memprof's)."""
    for _ in range(warmup):
        step()
    ops = ops_per_step(step)
    bare = _fewest(step, times)
    bare_bytecodes = min(count_bytecodes(step)[0] for _ in range(times)) if bytecodes else 0
    rows: dict[str, Any] = {}
    if null_mode is not None:
        with null_mode():
            step()
            c = _fewest(step, times)
        rows["null_dispatch"] = {"calls_per_op": (c.total - bare.total) / ops}
    for mode in modes:
        with memprof.profile(model, optimizer, mode=mode) as prof:
            for _ in range(warmup):
                step()
            c = _fewest(step, times)
            if bytecodes:
                codes = min(count_bytecodes(step) for _ in range(times))
        saves = c.entries["saved.py:pack"] + c.entries["saved_hooks.py:pack"]
        module_calls = c.entries["modules.py:pre_hook"]
        rows[mode] = {
            "calls_per_op": (c.total - bare.total) / ops,
            # The same per step, and the times a step entered memprof's code from outside it (its hooks, the
            # dispatch handler, a weak reference's callback): hook visits, each of which runs at least a frame.
            "calls_per_step": c.total - bare.total,
            "hook_visits_per_step": sum(c.entries.values()),
            "handler_calls_per_op": c.under[HANDLER] / ops,
            "saved_tensors": saves,
            "calls_per_saved_tensor": sum(c.under[e] for e in SAVED_ENTRIES) / saves if saves else 0.0,
            "module_calls": module_calls,
            "calls_per_module_call": (sum(c.under[e] for e in MODULE_ENTRIES) / module_calls
                                      if module_calls else 0.0),
            "frees": c.entries[FREED],
            "by_entry": dict(c.under.most_common()),
            # Which steps' optimizer phases were measured and which carried (exact mode): the counted steps
            # come after the warmup, once the step is known.
            "optimizer_steps": [list(span) for span in prof.trace.optimizer_steps],
        }
        if bytecodes:
            rows[mode]["bytecodes_per_step"] = codes[0] - bare_bytecodes
            rows[mode]["memprof_bytecodes_per_step"] = codes[1]
    return {"ops_per_step": ops, "bare_calls": bare.total, "modes": rows}


def small_gpt() -> Any:
    """overhead.py's GPT at width 32, sequence 16, batch 2 (overhead_breakdown.py's): the same ops and hooks."""
    import overhead_breakdown

    return overhead_breakdown.build(32, 16, 2)


def markdown(result: dict[str, Any], description: str) -> str:
    codes = any("bytecodes_per_step" in row for row in result["modes"].values())
    lines = [f"{description}: {result['ops_per_step']} ops per step, a bare step makes "
             f"{result['bare_calls']} Python calls.", "",
             "| variant | calls per op above bare | memprof's handler per op | per saved tensor | per module call |"
             " calls per step above bare | hook visits per step |"
             + (" bytecodes per step above bare | of them in memprof |" if codes else ""),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if codes else "")]
    for name, row in result["modes"].items():
        if name == "null_dispatch":
            lines.append(f"| do-nothing dispatch mode | {row['calls_per_op']:.2f} | | | | | |"
                         + (" | |" if codes else ""))
        else:
            lines.append(f"| {name} | {row['calls_per_op']:.2f} | {row['handler_calls_per_op']:.2f} | "
                         f"{row['calls_per_saved_tensor']:.2f} | {row['calls_per_module_call']:.2f} | "
                         f"{row['calls_per_step']:,} | {row['hook_visits_per_step']:,} |"
                         + (f" {row['bytecodes_per_step']:,} | {row['memprof_bytecodes_per_step']:,} |"
                            if codes else ""))
    return "\n".join(lines) + "\n"


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="width 32, seq 16, batch 2 (the test's model)")
    ap.add_argument("--modes", default="exact,light", help="comma-separated memprof modes (default exact,light)")
    ap.add_argument("--entries", action="store_true", help="also print the calls under each memprof entry point")
    ap.add_argument("--bytecodes", action="store_true",
                    help="also count the bytecodes a steady step executes above a bare one (slower)")
    ap.add_argument("--json", metavar="PATH", help="write results as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    args = ap.parse_args(argv)

    import torch

    import overhead
    from _machine import command_line, cpu_model, write_results

    wl = small_gpt() if args.small else overhead.build_workload("gpt", torch.device("cpu"), quick=False)
    result = measure(wl.step, wl.model, wl.optimizer, tuple(args.modes.split(",")), overhead.NullDispatchMode,
                     bytecodes=args.bytecodes)
    md = markdown(result, wl.description)
    print(md)
    if args.entries:
        for name, row in result["modes"].items():
            if "by_entry" in row:
                print(name, ", ".join(f"{k} {v}" for k, v in row["by_entry"].items()))
    info = {"cpu": cpu_model(), "torch": torch.__version__, "workload": wl.description,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": command_line(__file__, argv)}
    write_results(args.json, {"machine": info, **result}, args.markdown, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
