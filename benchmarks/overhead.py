"""Overhead of memprof against a bare training step and against other memory tools.

Run from the repository root::

    python benchmarks/overhead.py                       # full settings (several minutes on 2 cores)
    python benchmarks/overhead.py --quick               # smoke test, about 15 s
                                                        # (import torch, ~130 ms gc.collect per memprof block)
    python benchmarks/overhead.py --json out.json --markdown out.md

What is measured
----------------
Three workloads, built here (no downloads), each one training step =
forward + loss + backward + optimizer.step() + zero_grad(set_to_none=True)
on a fixed batch made once:

* ``gpt``: decoder-only transformer, 4 layers, width 256, 4 heads, seq 128,
  batch 8, vocab 1000, tied input/output embeddings, AdamW, cross-entropy.
* ``cnn``: 3 x (conv3x3 + BatchNorm + ReLU) [+ max-pool] on 3x32x32, batch 32,
  10 classes, SGD with momentum.
* ``mlp``: 4 Linear layers of width 1024 with ReLU, batch 64, AdamW, MSE.

Variants, each run once in every round, in an order shuffled afresh each round
(see below):

* ``bare``: the step with nothing around it.
* ``memprof_exact``: ``memprof.profile(model, opt, mode="exact")``.
* ``memprof_light``: ``memprof.profile(model, opt, mode="light")``.
* ``memtracker``: torch's private ``torch.distributed._tools.mem_tracker.MemTracker``
  (``mt.track_external(model, opt)`` then ``with mt:``); it raises on the second
  root forward in one context unless ``mt.reset_mod_stats()`` is called after
  each step, so that call is part of its timed step.
* ``torch_profiler``: ``torch.profiler.profile(activities=[CPU(, CUDA)], profile_memory=True)``.
* ``null_dispatch``: a reference, not a tool: a ``TorchDispatchMode`` whose
  ``__torch_dispatch__`` only calls the op. Any exact tracker built on a Python
  dispatch mode (memprof exact, MemTracker) pays at least this.
* ``bare_control``: the bare step again, timed as a variant. Its ratio to
  ``bare`` would be 1.00x on a quiet machine; how far it strays, and the width
  of its interval, is the resolution of this run: a difference between two
  variants smaller than that is not resolved.

Timing choice: in each round every variant creates a fresh tool, enters its
context *outside* the timed region, times ``--steps`` consecutive steps inside
the context, then exits (and, for memprof, builds the report) outside the
timed region. This is how a user profiles a run of many steps: one context
around the loop. The per-step ratio therefore excludes the one-off enter/exit
cost, which is reported separately (``enter_exit_ms``: median wall time of
entering + leaving the context + building the report / key_averages, per
round). Ratios are ``median(round time of variant) / median(round time of bare)``
over ``--rounds`` rounds (15) after one warm-up round of every variant; the
paired ratio is the median over rounds of ``variant / bare`` within each
round, and the best-rounds ratio ``min(variant) / min(bare)``. The order of the
variants is shuffled in every round (seeded, so a run can be repeated), so that
no variant always follows the same one. Beside each paired ratio is its 95 %
interval (``paired_ratio_ci95``): the 2.5th and 97.5th percentiles of the
median over 2,000 resamples of the rounds (a percentile bootstrap, seeded).

Python calls: for each workload on the CPU, the Python function calls per
dispatched op that exact and light mode add to a steady step, and those of the
do-nothing dispatch mode (``overhead_counts.py``; ``--no-counts`` skips them).
Unlike the ratios, these do not move with the load on the machine.

Memory of memprof itself: a 100-step exact-mode run of the MLP workload
(shrunk under ``--quick``) with tracemalloc: Python heap retained by the
profiler = snapshot after the report is built and the profiler object dropped
minus the snapshot taken before the profiler was created (model, optimizer
and batch exist in both). Also: tracemalloc's peak during the run, the size
of ``json.dumps(prof.trace.to_dict())``, and whether the model, its
parameters and the batch die (weakrefs) after ``del model, optimizer, batch``
while the report is still alive, both by reference counting alone and after
``gc.collect()``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from _machine import command_line, cpu_model, write_results  # benchmarks run as scripts from this folder

# Silence kineto's per-session "profiler_start/stop" lines (must precede importing torch).
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

try:
    import memprof
except ImportError:  # running from a checkout without installation
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import memprof

VARIANTS = ("bare", "memprof_exact", "memprof_light", "memprof_paused", "memtracker", "torch_profiler",
            "null_dispatch", "bare_control")
WORKLOADS = ("gpt", "cnn", "mlp")


# ---------------------------------------------------------------------------- workloads


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        h = self.heads
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def _cnn(channels: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = []
    c_in = 3
    for i, c in enumerate(channels):
        layers += [nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        if i < len(channels) - 1:
            layers.append(nn.MaxPool2d(2))
        c_in = c
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, 10)]
    return nn.Sequential(*layers)


def _mlp(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@dataclass
class Workload:
    name: str
    description: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, ...]
    loss_fn: Callable[..., torch.Tensor]

    def step(self) -> None:
        inp, target = self.batch
        out = self.model(inp)
        loss = self.loss_fn(out, target)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _gpt_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def build_workload(name: str, device: torch.device, quick: bool) -> Workload:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "gpt":
        vocab, d, layers, heads, seq, batch = (1000, 256, 4, 4, 128, 8) if not quick else (100, 32, 2, 2, 16, 2)
        model = GPT(vocab, d, layers, heads, seq).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        data = (idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device))
        desc = (f"GPT {layers} layers, d={d}, {heads} heads, seq {seq}, batch {batch}, vocab {vocab}, "
                "tied embeddings, AdamW, cross-entropy")
        return Workload(name, desc, model, opt, data, _gpt_loss)
    if name == "cnn":
        channels, batch, hw = ((32, 64, 128), 32, 32) if not quick else ((8, 16, 16), 4, 16)
        model = _cnn(channels).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(batch, 3, hw, hw, generator=g).to(device)
        y = torch.randint(0, 10, (batch,), generator=g).to(device)
        desc = (f"CNN 3x(conv3x3+BN+ReLU) channels {channels}, input 3x{hw}x{hw}, batch {batch}, "
                "SGD momentum 0.9, cross-entropy")
        return Workload(name, desc, model, opt, (x, y), F.cross_entropy)
    if name == "mlp":
        width, depth, batch = (1024, 4, 64) if not quick else (64, 4, 8)
        model = _mlp(width, depth).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(batch, width, generator=g).to(device)
        y = torch.randn(batch, width, generator=g).to(device)
        desc = f"MLP {depth}x Linear({width},{width}) + ReLU, batch {batch}, AdamW, MSE"
        return Workload(name, desc, model, opt, (x, y), F.mse_loss)
    raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


# ---------------------------------------------------------------------------- variants


class NullDispatchMode(TorchDispatchMode):
    """The floor of any Python dispatch-mode tracker: sees every op, does nothing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        return func(*args, **(kwargs or {}))


def median_interval(values: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """95 % percentile-bootstrap interval of the median of ``values`` (seeded: the same values give the same
    interval). Rounds are independent draws of a noisy machine; the interval says how far their median could
    move with other draws, which a single median hides."""
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(variant: str, wl: Workload, steps: int, device: torch.device) -> tuple[float, float]:
    """Run ``steps`` steps under ``variant``; return (timed steps seconds, enter+exit seconds)."""
    model, opt = wl.model, wl.optimizer
    t_setup0 = time.perf_counter()
    if variant in ("bare", "bare_control"):
        ctx: Any = None
    elif variant == "memprof_exact":
        ctx = memprof.profile(model, opt, mode="exact")
    elif variant == "memprof_light":
        ctx = memprof.profile(model, opt, mode="light")
    elif variant == "memprof_paused":
        # Exact mode with a schedule whose window never comes: what a step outside the window costs.
        ctx = memprof.profile(model, opt, mode="exact", schedule=memprof.schedule(skip_first=10**9))
    elif variant == "memtracker":
        from torch.distributed._tools.mem_tracker import MemTracker

        ctx = MemTracker()
        ctx.track_external(model, opt)
    elif variant == "torch_profiler":
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
        ctx = profile(activities=acts, profile_memory=True)
    elif variant == "null_dispatch":
        ctx = NullDispatchMode()
    else:
        raise ValueError(variant)
    if ctx is not None:
        ctx.__enter__()
    _sync(device)
    t_enter = time.perf_counter() - t_setup0
    try:
        t0 = time.perf_counter()
        if variant == "memtracker":
            # MemTracker refuses a second root forward in one context unless the
            # per-module stats are reset; this is its documented multi-step use.
            for _ in range(steps):
                wl.step()
                ctx.reset_mod_stats()
        else:
            for _ in range(steps):
                wl.step()
        _sync(device)
        timed = time.perf_counter() - t0
    finally:
        t1 = time.perf_counter()
        if ctx is not None:
            ctx.__exit__(None, None, None)
            # Building the result a user reads is part of the one-off cost.
            if variant.startswith("memprof"):
                ctx.report()
            elif variant == "torch_profiler":
                ctx.key_averages()
        t_exit = time.perf_counter() - t1
    return timed, t_enter + t_exit


def bench_workload(name: str, device: torch.device, rounds: int, steps: int, quick: bool,
                   variants: tuple[str, ...], collect: bool = True) -> dict[str, Any]:
    wl = build_workload(name, device, quick)
    n_params = sum(p.numel() for p in {id(p): p for p in wl.model.parameters()}.values())
    # Warm-up: optimizer state created, caches and one-off imports done, every variant once.
    for _ in range(2):
        wl.step()
    for v in variants:
        run_variant(v, wl, steps, device)
    times: dict[str, list[float]] = {v: [] for v in variants}
    once: dict[str, list[float]] = {v: [] for v in variants}
    rng = random.Random(f"{name}-{device}")  # the same orders each time the same run is made
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            if collect:  # every variant starts from the same clean heap (memprof collects on enter anyway)
                gc.collect()
            t, o = run_variant(v, wl, steps, device)
            times[v].append(t)
            once[v].append(o)
    bare_med = statistics.median(times["bare"]) if "bare" in times else float("nan")
    out: dict[str, Any] = {
        "workload": name,
        "device": str(device),
        "description": wl.description,
        "parameters": n_params,
        "rounds": rounds,
        "steps_per_round": steps,
        "variants": {},
    }
    for v in variants:
        med = statistics.median(times[v])
        paired = [t / b for t, b in zip(times[v], times["bare"])]
        out["variants"][v] = {
            "median_round_s": med,
            "median_step_ms": med / steps * 1e3,
            "min_round_s": min(times[v]),
            "max_round_s": max(times[v]),
            "ratio_to_bare": med / bare_med,
            "ratio_of_best_rounds": min(times[v]) / min(times["bare"]),
            # Each round's variant against the bare run of the same round: a drift of the machine's
            # speed over the minutes of the run (seen here as +-25 %) cancels within a round.
            "paired_ratio": statistics.median(paired),
            "paired_ratio_ci95": median_interval(paired),
            "enter_exit_ms": statistics.median(once[v]) * 1e3,
            "round_times_s": times[v],
        }
    del wl
    gc.collect()
    return out


# ---------------------------------------------------------------------------- one profiling block


def session_cost(rounds: int, quick: bool) -> dict[str, Any]:
    """Entering and leaving an empty profiling block (and building its report), against one bare step
    of the demo's TinyGPT (its default sizes: batch 8, sequence 128, 4 layers, hidden 256)."""
    from memprof.demo import TinyGPT, synthetic_tokens

    torch.manual_seed(0)
    model = TinyGPT(vocab=1000, hidden=64 if quick else 256, layers=1 if quick else 4, heads=4, max_seq=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = synthetic_tokens(8, 32 if quick else 128, 1000, seed=0)

    def step() -> None:
        TinyGPT.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    step()
    step()
    bare, empty = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        bare.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with memprof.profile(model, opt) as prof:
            pass
        prof.report()
        empty.append(time.perf_counter() - t0)
    b, e = statistics.median(bare), statistics.median(empty)
    return {"bare_step_ms": b * 1e3, "empty_block_ms": e * 1e3, "ratio": e / b, "rounds": rounds}


def markdown_session(s: dict[str, Any]) -> str:
    return ("| empty profiling block (enter, exit, report) | bare TinyGPT step (demo sizes) | ratio |\n"
            "| ---: | ---: | ---: |\n"
            f"| {s['empty_block_ms']:.1f} ms | {s['bare_step_ms']:.1f} ms | {100 * s['ratio']:.1f} % |\n")


# ---------------------------------------------------------------------------- Python calls per op


def python_calls(workloads: list[str], quick: bool) -> dict[str, Any]:
    """Each CPU workload's Python calls per dispatched op above a bare step (overhead_counts.py): the figure
    beside the wall clock that load on the machine cannot move."""
    import overhead_counts

    out = {}
    for name in workloads:
        wl = build_workload(name, torch.device("cpu"), quick)
        out[name] = overhead_counts.measure(wl.step, wl.model, wl.optimizer, ("exact", "light"), NullDispatchMode,
                                            warmup=1 if quick else 2, times=1 if quick else 3)
        del wl
        gc.collect()
    return out


def markdown_counts(counts: dict[str, Any]) -> str:
    lines = ["Python calls per dispatched op above a bare step (CPU; `sys.setprofile` call events, "
             "benchmarks/overhead_counts.py):", "",
             "| workload | ops/step | do-nothing dispatch mode | exact | light | exact per saved tensor | "
             "exact per module call |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, c in counts.items():
        m = c["modes"]
        lines.append(f"| {name} | {c['ops_per_step']} | {m['null_dispatch']['calls_per_op']:.2f} | "
                     f"{m['exact']['calls_per_op']:.2f} | {m['light']['calls_per_op']:.2f} | "
                     f"{m['exact']['calls_per_saved_tensor']:.2f} | {m['exact']['calls_per_module_call']:.2f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- memory of memprof


def memprof_memory(steps: int, quick: bool) -> dict[str, Any]:
    device = torch.device("cpu")

    def retained_after(n_steps: int) -> tuple[int, int, "memprof.Report", Workload, int]:
        wl = build_workload("mlp", device, quick)
        for _ in range(2):
            wl.step()
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        tracemalloc.reset_peak()
        base_cur, _ = tracemalloc.get_traced_memory()
        prof = memprof.profile(wl.model, wl.optimizer, mode="exact")
        with prof:
            for _ in range(n_steps):
                wl.step()
        report = prof.report()
        json_bytes = len(json.dumps(prof.trace.to_dict()))
        del prof
        gc.collect()
        _, peak = tracemalloc.get_traced_memory()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        filters = [tracemalloc.Filter(False, tracemalloc.__file__)]
        diff = after.filter_traces(filters).compare_to(before.filter_traces(filters), "filename")
        retained = sum(s.size_diff for s in diff)
        return retained, peak - base_cur, report, wl, json_bytes

    small_steps = max(1, steps // 10)
    retained_small, _, rep_small, wl_small, json_small = retained_after(small_steps)
    del rep_small, wl_small
    gc.collect()
    retained, peak, report, wl, json_bytes = retained_after(steps)

    # Does the report keep the user's objects alive?
    model, optimizer, batch = wl.model, wl.optimizer, wl.batch
    refs = {
        "model": weakref.ref(model),
        "parameter": weakref.ref(next(model.parameters())),
        "optimizer": weakref.ref(optimizer),
        "batch_input": weakref.ref(batch[0]),
        "batch_target": weakref.ref(batch[1]),
    }
    del wl, model, optimizer, batch
    freed_refcount = {k: r() is None for k, r in refs.items()}
    gc.collect()
    freed_gc = {k: r() is None for k, r in refs.items()}
    assert report.peak.total is not None  # the report is still alive and readable
    n_steps_in_trace = len(report.trace.steps) if hasattr(report, "trace") else None
    return {
        "workload": "mlp (cpu, exact mode, timeline on)",
        "steps": steps,
        "steps_recorded": n_steps_in_trace,
        "python_heap_retained_bytes": retained,
        f"python_heap_retained_bytes_at_{small_steps}_steps": retained_small,
        "python_heap_per_step_bytes": ((retained - retained_small) / (steps - small_steps)
                                       if steps > small_steps else None),
        "python_heap_peak_during_run_bytes": peak,
        "trace_json_bytes": json_bytes,
        f"trace_json_bytes_at_{small_steps}_steps": json_small,
        "freed_by_refcount_after_del": freed_refcount,
        "freed_after_gc_collect": freed_gc,
        "all_freed_by_refcount": all(freed_refcount.values()),
        "all_freed_after_gc": all(freed_gc.values()),
    }


# ---------------------------------------------------------------------------- output


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def markdown_table(results: list[dict[str, Any]], variants: tuple[str, ...]) -> str:
    others = [v for v in variants if v != "bare"]
    # (title, key per variant, cell format); the first table also shows the bare step's time.
    tables = [
        (None, "ratio_to_bare", "{:.2f}x"),
        ("Same, median over rounds of (variant / bare of the same round), insensitive to slow drift, with its "
         "95 % interval (bootstrap over rounds; `bare_control`, the bare step timed again, shows the run's "
         "resolution):", "paired_ratio", "{:.2f}x"),
        ("Same, ratio of the best (fastest) rounds, min(variant) / min(bare), less sensitive to other load:",
         "ratio_of_best_rounds", "{:.2f}x"),
        ("One-off cost per profiling block (enter + exit + building the report / key_averages), median ms:",
         "enter_exit_ms", "{:.1f}"),
    ]
    lines: list[str] = []
    for title, key, fmt in tables:
        with_bare = title is None
        if title is not None:
            lines += ["", title, ""]
        lines.append("| workload | device | " + ("bare ms/step | " if with_bare else "") + " | ".join(others) + " |")
        lines.append("| --- | --- | " + ("---: | " if with_bare else "") + " | ".join("---:" for _ in others) + " |")
        for r in results:
            vs = r["variants"]
            bare = f"{vs['bare']['median_step_ms']:.2f} | " if with_bare else ""
            cells = [fmt.format(vs[v][key]) + (" [{:.2f}, {:.2f}]".format(*vs[v]["paired_ratio_ci95"])
                                                if key == "paired_ratio" else "") for v in others]
            lines.append(f"| {r['workload']} | {r['device']} | " + bare + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_memory(mem: dict[str, Any]) -> str:
    small = [k for k in mem if k.startswith("python_heap_retained_bytes_at_")][0]
    small_json = [k for k in mem if k.startswith("trace_json_bytes_at_")][0]
    return "\n".join([
        f"Memory of memprof itself ({mem['workload']}, {mem['steps']} steps):",
        "",
        "| figure | value |",
        "| --- | ---: |",
        f"| Python heap retained by the report (tracemalloc) | {_fmt_bytes(mem['python_heap_retained_bytes'])} |",
        f"| same, after {small.rsplit('_', 2)[-2]} steps | {_fmt_bytes(mem[small])} |",
        f"| growth per step | {_fmt_bytes(mem['python_heap_per_step_bytes'] or 0)} |",
        f"| Python heap peak during the run (tracemalloc, incl. the step's own Python objects) | "
        f"{_fmt_bytes(mem['python_heap_peak_during_run_bytes'])} |",
        f"| `json.dumps(prof.trace.to_dict())` | {_fmt_bytes(mem['trace_json_bytes'])} |",
        f"| same, after {small_json.rsplit('_', 2)[-2]} steps | {_fmt_bytes(mem[small_json])} |",
        f"| model, parameter, optimizer, batch freed by `del` alone (report alive) | {mem['all_freed_by_refcount']} "
        f"{'' if mem['all_freed_by_refcount'] else mem['freed_by_refcount_after_del']} |",
        f"| ... freed after `gc.collect()` | {mem['all_freed_after_gc']} "
        f"{'' if mem['all_freed_after_gc'] else mem['freed_after_gc_collect']} |",
        "",
    ])


def _cpu_jiffies() -> "tuple[int, int] | None":
    """(busy jiffies of the whole machine, jiffies of this process), Linux only."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # minus idle and iowait
        with open("/proc/self/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()
        own = int(st[11]) + int(st[12])  # utime + stime (all threads)
        return busy, own
    except (OSError, ValueError, IndexError):
        return None


def machine_info(threads: int) -> dict[str, Any]:
    cpu = cpu_model()
    info = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "memprof": memprof.__version__,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


# ---------------------------------------------------------------------------- main


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per workload (default 15; quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per round (default 5; quick 1)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of gpt,cnn,mlp")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list; bare is always included")
    ap.add_argument("--devices", default="auto", help="auto (cpu, and cuda when available), cpu, cuda")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--memory-steps", type=int, default=None, help="steps of the memory run (default 100; quick 20)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory-of-memprof measurement")
    ap.add_argument("--no-counts", action="store_true", help="skip the Python calls per op (overhead_counts.py)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test in a few seconds")
    ap.add_argument("--json", metavar="PATH", help="write results as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    args = ap.parse_args(argv)

    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 15)
    steps = args.steps if args.steps is not None else (1 if args.quick else 5)
    mem_steps = args.memory_steps if args.memory_steps is not None else (20 if args.quick else 100)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    if "bare" not in variants:
        variants = ("bare",) + variants
    torch.set_num_threads(args.threads)

    devices: list[torch.device] = []
    if args.devices in ("auto", "cpu"):
        devices.append(torch.device("cpu"))
    if args.devices in ("auto", "cuda"):
        if torch.cuda.is_available():
            devices.append(torch.device("cuda"))
        else:
            print("CUDA not available: CUDA workloads skipped", file=sys.stderr)

    info = machine_info(args.threads)
    info["command"] = command_line(__file__, argv)
    print(f"# {info['cpu']}, torch {info['torch']}, {args.threads} threads; "
          f"{rounds} rounds x {steps} steps; variants {', '.join(variants)}", flush=True)

    j0, w0 = _cpu_jiffies(), time.perf_counter()
    results = []
    for dev in devices:
        for w in workloads:
            t0 = time.perf_counter()
            r = bench_workload(w, dev, rounds, steps, args.quick, variants, collect=not args.quick)
            results.append(r)
            vs = r["variants"]
            print(f"{w:4s} {dev.type:4s} bare {vs['bare']['median_step_ms']:8.2f} ms/step  " + "  ".join(
                f"{v} {vs[v]['ratio_to_bare']:.2f}x" for v in variants if v != "bare")
                + f"   ({time.perf_counter() - t0:.0f} s)", flush=True)

    j1, w1 = _cpu_jiffies(), time.perf_counter()
    if j0 is not None and j1 is not None:
        hz = os.sysconf("SC_CLK_TCK")
        others = max(0, (j1[0] - j0[0]) - (j1[1] - j0[1])) / hz / (w1 - w0)
        info["other_processes_cpu_cores_during_timing"] = round(others, 2)
        print(f"# other processes used on average {others:.2f} CPU cores during the timed part", flush=True)

    counts = None if args.no_counts else python_calls(workloads, args.quick)
    if counts is not None:
        print(markdown_counts(counts))

    session = session_cost(3 if args.quick else 9, args.quick)
    print(markdown_session(session))

    mem = None
    if not args.no_memory:
        mem = memprof_memory(mem_steps, args.quick)
        print(markdown_memory(mem))

    md = markdown_table(results, variants) + "\n" + markdown_session(session)
    if counts is not None:
        md += "\n" + markdown_counts(counts)
    print()
    print(md)
    if mem is not None:
        md += "\n" + markdown_memory(mem)
    write_results(args.json, {"machine": info, "results": results, "session": session, "memprof_memory": mem,
                              "python_calls": counts},
                  args.markdown, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
