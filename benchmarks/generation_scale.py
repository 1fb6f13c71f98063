"""How fast and how light is memprof.estimate_generation() on a 70B Llama shape?

Run from the repository root::

    python benchmarks/generation_scale.py                    # 70b at batch 8, 4,096 + 512 tokens, bf16
    python benchmarks/generation_scale.py --quick            # the tiny configuration: a smoke test
    python benchmarks/generation_scale.py --json benchmarks/results/generation-scale.json \\
        --markdown benchmarks/results/generation-scale.md

A transformers ``LlamaForCausalLM`` is built from a ``LlamaConfig`` on the ``meta`` device with the
dimensions of Llama-2-70B (Touvron et al. 2023, Table 1; HF config.json: hidden 8192, 80 layers, 64
heads, 8 key/value heads, FFN 28672, vocabulary 32000), in a fresh subprocess per configuration, and
``memprof.estimate_generation(model, batch_size=8, prompt_len=4096, max_new_tokens=512,
precision="bf16", device="cuda")`` is timed; the process's peak RSS is read from ``ru_maxrss``. The
simulated KV cache at the end of generation is compared with
``memprof.anatomy.kv_cache_bytes`` (2 x layers x batch x tokens x kv_heads x head_dim x 2 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

# benchmarks run as scripts from this folder
from _machine import command_line, cpu_model, import_memprof, write_results

CONFIGS: dict[str, dict[str, int]] = {
    "70b": dict(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=32000, positions=8192),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=172, vocab=256, positions=256),
}


def worker(name: str, batch: int, prompt: int, new: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch
    import transformers

    memprof = import_memprof()
    from memprof.anatomy import kv_cache_bytes

    torch.set_num_threads(2)
    t_import = time.perf_counter() - t0
    c = CONFIGS[name]
    cfg = transformers.LlamaConfig(hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                                   num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                                   intermediate_size=c["ffn"], vocab_size=c["vocab"],
                                   max_position_embeddings=c["positions"])
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    est = memprof.estimate_generation(model, batch_size=batch, prompt_len=prompt, max_new_tokens=new,
                                      precision="bf16", device="cuda")
    t_estimate = time.perf_counter() - t0
    trace = est.trace
    last = [p for p in trace.phases if p.phase.value == "decode"][-1]
    head_dim = c["hidden"] // c["heads"]
    tokens = prompt + new - 1
    formula = kv_cache_bytes(c["layers"], batch, tokens, c["kv_heads"], head_dim, bytes_per_element=2)
    return {
        "config": name, "dims": c, "batch": batch, "prompt_len": prompt, "max_new_tokens": new,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds_import": t_import, "seconds_build_meta_model": t_build, "seconds_estimate": t_estimate,
        "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "predicted_peak_bytes": est.peak_bytes,
        "peak_phase": trace.peak_phase.value if trace.peak_phase else None,
        "kv_cache_end_bytes": last.end[memprof.Category.KV_CACHE],
        "kv_cache_formula_bytes": formula,
        "weights_bytes": last.end[memprof.Category.WEIGHTS],
        "decode_peak_temporaries_bytes": last.peak[memprof.Category.TEMPORARIES],
        "prefill_peak_bytes": next(p.peak.total for p in trace.phases if p.phase.value == "prefill"),
        "notes": list(est.notes),
    }


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| config | batch × (prompt + new) | `estimate_generation()` wall time | peak RSS "
             "| simulated peak (phase) | weights | KV cache at the end (simulated) | KV cache formula "
             "| last decode's temporaries |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(
            f"| {r['config']} | {r['batch']} × ({r['prompt_len']} + {r['max_new_tokens']}) "
            f"| {r['seconds_estimate']:.1f} s | {r['ru_maxrss_kib'] / 2**20:.2f} GiB "
            f"| {_gib(r['predicted_peak_bytes'])} ({r['peak_phase']}) "
            f"| {_gib(r['weights_bytes'])} | {_gib(r['kv_cache_end_bytes'])} | {_gib(r['kv_cache_formula_bytes'])} "
            f"| {_gib(r['decode_peak_temporaries_bytes'])} |")
    return "\n".join(lines) + "\n"


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="70b", help="comma list of " + ",".join(CONFIGS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="the tiny configuration, 32 + 32 tokens")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--markdown", metavar="PATH")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.configs, args.prompt, args.new = "tiny", 32, 32
    if args.worker:
        print(json.dumps(worker(args.worker, args.batch, args.prompt, args.new)))
        return 0
    results = []
    for c in args.configs.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", c, "--batch", str(args.batch),
               "--prompt", str(args.prompt), "--new", str(args.new)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"{c}: estimate {r['seconds_estimate']:.1f} s, peak RSS {r['ru_maxrss_kib'] / 2**20:.2f} GiB, "
              f"KV cache {r['kv_cache_end_bytes']:,} B (formula {r['kv_cache_formula_bytes']:,} B)", flush=True)
    md = (f"Command: `{command_line(__file__, argv)}`; {cpu_model()}.\n\n" + markdown(results))
    print()
    print(md)
    write_results(args.json, {"results": results}, args.markdown, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
