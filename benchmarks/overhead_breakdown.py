"""Where exact mode's time goes: ablations of memprof's mechanisms on the GPT workload's module tree.

Run from the repository root::

    python benchmarks/overhead_breakdown.py                  # about 1 minute on 2 cores
    python benchmarks/overhead_breakdown.py --quick          # smoke test
    python benchmarks/overhead_breakdown.py --json out.json --markdown out.md

What is measured
----------------
The model of ``overhead.py``'s ``gpt`` workload (4 layers, 4 heads, tied
embeddings, AdamW, cross-entropy) at width 32, sequence 16, batch 2, on one
thread. It runs the same ops and hooks per step as the full-size workload
(the counts are printed), but each op is tiny, so a step's time is mostly
per-op and per-hook Python work: the absolute overhead in ms per step is
then stable to a few tenths of a millisecond, which the full-size step
(150 ms, +-5 % noise on a shared machine) cannot resolve.

Variants, interleaved in every round, each timing ``--steps`` steps inside a
fresh context (enter and exit outside the timed region):

* ``bare``, ``null_dispatch`` (a dispatch mode that only calls the op: the
  floor of any Python dispatch-mode tracker), ``light``, ``exact``;
* ``exact`` with one mechanism removed: ``no_backward_module_hooks`` (no
  per-module backward frames), ``no_op_handler`` (memprof's dispatch handler
  replaced by the do-nothing one), ``no_saved_tensor_hooks``, and all three
  removed (``hooks_only``: module, gradient and optimizer hooks on top of the
  floor).

The ablations patch memprof's internals for timing only: what a profile
records under them is not meaningful and is not read. The cost of a
mechanism is ``exact`` minus the variant without it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import statistics
import sys
import time
from typing import Any

from _machine import command_line, cpu_model, write_results  # benchmarks run as scripts from this folder

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import overhead  # the workload's model and loss, and memprof itself

memprof = overhead.memprof
from memprof.collect.saved_hooks import SavedHooks  # noqa: E402  (after overhead, which puts memprof on the path)
from memprof.collect.dispatch import StorageTracker  # noqa: E402

VARIANTS = ("bare", "null_dispatch", "light", "exact", "no_backward_module_hooks", "no_op_handler",
            "no_saved_tensor_hooks", "hooks_only")


class _DoNothingHandler(overhead.NullDispatchMode):
    """overhead.py's do-nothing mode, constructible as memprof constructs its handler (with the profiler)."""

    def __init__(self, prof: Any = None) -> None:
        super().__init__()


def build(width: int, seq: int, batch: int) -> overhead.Workload:
    torch.manual_seed(0)
    vocab, layers, heads = 100, 4, 4
    model = overhead.GPT(vocab, width, layers, heads, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    return overhead.Workload("gpt-small", f"GPT {layers} layers, d={width}, seq {seq}, batch {batch}", model,
                             opt, (idx[:, :-1].contiguous(), idx[:, 1:].contiguous()), overhead._gpt_loss)


@contextlib.contextmanager
def _ablated(variant: str):
    """Patch memprof's mechanisms off for one variant; restore them afterwards."""
    real_install = StorageTracker.install
    real_cover = SavedHooks.cover
    try:
        if variant in ("no_op_handler", "hooks_only"):
            def install(self: Any) -> None:  # the do-nothing mode in place of memprof's handler
                self.mode = _DoNothingHandler()
                self.mode.__enter__()

            StorageTracker.install = install  # type: ignore[method-assign]
        if variant in ("no_saved_tensor_hooks", "hooks_only"):
            SavedHooks.cover = lambda self: False  # memprof never pushes its saved-tensor pair
        yield
    finally:
        StorageTracker.install = real_install  # type: ignore[method-assign]
        SavedHooks.cover = real_cover


def run_variant(variant: str, wl: overhead.Workload, steps: int) -> float:
    with _ablated(variant):
        if variant == "bare":
            ctx: Any = None
        elif variant == "null_dispatch":
            ctx = _DoNothingHandler()
        else:
            ctx = memprof.profile(wl.model, wl.optimizer, mode="light" if variant == "light" else "exact")
        if ctx is not None:
            ctx.__enter__()
        if variant in ("no_backward_module_hooks", "hooks_only"):
            ctx.run.backward_frames = False  # the run's switch the module hooks read (memprof/collect/state.py)
        try:
            t0 = time.perf_counter()
            for _ in range(steps):
                wl.step()
            return (time.perf_counter() - t0) / steps
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)


def count_dispatches(wl: overhead.Workload) -> dict[str, int]:
    """Ops a dispatch mode sees in one step, by where they run."""
    where = ["forward"]
    seen: collections.Counter[str] = collections.Counter()

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            seen[where[0]] += 1
            return func(*args, **(kwargs or {}))

    inp, target = wl.batch
    with Counter():
        loss = wl.loss_fn(wl.model(inp), target)
        where[0] = "backward"
        loss.backward()
        where[0] = "optimizer"
        wl.optimizer.step()
        wl.optimizer.zero_grad(set_to_none=True)
    return dict(seen)


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15; quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="steps per round (default 10; quick 2)")
    ap.add_argument("--width", type=int, default=32, help="model width (default 32)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--quick", action="store_true", help="a smoke test in a few seconds")
    ap.add_argument("--json", metavar="PATH", help="write results as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    args = ap.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 15)
    steps = args.steps if args.steps is not None else (2 if args.quick else 10)
    torch.set_num_threads(args.threads)

    wl = build(args.width, 16, 2)
    for _ in range(3):
        wl.step()
    counts = count_dispatches(wl)
    for v in VARIANTS:  # warm-up
        run_variant(v, wl, 2)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v in VARIANTS:
            times[v].append(run_variant(v, wl, steps))
    bare_med, bare_min = statistics.median(times["bare"]), min(times["bare"])
    rows = {v: {"median_step_ms": statistics.median(times[v]) * 1e3,
                "overhead_ms": (statistics.median(times[v]) - bare_med) * 1e3,
                "overhead_ms_best_rounds": (min(times[v]) - bare_min) * 1e3,
                "round_step_times_s": times[v]} for v in VARIANTS}
    exact = rows["exact"]["overhead_ms"]
    costs = {
        "Python dispatch itself (the do-nothing mode)": rows["null_dispatch"]["overhead_ms"],
        "memprof's op handler": exact - rows["no_op_handler"]["overhead_ms"],
        "saved-tensor hooks": exact - rows["no_saved_tensor_hooks"]["overhead_ms"],
        "per-module backward hooks": exact - rows["no_backward_module_hooks"]["overhead_ms"],
        "module, gradient and optimizer hooks": (rows["hooks_only"]["overhead_ms"]
                                                 - rows["null_dispatch"]["overhead_ms"]),
    }
    info = {"cpu": cpu_model(), "torch": torch.__version__, "threads": args.threads,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": command_line(__file__, argv),
            "workload": wl.description, "rounds": rounds, "steps_per_round": steps,
            "dispatched_ops_per_step": counts}

    lines = [f"{wl.description}, {args.threads} thread(s); {rounds} rounds x {steps} steps; bare step "
             f"{rows['bare']['median_step_ms']:.2f} ms. Ops a dispatch mode sees per step: "
             + ", ".join(f"{k} {n}" for k, n in counts.items()) + f" ({sum(counts.values())} in all).", "",
             "| variant | overhead ms/step (median) | (best rounds) |", "| --- | ---: | ---: |"]
    lines += [f"| {v} | {rows[v]['overhead_ms']:.2f} | {rows[v]['overhead_ms_best_rounds']:.2f} |"
              for v in VARIANTS if v != "bare"]
    lines += ["", "| cost | ms/step | share of exact's overhead |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {c:.2f} | {c / exact:.0%} |" for k, c in costs.items()]
    md = "\n".join(lines) + "\n"
    print(md)
    write_results(args.json, {"machine": info, "variants": rows, "costs_ms": costs}, args.markdown, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
