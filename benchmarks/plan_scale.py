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
  (DDP, FSDP, ZeRO 1-3 x bf16, mixed x checkpointing off, on).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
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


def _memprof(args: list[str]) -> tuple[float, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memprof", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise SystemExit(f"memprof {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return seconds, json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny config at 256 tokens on a T4, 2 ranks")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    config, seq, gpu, world = (TINY, "256", "t4", "2") if args.quick else (LLAMA3_8B, "4096", "h100-80gb", "8")
    with tempfile.TemporaryDirectory() as folder:
        pathlib.Path(folder, "config.json").write_text(json.dumps(config))
        est_s, est = _memprof(["estimate", "--hf", folder, "--seq-len", seq, "--batch-size", "1", "--precision",
                               "mixed", "--json"])
        plan_args = ["plan", "--hf", folder, "--seq-len", seq, "--gpu", gpu, "--world-size", world, "--json"]
        if args.quick:
            plan_args += ["--parallel", "fsdp", "--precision", "bf16", "--checkpointing", "on"]
        plan_s, rows = _memprof(plan_args)
    assert isinstance(est, dict) and isinstance(rows, list)
    weights = est["breakdown"]["weights"]
    print(f"estimate --hf: {est_s:.1f} s; weights at the peak {weights:,} B"
          + ("" if args.quick else f" (4 B x {PARAMETERS:,} = {4 * PARAMETERS:,}: "
             f"{'equal' if weights == 4 * PARAMETERS else 'DIFFERENT'})"))
    print(f"plan: {plan_s:.1f} s, {len(rows)} configurations")
    for r in rows:
        print(f"  {r['parallel']:<6} {r['precision']:<6} ckpt {'on ' if r['checkpointing'] else 'off'} "
              f"max batch {r['max_batch_size']:>3}  device peak {r['device_peak'] / 2**30:7.2f} GiB  "
              f"largest {r['dominant']} ({r['simulations']} simulations)")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "quick": args.quick, "cpu_count": os.cpu_count(), "estimate_seconds": round(est_s, 1),
              "estimate": est, "plan_seconds": round(plan_s, 1), "plan_rows": rows,
              "weights_are_fp32_master": weights == 4 * PARAMETERS}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
