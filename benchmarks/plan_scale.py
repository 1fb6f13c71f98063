"""How long do ``memprof estimate --hf`` and ``memprof plan`` take for Llama-3-8B, and what do they answer?

Run from the repository root::

    python benchmarks/plan_scale.py --json benchmarks/results/plan-llama3-8b.json
    python benchmarks/plan_scale.py --quick --json /tmp/plan.json     # a tiny config, a smoke test

What is measured
----------------
A Llama-3-8B ``config.json`` is written to a temporary folder (hidden 4096, FFN 14336, 32 layers, 32 heads,
8 key/value heads, vocab 128256, untied embeddings: 8,030,261,248 parameters; no download), then the two
commands run as a user runs them, each in its own process, timed from the outside:

* ``memprof estimate --hf DIR --seq-len 4096 --batch-size 1 --precision mixed --json``: the weights at the peak
  must be the fp32 master weights, 4 B x 8,030,261,248;
* ``memprof plan --hf DIR --seq-len 4096 --gpu h100-80gb --world-size 8 --json``: every row of the grid
  (DDP, FSDP, ZeRO 1-3 x bf16, mixed x checkpointing off, on), each answer confirmed by simulation.

Each command's wall clock, its CPU time (user + system, from the kernel's accounting of the finished child) and
the load average around it are printed and written: on a shared machine the CPU time is the figure to compare.
The grid's consistency is checked and printed: checkpointing never lowers the largest batch, FSDP and the ZeRO
stages never fit fewer samples than DDP, ZeRO-3 >= ZeRO-2 >= ZeRO-1, every row confirmed.
``--layouts`` is passed to the plan (``--layouts all`` adds the tensor-parallel layouts).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 tie_word_embeddings=False, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                 torch_dtype="bfloat16")
PARAMETERS = 8_030_261_248
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
            max_position_embeddings=8192)


def _cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _memprof(args: list[str]) -> tuple[dict, object]:
    """The command's output (JSON) and its timing: wall and CPU seconds, the 1-minute load before and after."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    load_before, cpu_before = os.getloadavg()[0], _cpu()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memprof", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    timing = {"wall_seconds": round(time.perf_counter() - start, 1), "cpu_seconds": round(_cpu() - cpu_before, 1),
              "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise SystemExit(f"memprof {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return timing, json.loads(proc.stdout)


def _said(timing: dict) -> str:
    return (f"{timing['wall_seconds']:.1f} s wall, {timing['cpu_seconds']:.1f} s CPU (user + system), load "
            f"{timing['load_before']:.2f} -> {timing['load_after']:.2f} on {os.cpu_count()} CPUs")


def consistency(rows: list) -> list[str]:
    """What is inconsistent in the grid (empty when nothing): checkpointing lowering a largest batch, a sharded
    layout fitting fewer samples than DDP or a lower ZeRO stage, a row not confirmed."""
    best = {(r["parallel"], r["precision"], r["checkpointing"]): r["max_batch_size"] for r in rows}
    wrong = [f"{r['parallel']} {r['precision']} ckpt {r['checkpointing']}: not confirmed" for r in rows
             if not r["verified"]]
    for (layout, precision, ckpt), b in best.items():
        if ckpt and best.get((layout, precision, False), 0) > b:
            wrong.append(f"{layout} {precision}: checkpointing lowers the largest batch")
        order = ("ddp", "zero1", "zero2", "zero3")
        if layout in order[1:]:
            below = order[order.index(layout) - 1]
            if best.get((below, precision, ckpt), 0) > b:
                wrong.append(f"{layout} {precision} ckpt {ckpt}: fits fewer than {below}")
        if layout == "fsdp" and best.get(("ddp", precision, ckpt), 0) > b:
            wrong.append(f"fsdp {precision} ckpt {ckpt}: fits fewer than ddp")
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny config at 256 tokens on a T4, 2 ranks")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--layouts", help="the plan's --layouts (default: the data-parallel layouts)")
    args = parser.parse_args()
    config, seq, gpu, world = (TINY, "256", "t4", "2") if args.quick else (LLAMA3_8B, "4096", "h100-80gb", "8")
    with tempfile.TemporaryDirectory() as folder:
        pathlib.Path(folder, "config.json").write_text(json.dumps(config))
        est_t, est = _memprof(["estimate", "--hf", folder, "--seq-len", seq, "--batch-size", "1", "--precision",
                               "mixed", "--json"])
        plan_args = ["plan", "--hf", folder, "--seq-len", seq, "--gpu", gpu, "--world-size", world, "--json"]
        if args.quick:
            plan_args += ["--precision", "bf16", "--checkpointing", "on"]
        if args.layouts or args.quick:
            plan_args += ["--layouts", args.layouts or "fsdp"]
        plan_t, rows = _memprof(plan_args)
    assert isinstance(est, dict) and isinstance(rows, list)
    weights = est["breakdown"]["weights"]
    print(f"estimate --hf: {_said(est_t)}; weights at the peak {weights:,} B"
          + ("" if args.quick else f" (4 B x {PARAMETERS:,} = {4 * PARAMETERS:,}: "
             f"{'equal' if weights == 4 * PARAMETERS else 'DIFFERENT'})"))
    sims = sum(r["simulations"] for r in rows)
    print(f"plan: {_said(plan_t)}; {len(rows)} configurations, {sims} simulations")
    for r in rows:
        print(f"  {r['parallel']:<9} {r['precision']:<6} ckpt {'on ' if r['checkpointing'] else 'off'} "
              f"max batch {r['max_batch_size']:>3}  device peak {r['device_peak'] / 2**30:7.2f} GiB  "
              f"largest {r['dominant']} ({r['simulations']} simulations)")
    wrong = consistency(rows)
    print("consistent: every row confirmed, checkpointing never lowers the largest batch, ddp <= zero1 <= zero2 <= "
          "zero3, ddp <= fsdp" if not wrong else "INCONSISTENT: " + "; ".join(wrong))
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "quick": args.quick, "cpu_count": os.cpu_count(), "estimate_seconds": est_t["wall_seconds"],
              "estimate_timing": est_t, "estimate": est, "plan_seconds": plan_t["wall_seconds"],
              "plan_timing": plan_t, "plan_simulations": sims, "plan_rows": rows, "inconsistent": wrong,
              "weights_are_fp32_master": weights == 4 * PARAMETERS}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
