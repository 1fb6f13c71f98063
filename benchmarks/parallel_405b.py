"""A 405B Llama on 1,024 ranks, one rank at a time: how long does memprof.estimate() take?

Run from the repository root::

    python benchmarks/parallel_405b.py                 # 405B shape, PP 2 x FSDP 64 x TP 8 (about a minute on 2 cores)
    python benchmarks/parallel_405b.py --quick         # a tiny shape on 8 ranks, seconds
    python benchmarks/parallel_405b.py --config 70b    # Llama-2-70B, one rank of 64 under FSDP2 with bf16 gathers
    python benchmarks/parallel_405b.py --json benchmarks/results/parallel-405b.json

What is simulated
-----------------
A Llama decoder with Llama 3.1 405B's shapes (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3: 126
layers, model dimension 16,384, FFN 53,248, 128 attention heads, 8 key/value heads, vocabulary 128,256), bf16
compute over fp32 parameters (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), on a mesh
of 1,024 ranks: ``{"pp": 2, "dp": 64, "tp": 8}``. The parallelize function is torchtitan's plan: tensor parallel
attention and MLP (column-wise q/k/v/w1/w3, row-wise o/w2), sequence parallel norms, a row-wise embedding and a
column-wise head, then ``fully_shard`` of each layer and of the stage over ``dp``. The pipeline cuts the 126 layers
into two stages of 63 (the first with the embedding, the last with the norm and head) and runs torch's 1F1B
schedule over 2 micro-batches of 1 x 8,192 tokens. AdamW, for-each.

``estimate(..., extrapolate=3)`` simulates each stage with 3, 4 and 5 layers, checks that every category of every
phase grew by the same bytes per layer, and extends the line to 63 layers per stage; both pipeline rank classes
are simulated and the worst is returned. What is timed: the whole ``memprof.estimate`` call, wall and CPU
(``time.process_time`` plus the CPU of the processes the call forked and waited for, which simulate the pipeline
rank classes side by side where there are cores: ``estimate(..., processes=1)`` keeps them in this one; on a shared
machine the wall time includes waiting for a core).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

from _machine import import_memprof

#: Llama-2-70B (Touvron et al. 2023, Table 1; HF config.json).
LLAMA_70B = dict(vocab=32_000, dim=8_192, layers=80, heads=64, kv_heads=8, ffn=28_672)
LLAMA_405B = dict(vocab=128_256, dim=16_384, layers=126, heads=128, kv_heads=8, ffn=53_248)
TINY = dict(vocab=256, dim=64, layers=8, heads=4, kv_heads=2, ffn=128)


def build(cfg: dict[str, int]) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
            super().__init__()
            self.hd = dim // heads
            self.wq = nn.Linear(dim, heads * self.hd, bias=False)
            self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
            self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
            self.wo = nn.Linear(heads * self.hd, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            # -1 heads: under tensor parallelism the local projections hold heads / tp of them.
            q = self.wq(x).view(b, s, -1, self.hd).transpose(1, 2)
            k = self.wk(x).view(b, s, -1, self.hd).transpose(1, 2)
            v = self.wv(x).view(b, s, -1, self.hd).transpose(1, 2)
            if k.shape[1] != q.shape[1]:
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(y.transpose(1, 2).reshape(b, s, -1))

    class MLP(nn.Module):
        def __init__(self, dim: int, ffn: int) -> None:
            super().__init__()
            self.w1 = nn.Linear(dim, ffn, bias=False)
            self.w3 = nn.Linear(dim, ffn, bias=False)
            self.w2 = nn.Linear(ffn, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm = nn.RMSNorm(cfg["dim"])
            self.attention = Attention(cfg["dim"], cfg["heads"], cfg["kv_heads"])
            self.ffn_norm = nn.RMSNorm(cfg["dim"])
            self.feed_forward = MLP(cfg["dim"], cfg["ffn"])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attention(self.attention_norm(x))
            return x + self.feed_forward(self.ffn_norm(x))

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(cfg["vocab"], cfg["dim"])
            self.layers = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.norm = nn.RMSNorm(cfg["dim"])
            self.output = nn.Linear(cfg["dim"], cfg["vocab"], bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.tok_embeddings(ids) if self.tok_embeddings is not None else ids
            for layer in self.layers:
                h = layer(h)
            return self.output(self.norm(h)) if self.output is not None else h

    with torch.device("meta"):
        return Llama()


def split(full: Any, k: int, n: int) -> Any:
    """torchtitan's cut: stage k keeps its layers; the first the embedding, the last the norm and head."""
    import copy

    from torch import nn

    per = len(full.layers) // n
    stage = copy.copy(full)
    stage._modules = dict(full._modules)
    stage.tok_embeddings = full.tok_embeddings if k == 0 else None
    stage.layers = nn.ModuleList(full.layers[per * k: per * (k + 1)])
    stage.norm = full.norm if k == n - 1 else None
    stage.output = full.output if k == n - 1 else None
    return stage


def parallelize(model: Any, mesh: Any) -> Any:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if "tp" not in mesh.mesh_dim_names:  # FSDP2 alone: each layer, then the root
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        return fully_shard(model, mesh=mesh, mp_policy=mp)
    tp, dp = mesh["tp"], mesh["dp"]
    plan: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.output is not None:
        plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if plan:
        parallelize_module(model, tp, plan)
    for block in model.layers:
        parallelize_module(block, tp, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    for block in model.layers:
        fully_shard(block, mesh=dp, mp_policy=mp)
    fully_shard(model, mesh=dp, mp_policy=mp)
    return model


def _cpu() -> float:
    """This process's CPU seconds and its waited-for children's (the forked rank classes')."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def run(cfg: dict[str, int], mesh: dict[str, int], seq: int, micro: int, k: "int | None") -> dict[str, Any]:
    memprof = import_memprof()
    import torch
    import torch.nn.functional as F

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    world = 1
    for size in mesh.values():
        world *= size
    ids = torch.empty(micro, seq, dtype=torch.long, device="meta")
    pipeline = memprof.Pipeline(split, schedule="1f1b", microbatches=micro) if "pp" in mesh else None
    # The user's model, built on the meta device before the clock starts: what is timed is memprof's call (until
    # 2026-12-06 the build, about 1 s of the 405B's figure, was timed with it).
    t = time.perf_counter()
    model = build(cfg)
    built = time.perf_counter() - t
    t, cpu = time.perf_counter(), _cpu()
    est = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps, foreach=True), inputs=ids, targets=ids,
                           loss_fn=loss_fn, world_size=world, mesh=mesh, parallelize=parallelize, device="cuda",
                           pipeline=pipeline, extrapolate=k)
    seconds, cpu = time.perf_counter() - t, _cpu() - cpu
    G = 2**30
    out = {"seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1), "build_seconds": round(built, 1),
           "world_size": world, "mesh": mesh,
           "peak_gib": round(est.peak_bytes / G, 3),
           # The CUDA target's device peak (allocator cache and memory outside torch on top of the tensors).
           "device_peak_gib": None if est.device_peak is None else round(est.device_peak / G, 3),
           "simulated_whole": [n for n in est.notes if n.startswith("depth:") and "simulated whole" in n],
           "worst_rank": next((c.representative for c in est.ranks if c.peak_bytes == est.peak_bytes), 0),
           "peak_at": f"step {est.trace.peak_step} {est.trace.peak_phase.value}",
           "ranks": [{"stages": list(c.stages), "ranks": f"{c.ranks[0]}..{c.ranks[-1]} ({len(c.ranks)})",
                      "peak_gib": round(c.peak_bytes / G, 3), "at": f"step {c.peak_step} {c.peak_phase}"}
                     for c in est.ranks],
           "peak": {c.value: round(est.peak[c] / G, 3) for c in memprof.Category if est.peak[c]},
           "notes": list(est.notes)}
    return out


def main(argv: "list[str] | None" = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny shape on 8 ranks")
    ap.add_argument("--config", choices=("405b", "70b"), default="405b")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if args.quick:
        res = run(TINY, {"pp": 2, "dp": 2, "tp": 2}, 16, 2, None)
    elif args.config == "70b":  # one rank of 64, batch 1 x 2,048
        res = run(LLAMA_70B, {"dp": 64}, 2048, 1, 3)
    else:
        res = run(LLAMA_405B, {"pp": 2, "dp": 64, "tp": 8}, 8192, 2, 3)
    print(f"{res['seconds']} s ({res['cpu_seconds']} s of CPU; the model built before it in {res['build_seconds']} s) "
          f"for {res['world_size']:,} ranks {res['mesh']}: "
          f"worst rank {res['worst_rank']}, "
          f"peak {res['peak_gib']} GiB at {res['peak_at']}")
    for r in res["ranks"]:
        print(f"  stage(s) {r['stages']}: ranks {r['ranks']}: {r['peak_gib']} GiB at {r['at']}")
    print("  at the worst rank's peak (GiB):", ", ".join(f"{k} {v}" for k, v in res["peak"].items()))
    print(f"  device peak of the worst rank (GiB): {res['device_peak_gib']}")
    for note in res["simulated_whole"]:
        print(" ", note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
