"""What light mode's mechanisms cost by themselves: torch's hooks with nothing in them, beside light mode.

Run from the repository root::

    python benchmarks/light_mode_parts.py                  # the benchmark GPT of overhead.py, 20 rounds, ~2 minutes
    python benchmarks/light_mode_parts.py --quick          # a smoke test in seconds
    python benchmarks/light_mode_parts.py --json out.json --markdown out.md

What is timed
-------------
Light mode needs three of torch's hook mechanisms: saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``:
autograd calls Python to pack every tensor it saves and to unpack it in backward), global module forward hooks
(``register_module_forward_pre_hook`` / ``register_module_forward_hook``: every module call takes torch's slower
path through ``Module._call_impl``) and a post-accumulate-grad hook on every parameter. Each variant below runs
one of them with hooks that do nothing (or, for the saved tensors, only what any such hook must: a detached
alias and the version, as light mode keeps them), so that what light mode costs above them is memprof's own
work. Rounds run every variant in an order that alternates (forward, then reversed), ``--steps`` steps each
after a warm-up, and each variant's figure is the median over rounds of its time over the bare step's of the
same round (paired), in wall time and in this process's CPU time (``time.process_time``: both of torch's
threads, less sensitive to other processes).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time
from typing import Any, Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from _machine import command_line, cpu_model, import_memprof, write_results  # noqa: E402

memprof = import_memprof()
import torch  # noqa: E402

from overhead import build_workload  # noqa: E402


@contextlib.contextmanager
def _saved_identity() -> Any:
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        yield


@contextlib.contextmanager
def _saved_detached() -> Any:
    # What a pack hook that must not close a reference cycle keeps: a detached alias and the version.
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (t.detach(), t._version), lambda p: p[0]):
        yield


@contextlib.contextmanager
def _module_hooks() -> Any:
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    handles = [register_module_forward_pre_hook(lambda m, a: None),
               register_module_forward_hook(lambda m, a, o: None)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _grad_hooks(model: torch.nn.Module) -> Callable[[], Any]:
    @contextlib.contextmanager
    def hooks() -> Any:
        handles = [p.register_post_accumulate_grad_hook(lambda p: None)
                   for p in model.parameters() if p.requires_grad]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
    return hooks


def measure(rounds: int, steps: int, quick: bool) -> dict[str, Any]:
    wl = build_workload("gpt", torch.device("cpu"), quick)
    variants: dict[str, Callable[[], Any]] = {
        "bare": contextlib.nullcontext,
        "saved_tensor_hooks_identity": _saved_identity,
        "saved_tensor_hooks_detached": _saved_detached,
        "module_forward_hooks": _module_hooks,
        "grad_hooks": _grad_hooks(wl.model),
        "memprof_light": lambda: memprof.profile(wl.model, wl.optimizer, mode="light"),
    }
    for _ in range(2):  # optimizer state made, one-off imports done, every variant once
        for make in variants.values():
            with make():
                wl.step()
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            with variants[v]():
                t, c = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    wl.step()
                wall[v].append((time.perf_counter() - t) / steps)
                cpu[v].append((time.process_time() - c) / steps)
    out: dict[str, Any] = {"variants": {}}
    for v in variants:
        out["variants"][v] = {
            "wall_ms": statistics.median(wall[v]) * 1e3,
            "cpu_ms": statistics.median(cpu[v]) * 1e3,
            "wall_ratio": statistics.median(a / b for a, b in zip(wall[v], wall["bare"])),
            "cpu_ratio": statistics.median(a / b for a, b in zip(cpu[v], cpu["bare"])),
            "wall_ratio_best": min(wall[v]) / min(wall["bare"]),
        }
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = [f"{res['command']} ({res['date']}; {res['cpu']}, torch {res['torch']}, load average "
             f"{res['load'][0]:.2f} -> {res['load_after'][0]:.2f}; {res['rounds']} rounds x {res['steps']} steps)",
             "", "| variant | wall ms/step | wall (paired median) | wall (best rounds) | CPU (paired median) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for v, f in res["variants"].items():
        lines.append(f"| {v} | {f['wall_ms']:.1f} | {f['wall_ratio']:.3f}x | {f['wall_ratio_best']:.3f}x | "
                     f"{f['cpu_ratio']:.3f}x |")
    return "\n".join(lines) + "\n"


def main(argv: "list[str] | None" = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 20; quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="steps per variant and round (default 3; quick 1)")
    ap.add_argument("--quick", action="store_true", help="a tiny model, a smoke test")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", help="write the table here")
    args = ap.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 20)
    steps = args.steps or (1 if args.quick else 3)
    load = os.getloadavg()
    res = measure(rounds, steps, args.quick)
    res.update(command=command_line(__file__, argv), date=datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC"), cpu=cpu_model(), torch=torch.__version__, load=load, load_after=os.getloadavg(),
        rounds=rounds, steps=steps)
    text = markdown(res)
    print(text)
    write_results(args.json, res, args.markdown, text)


if __name__ == "__main__":
    main()
