"""What light mode's mechanisms cost by themselves: torch's hooks with nothing in them, beside light mode.

Run from the repository root::

    python benchmarks/light_mode_parts.py                  # the benchmark GPT of overhead.py, 20 rounds, ~2 minutes
    python benchmarks/light_mode_parts.py --quick          # a smoke test in seconds
    python benchmarks/light_mode_parts.py --json out.json --markdown out.md
    python benchmarks/light_mode_parts.py --instructions   # also machine instructions per step (valgrind, ~5 min)

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

Two variants frame the others: ``bare_control``, the bare step timed again (an A/A control: how far it strays
from 1.000x is the run's resolution), and ``all_mechanisms``, the three mechanisms together as light mode uses
them (the pair pushed in the outermost module call's pre-hook and popped in its post-hook, a pre- and a
post-hook with keyword arguments on every module, the gradient hook a list's ``append``, as light mode's queue
is). ``all_mechanisms`` is light mode's floor: what any collector built on these hooks pays before it records
anything.

Instructions (``--instructions``, needs Debian's ``valgrind``): a wall-clock ratio resolves about 0.01 of a step
in 20 rounds; the machine instructions a step executes do not move with the load. Each variant runs in a child
process under ``valgrind --tool=callgrind`` on the same GPT at width 32, sequence 16, batch 2 (the same ops,
saves and module calls per step as the full size), counting is switched on only around ``--count-steps``
steady steps (``callgrind_control``), and the figure is the instructions per step above the bare step. It
includes what the bytecode counts of ``overhead_counts.py --bytecodes`` cannot see: torch calling Python for
every saved tensor's pack and unpack and taking the GIL back for each in backward, and the objects made and
freed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import shutil
import statistics
import subprocess
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


def _all_mechanisms(model: torch.nn.Module) -> Callable[[], Any]:
    """Light mode's three mechanisms together, as it uses them, with nothing in them (the module's docstring)."""
    @contextlib.contextmanager
    def hooks() -> Any:
        pair = torch.autograd.graph.saved_tensors_hooks(lambda t: (t if t.is_leaf else t.detach(), t._version),
                                                        lambda p: p[0])
        queue: list[torch.Tensor] = []

        def pre(m: torch.nn.Module, args: Any, kwargs: Any) -> None:
            if m is model:
                pair.__enter__()

        def post(m: torch.nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            if m is model:
                pair.__exit__(None, None, None)

        handles = []
        for m in model.modules():
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
        handles += [p.register_post_accumulate_grad_hook(queue.append) for p in model.parameters() if p.requires_grad]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            queue.clear()
    return hooks


def variants_for(wl: Any) -> dict[str, Callable[[], Any]]:
    return {
        "bare": contextlib.nullcontext,
        "bare_control": contextlib.nullcontext,
        "saved_tensor_hooks_identity": _saved_identity,
        "saved_tensor_hooks_detached": _saved_detached,
        "module_forward_hooks": _module_hooks,
        "grad_hooks": _grad_hooks(wl.model),
        "all_mechanisms": _all_mechanisms(wl.model),
        "memprof_light": lambda: memprof.profile(wl.model, wl.optimizer, mode="light"),
    }


def measure(rounds: int, steps: int, quick: bool) -> dict[str, Any]:
    wl = build_workload("gpt", torch.device("cpu"), quick)
    variants = variants_for(wl)
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


def count_one(variant: str, steps: int) -> None:
    """The child of ``--instructions``: ``steps`` steady steps of ``variant`` with callgrind counting only them."""
    from overhead_breakdown import build

    torch.set_num_threads(1)  # one thread: no spinning worker, so the count is the same run after run
    wl = build(32, 16, 2)
    make = variants_for(wl)[variant]
    for _ in range(2):
        wl.step()
    with make():
        for _ in range(3):  # the profile's first steps (its capture) are not the steady cost
            wl.step()
        pid = str(os.getpid())
        subprocess.run(["callgrind_control", "--instr=on", pid], check=True, stdout=subprocess.DEVNULL)
        for _ in range(steps):
            wl.step()
        subprocess.run(["callgrind_control", "--dump", pid], check=True, stdout=subprocess.DEVNULL)


def instructions(steps: int, out_dir: str) -> dict[str, int]:
    """Machine instructions per steady step of each variant (small GPT, one thread), each in a child under callgrind."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("--instructions needs valgrind (Debian: apt-get install valgrind)")
    os.makedirs(out_dir, exist_ok=True)
    found: dict[str, int] = {}
    for variant in variants_for(build_workload("gpt", torch.device("cpu"), True)):
        if variant == "bare_control":
            continue  # the count is the same run after run: no control needed
        base = os.path.join(out_dir, f"callgrind.{variant}")
        for old in [f for f in os.listdir(out_dir) if f.startswith(os.path.basename(base))]:
            os.remove(os.path.join(out_dir, old))
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={base}",
                        sys.executable, __file__, "--count", variant, "--count-steps", str(steps)],
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(base + ".1") as f:  # the dump after the counted steps
            match = re.search(r"^totals: (\d+)", f.read(), re.MULTILINE)
        if match is None:
            raise SystemExit(f"no totals in {base}.1")
        found[variant] = int(match.group(1)) // steps
    return found


def markdown(res: dict[str, Any]) -> str:
    lines = [f"{res['command']} ({res['date']}; {res['cpu']}, torch {res['torch']}, load average "
             f"{res['load'][0]:.2f} -> {res['load_after'][0]:.2f}; {res['rounds']} rounds x {res['steps']} steps)",
             "", "| variant | wall ms/step | wall (paired median) | wall (best rounds) | CPU (paired median) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for v, f in res["variants"].items():
        lines.append(f"| {v} | {f['wall_ms']:.1f} | {f['wall_ratio']:.3f}x | {f['wall_ratio_best']:.3f}x | "
                     f"{f['cpu_ratio']:.3f}x |")
    counts = res.get("instructions")
    if counts:
        bare = counts["bare"]
        light = counts["memprof_light"] - bare
        lines += ["", f"Machine instructions per steady step, GPT at width 32, sequence 16, batch 2, one thread "
                  f"(callgrind, {res['count_steps']} steps counted):", "",
                  "| variant | instructions per step | above bare | share of light mode's |",
                  "| --- | ---: | ---: | ---: |"]
        for v, n in counts.items():
            lines.append(f"| {v} | {n:,} | {n - bare:,} | {(n - bare) / light:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: "list[str] | None" = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 20; quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="steps per variant and round (default 3; quick 1)")
    ap.add_argument("--quick", action="store_true", help="a tiny model, a smoke test")
    ap.add_argument("--instructions", action="store_true",
                    help="also count machine instructions per step under valgrind (see the module's docstring)")
    ap.add_argument("--count-steps", type=int, default=5, help="steps counted per variant with --instructions")
    ap.add_argument("--count", help=argparse.SUPPRESS)  # the child of --instructions
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", help="write the table here")
    args = ap.parse_args(argv)
    if args.count:
        count_one(args.count, args.count_steps)
        return
    rounds = args.rounds or (2 if args.quick else 20)
    steps = args.steps or (1 if args.quick else 3)
    load = os.getloadavg()
    res = measure(rounds, steps, args.quick)
    res.update(command=command_line(__file__, argv), date=datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC"), cpu=cpu_model(), torch=torch.__version__, load=load, load_after=os.getloadavg(),
        rounds=rounds, steps=steps)
    if args.instructions:
        res["instructions"] = instructions(args.count_steps, os.path.join(_HERE, "..", "build", "callgrind"))
        res["count_steps"] = args.count_steps
    text = markdown(res)
    print(text)
    write_results(args.json, res, args.markdown, text)


if __name__ == "__main__":
    main()
