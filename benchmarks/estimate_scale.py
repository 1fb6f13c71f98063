"""How fast and how light is memprof.estimate() on billion-parameter models?

Run from the repository root::

    python benchmarks/estimate_scale.py                     # 1B, 7B, 13B at seq 2048 (a few minutes on 2 cores)
    python benchmarks/estimate_scale.py --quick             # tiny configuration, a few seconds
    python benchmarks/estimate_scale.py --configs 7b --seq 512 --cprofile
    python benchmarks/estimate_scale.py --json benchmarks/results/estimate-scale.json

What is measured
----------------
A Llama-style decoder written here (``nn.RMSNorm``, rotary position
embeddings applied to q and k, grouped-query attention through
``F.scaled_dot_product_attention(is_causal=True)``, SwiGLU MLP, untied LM head,
no biases) is built on the ``meta`` device in bf16 with the dimensions of:

* ``1b``: TinyLlama-1.1B: hidden 2048, 22 layers, 32 heads, 4 KV heads, FFN 5632, vocab 32000;
* ``7b``: Llama-2-7B: hidden 4096, 32 layers, 32 heads, FFN 11008, vocab 32000;
* ``13b``: Llama-2-13B: hidden 5120, 40 layers, 40 heads, FFN 13824, vocab 32000.

``memprof.estimate(model, lambda ps: AdamW(ps, foreach=True), inputs=ids, targets=ids,
loss_fn=cross_entropy, device="cuda", precision="bf16")`` simulates 2 training
steps (batch 1, ``--seq`` tokens) for a CUDA target (AdamW's foreach path, the
default on CUDA). Each configuration runs in a fresh subprocess, so the
resident-memory figures are per configuration: the estimate's wall time,
the process's peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss`` and
``VmHWM`` in ``/proc/self/status``), and the RSS before the model is built
(Python + torch + memprof). The predicted breakdown is shown next to the
textbook figure ``memprof.anatomy.bytes_per_param("bf16", "adamw")`` (8 B) ×
parameters, and the Korthikanti et al. activation closed form for the same
layers (SwiGLU, GQA; eager attention) for reference. ``--cprofile`` adds the
top functions of a cProfile run of the estimate.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any

# benchmarks run as scripts from this folder
from _machine import command_line, cpu_model, import_memprof, write_results

CONFIGS: dict[str, dict[str, int]] = {
    # TinyLlama-1.1B (config.json of TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T).
    "1b": dict(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000),
    # Llama-2-7B and -13B (Touvron et al. 2023, Table 1; HF config.json).
    "7b": dict(hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    "13b": dict(hidden=5120, layers=40, heads=40, kv_heads=40, ffn=13824, vocab=32000),
    # Llama-2-70B (Touvron et al. 2023, Table 1; HF config.json): grouped-query attention, 8 KV heads.
    "70b": dict(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=32000),
    # Smoke test only.
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=172, vocab=256),
}


def _status_kib(field: str) -> "int | None":
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------- the model (worker side)


def build_llama(cfg: dict[str, int], seq: int, dtype: Any = None) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
            super().__init__()
            self.heads, self.kv_heads, self.hd = heads, kv_heads, hidden // heads
            self.q = nn.Linear(hidden, heads * self.hd, bias=False)
            self.k = nn.Linear(hidden, kv_heads * self.hd, bias=False)
            self.v = nn.Linear(hidden, kv_heads * self.hd, bias=False)
            self.o = nn.Linear(heads * self.hd, hidden, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
            k = self.k(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
            v = self.v(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            if self.kv_heads != self.heads:
                rep = self.heads // self.kv_heads
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(b, s, -1))

    def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
        return t * cos + rotated * sin

    class SwiGLU(nn.Module):
        def __init__(self, hidden: int, ffn: int) -> None:
            super().__init__()
            self.gate = nn.Linear(hidden, ffn, bias=False)
            self.up = nn.Linear(hidden, ffn, bias=False)
            self.down = nn.Linear(ffn, hidden, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(F.silu(self.gate(x)) * self.up(x))

    class Layer(nn.Module):
        def __init__(self, c: dict[str, int]) -> None:
            super().__init__()
            self.attn_norm = nn.RMSNorm(c["hidden"], eps=1e-5)
            self.attn = Attention(c["hidden"], c["heads"], c["kv_heads"])
            self.mlp_norm = nn.RMSNorm(c["hidden"], eps=1e-5)
            self.mlp = SwiGLU(c["hidden"], c["ffn"])

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.attn_norm(x), cos, sin)
            return x + self.mlp(self.mlp_norm(x))

    class Llama(nn.Module):
        def __init__(self, c: dict[str, int], max_seq: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(c["vocab"], c["hidden"])
            self.layers = nn.ModuleList(Layer(c) for _ in range(c["layers"]))
            self.norm = nn.RMSNorm(c["hidden"], eps=1e-5)
            self.lm_head = nn.Linear(c["hidden"], c["vocab"], bias=False)  # untied, as in Llama 2
            hd = c["hidden"] // c["heads"]
            # Rotary tables as non-persistent buffers (bf16 after .to(), as in HF's cached variant).
            self.register_buffer("cos", torch.empty(max_seq, hd), persistent=False)
            self.register_buffer("sin", torch.empty(max_seq, hd), persistent=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            s = ids.shape[1]
            cos, sin = self.cos[:s], self.sin[:s]
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.lm_head(self.norm(x))

    with torch.device("meta"):
        model = Llama(cfg, seq).to(dtype or torch.bfloat16)
    return model


def worker(name: str, seq: int, batch: int, steps: int, cprofile: bool, precision: str = "bf16",
           world_size: int = 1, parallel: "str | None" = None) -> dict[str, Any]:
    rss_start_kib = _status_kib("VmRSS")
    t0 = time.perf_counter()
    import torch
    import torch.nn.functional as F

    memprof = import_memprof()
    import memprof.anatomy as anatomy

    torch.set_num_threads(2)
    t_import = time.perf_counter() - t0
    rss_after_import_kib = _status_kib("VmRSS")
    cfg = CONFIGS[name]

    t0 = time.perf_counter()
    # Mixed precision keeps fp32 parameters (autocast casts them per use); bf16 casts them.
    model = build_llama(cfg, seq, torch.float32 if precision.startswith("mixed") else torch.bfloat16)
    t_build = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    n_buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    ids = torch.zeros((batch, seq), dtype=torch.long)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def opt_factory(ps: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=1e-4, foreach=True)

    prof_stats = None
    # The allocator replay and the memory outside torch (a CUDA target's device rows), timed on their own.
    from memprof.simulate import device_memory as device_rows

    replay_seconds, real_on_device = [0.0], device_rows.on_device

    def timed_on_device(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_on_device(*args, **kwargs)
        finally:
            replay_seconds[0] += time.perf_counter() - t

    device_rows.on_device = timed_on_device
    t0 = time.perf_counter()
    if cprofile:
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        pr.enable()
    est = memprof.estimate(model, opt_factory, inputs=ids, targets=ids, loss_fn=loss_fn, device="cuda",
                           precision=precision, steps=steps, world_size=world_size, parallel=parallel)
    if cprofile:
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(25)
        prof_stats = buf.getvalue()
    t_estimate = time.perf_counter() - t0

    ru = resource.getrusage(resource.RUSAGE_SELF)
    cats = [c.value for c in memprof.Category]
    regime = "mixed" if precision.startswith("mixed") else precision
    bpp = anatomy.bytes_per_param(regime, "adamw")
    bpp_split = anatomy.bytes_per_param_breakdown(regime, "adamw")
    korthikanti_layer = anatomy.transformer_layer_activations(
        anatomy.LayerShape(seq, batch, cfg["hidden"], cfg["heads"], ffn_hidden=cfg["ffn"], kv_heads=cfg["kv_heads"]),
        dropout=False, attention="flash", bytes_per_element=2, mlp="swiglu")
    trace = est.trace
    out = {
        "config": name,
        "precision": precision,
        "world_size": world_size,
        "parallel": parallel,
        "dims": cfg,
        "seq": seq,
        "batch": batch,
        "steps": steps,
        "parameters": n_params,
        "buffer_bytes": n_buffers,
        "seconds_import": t_import,
        "seconds_build_meta_model": t_build,
        "seconds_estimate": t_estimate,
        "ops_dispatched": sum(p.ops for p in trace.phases),
        "seconds_device_replay": replay_seconds[0],
        "device_peak_bytes": est.device_peak,
        "device_peak_reserved_bytes": est.device_memory.peak_reserved if est.device_memory else None,
        "ru_maxrss_kib": ru.ru_maxrss,  # KiB on Linux
        "vmhwm_kib": _status_kib("VmHWM"),
        "rss_at_start_kib": rss_start_kib,
        "rss_after_import_kib": rss_after_import_kib,
        "predicted_peak_bytes": est.peak_bytes,
        "predicted_peak_where": {"step": trace.peak_step,
                                 "phase": trace.peak_phase.value if trace.peak_phase else None,
                                 "module": trace.peak_module},
        "simulated_at_peak": {c: est.peak[c] for c in cats},
        "formula_at_peak": {c: est.formula[c] for c in cats},
        "bytes_per_param_adamw": bpp,
        "bytes_per_param_split": {"weights": bpp_split.weights, "gradients": bpp_split.gradients,
                                  "optimizer_states": bpp_split.optimizer_states},
        "textbook_model_states_bytes": int(bpp * n_params),
        "korthikanti_activations_bytes": cfg["layers"] * korthikanti_layer,
        # What the forward saved, at its end (the peak may come later, in backward or the optimizer step).
        "simulated_forward_end_activations": max(
            (p.end[memprof.Category.ACTIVATIONS] or 0) for p in trace.phases if p.phase.value == "forward"),
        # Named kinds of saved tensors at the forward's end (autocast's weight copies, norm statistics ...).
        "forward_end_tags": dict(next(p for p in trace.phases if p.phase.value == "forward").tags_end),
        "notes": list(est.notes),
        "cprofile_top": prof_stats,
    }
    # Model states at the end of the last optimizer step (steady), from the simulated phases.
    opt_phases = [p for p in trace.phases if p.phase is memprof.Phase.OPTIMIZER]
    if opt_phases:
        end = opt_phases[-1].end
        out["simulated_steady"] = {c: end[c] for c in cats}
        out["simulated_optimizer_step_peak"] = {c: opt_phases[-1].peak[c] for c in cats}
    return out


# ---------------------------------------------------------------------------- driver


def _gib(n: "float | None") -> str:
    """GiB with two decimals; smaller figures (the tiny smoke configuration) in MiB or KiB."""
    if n is None:
        return "n/a"
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB"


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| config | parameters | seq × batch | `estimate()` wall time | ops simulated | peak RSS (ru_maxrss) | VmHWM "
        "| RSS after `import torch, memprof` |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['config']} | {r['parameters'] / 1e9:.3f} B | {r['seq']} × {r['batch']} "
            f"| {r['seconds_estimate']:.1f} s "
            f"| {r['ops_dispatched']:,} | {r['ru_maxrss_kib'] / 2**20:.2f} GiB | "
            f"{_gib((r['vmhwm_kib'] or 0) * 1024)} | {_gib((r['rss_after_import_kib'] or 0) * 1024)} |")
    prec = results[0].get("precision", "bf16") if results else "bf16"
    ws, par = (results[0].get("world_size", 1), results[0].get("parallel")) if results else (1, None)
    if par:
        communication = ", ".join(_gib(r["simulated_at_peak"].get("communication")) for r in results)
        prec += f"; one rank of {ws} under {par}, communication {communication} at the peak"
    lines += ["", f"Predicted for a CUDA target ({prec}, AdamW foreach), at the simulated peak "
              "and at the end of the last optimizer step (steady), next to the textbook:", "",
              "| config | simulated peak (where) | weights | gradients | optimizer states | activations "
              "| temporaries | steady: W + G + O | textbook B/param × N | activations at forward's end "
              "| Korthikanti, flash (all layers) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        s = r["simulated_at_peak"]
        st = r.get("simulated_steady") or {}
        steady = sum(st.get(c) or 0 for c in ("weights", "gradients", "optimizer_states")) if st else None
        w = r["predicted_peak_where"]
        lines.append(
            f"| {r['config']} | {_gib(r['predicted_peak_bytes'])} (step {w['step']} {w['phase']}) "
            f"| {_gib(s['weights'])} | {_gib(s['gradients'])} | {_gib(s['optimizer_states'])} "
            f"| {_gib(s['activations'])} "
            f"| {_gib(s['temporaries'])} | {_gib(steady)} | {_gib(r['textbook_model_states_bytes'])} "
            f"| {_gib(r.get('simulated_forward_end_activations'))} | {_gib(r['korthikanti_activations_bytes'])} |")
    return "\n".join(lines) + "\n"


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="1b,7b,13b,70b", help="comma list of " + ",".join(CONFIGS))
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; --quick 32)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="simulated training steps (default 2, as estimate())")
    ap.add_argument("--precision", choices=("bf16", "mixed", "mixed-fp16"), default="bf16",
                    help="bf16 parameters (default), or fp32 parameters under emulated CUDA autocast")
    ap.add_argument("--world-size", type=int, default=1, help="ranks: the estimate is one rank's (default 1)")
    ap.add_argument("--parallel", choices=("ddp", "fsdp", "zero1", "zero2", "zero3"), default=None,
                    help="how the ranks share the model (with --world-size above 1)")
    ap.add_argument("--cprofile", action="store_true", help="cProfile the estimate; top functions in the JSON")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per configuration (default 900)")
    ap.add_argument("--quick", action="store_true", help="the tiny configuration only: a smoke test")
    ap.add_argument("--json", metavar="PATH", help="write results as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:  # child process: one configuration, JSON on the last line of stdout
        res = worker(args.worker, args.seq, args.batch, args.steps, args.cprofile, args.precision,
                     args.world_size, args.parallel)
        print(json.dumps(res))
        return 0

    configs = ["tiny"] if args.quick else [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown config {c!r}; choose from {', '.join(CONFIGS)}")
    seq = args.seq if args.seq is not None else (32 if args.quick else 2048)

    import torch

    memprof = import_memprof()
    cpu = cpu_model()
    info = {
        "cpu": cpu, "logical_cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
        "memprof": memprof.__version__, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(__file__, argv),
    }
    print(f"# {cpu}, torch {torch.__version__}; configs {', '.join(configs)}, seq {seq}, batch {args.batch}",
          flush=True)
    results, failures = [], []
    for c in configs:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", c, "--seq", str(seq), "--batch", str(args.batch),
               "--steps", str(args.steps), "--precision", args.precision, "--world-size", str(args.world_size)]
        cmd += (["--parallel", args.parallel] if args.parallel else []) + (["--cprofile"] if args.cprofile else [])
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            failures.append({"config": c, "error": f"timed out after {args.timeout:.0f} s"})
            print(f"{c}: timed out after {args.timeout:.0f} s", flush=True)
            continue
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            failures.append({"config": c, "error": proc.stderr[-4000:]})
            print(f"{c}: worker failed (exit {proc.returncode})\n{proc.stderr[-4000:]}", file=sys.stderr, flush=True)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["seconds_subprocess"] = wall
        results.append(r)
        print(f"{c}: {r['parameters'] / 1e9:.4f} B params; estimate {r['seconds_estimate']:.1f} s; "
              f"peak RSS {r['ru_maxrss_kib'] / 2**20:.2f} GiB (VmHWM {(r['vmhwm_kib'] or 0) / 2**20:.2f} GiB); "
              f"predicted peak {_gib(r['predicted_peak_bytes'])}; "
              f"textbook {r['bytes_per_param_adamw']:g} B/param × N = {_gib(r['textbook_model_states_bytes'])}",
              flush=True)
        if r.get("cprofile_top"):
            print(r["cprofile_top"], flush=True)

    md = markdown(results) if results else "no configuration finished\n"
    print()
    print(md)
    write_results(args.json, {"machine": info, "results": results, "failures": failures}, args.markdown,
                  f"Command: `{info['command']}`; {cpu}, torch {info['torch']}, {info['date']}.\n\n" + md, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
