"""How long does ``memprof.estimate_hf`` take on a deep model, simulated whole and by the default's cut-and-extend?

Run from the repository root::

    python benchmarks/depth_default.py                            # Llama-3-8B and -70B, 2 rounds (minutes)
    python benchmarks/depth_default.py --configs 8b --rounds 3
    python benchmarks/depth_default.py --old /path/to/older/checkout   # against another memprof, alternated
    python benchmarks/depth_default.py --quick                    # a tiny 16-layer config, seconds

What is measured
----------------
A Llama-3 ``config.json`` (8B: hidden 4096, FFN 14336, 32 layers, 32 heads, 8 key/value heads; 70B: hidden 8192,
FFN 28672, 80 layers, 64 heads, 8 key/value heads; vocabulary 128256, untied) is built on the meta device and
``memprof.estimate_hf(config, seq_len=4096, batch_size=1, precision="mixed", gpu="h100-80gb")`` runs as
``memprof estimate --hf`` runs it: the HF Trainer's step (clipping at 1.0), AdamW, 2 optimizer steps, the device
replay. Each measurement is a fresh process; the estimate alone is timed (wall and CPU: on a shared machine the CPU
time is the figure to compare), the process's start (importing torch and transformers: about 4 s of CPU here,
which no change to memprof's simulation moves) apart. The two ways alternate, round by round:

* ``whole``: ``extrapolate=False`` (or, with ``--old``, that checkout's default, which simulated the whole model);
* ``default``: ``extrapolate=None``, the stack cut to 2, 3 and 4 layers, its figures and its allocation stream
  extended to the full depth and replayed (:mod:`memprof.simulate.depth`).

The default's process then asks the same estimate again (``--warm``, twice by default) and the fastest of those
is the *warm* figure: what a user asking question after question in one session (a notebook, a plan's rows)
waits for each, the model's twin and the simulation's caches built. Each answer asked again must give the same
figures. Each pair's figures are compared: the tensors' peak, the device peak and the fit verdict must be equal
to the byte, else the script exits 1. The 1-minute load average before and after each run is printed: the
machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

_LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, tie_word_embeddings=False,
               max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, torch_dtype="bfloat16")
CONFIGS = {
    "8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
    "70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
    "tiny": dict(_LLAMA3, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=16,
                 num_attention_heads=4, num_key_value_heads=2),
}

_WORKER = r"""
import json, os, sys, time
start = time.perf_counter()
import memprof, transformers
imported = time.perf_counter() - start
cfg = transformers.AutoConfig.from_pretrained(sys.argv[1])
kw = dict(seq_len=int(sys.argv[2]), batch_size=1, precision="mixed", gpu="h100-80gb")
if sys.argv[3] == "whole-new":
    kw["extrapolate"] = False
load = os.getloadavg()[0]
wall, cpu = time.perf_counter(), time.process_time()
est = memprof.estimate_hf(cfg, **kw)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
warm = []  # the same estimate asked again in the same process: what a user asking question after question waits
for _ in range(int(sys.argv[4])):
    again_wall, again_cpu = time.perf_counter(), time.process_time()
    again = memprof.estimate_hf(cfg, **kw)
    warm.append((time.perf_counter() - again_wall, time.process_time() - again_cpu,
                 (again.peak_bytes, again.device_peak, again.fits) == (est.peak_bytes, est.device_peak, est.fits)))
print(json.dumps(dict(wall=wall, cpu=cpu, imported=imported, load_before=load, load_after=os.getloadavg()[0],
                      peak=est.peak_bytes, device_peak=est.device_peak, fits=est.fits,
                      fast=any(n.startswith("depth: simulated with") for n in est.notes),
                      warm_wall=min((w for w, _c, _same in warm), default=None),
                      warm_cpu=min((c for _w, c, _same in warm), default=None),
                      warm_same=all(same for _w, _c, same in warm))))
"""


def _run(tree: str, folder: str, seq: int, way: str, warm: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", _WORKER, folder, str(seq), way, str(warm)], env=env, check=True,
                         capture_output=True, text=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="8b,70b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--old", help="another memprof checkout: its default is the 'whole' way")
    parser.add_argument("--quick", action="store_true", help="a tiny 16-layer config at seq 256, 1 round")
    parser.add_argument("--warm", type=int, default=2,
                        help="the default's estimate asked again this many times in its process (the warm figure)")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args(argv)
    names = ["tiny"] if args.quick else args.configs.split(",")
    seq, rounds = (256, 1) if args.quick else (args.seq, args.rounds)
    whole_tree, whole_way = (args.old, "old") if args.old else (str(ROOT), "whole-new")
    results, ok = {}, True
    for name in names:
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(CONFIGS[name], f)
            rows = []
            for r in range(rounds):
                for way, tree, arg in (("whole", whole_tree, whole_way), ("default", str(ROOT), "default")):
                    got = _run(tree, folder, seq, arg, args.warm if way == "default" else 0)
                    got.update(way=way, round=r + 1)
                    rows.append(got)
                    warm = (f"  warm wall {got['warm_wall']:.2f} s cpu {got['warm_cpu']:.2f} s"
                            if got.get("warm_wall") is not None else "")
                    print(f"{name} round {r + 1} {way:8s} wall {got['wall']:6.2f} s  cpu {got['cpu']:6.2f} s  "
                          f"(imports {got['imported']:.1f} s; load {got['load_before']:.1f} -> "
                          f"{got['load_after']:.1f})  peak {got['peak']:,} B  device {got['device_peak']:,} B  "
                          f"fits {got['fits']}  cut-and-extend {got['fast']}{warm}", flush=True)
                    if not got.get("warm_same", True):
                        print(f"{name}: an estimate asked again in the same process gave other figures", flush=True)
                        ok = False
            for r in range(rounds):
                a, b = rows[2 * r], rows[2 * r + 1]
                if (a["peak"], a["device_peak"], a["fits"]) != (b["peak"], b["device_peak"], b["fits"]):
                    print(f"{name}: the figures differ in round {r + 1}", flush=True)
                    ok = False
            best = {w: min(x["cpu"] for x in rows if x["way"] == w) for w in ("whole", "default")}
            warm_best = min((x["warm_wall"] for x in rows if x.get("warm_wall") is not None), default=None)
            print(f"{name}: best CPU whole {best['whole']:.2f} s, default {best['default']:.2f} s "
                  f"({best['whole'] / best['default']:.1f}x)"
                  + (f"; asked again in a warm process: {warm_best:.2f} s wall" if warm_best is not None else ""),
                  flush=True)
            results[name] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(["python", "benchmarks/depth_default.py", *(argv or sys.argv[1:])]),
                           cpus=os.cpu_count(), results=results), f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
