"""The device-memory matrix of ``gpu_validate.py --device-matrix``: simulated against measured allocated,
reserved and NVML device-used peaks, per configuration.

Each configuration runs in a fresh process (``PYTORCH_CUDA_ALLOC_CONF`` is read once, when CUDA starts):
a small pre-norm transformer using ``scaled_dot_product_attention`` (batch 8, seq 1024, hidden 1024, 8 heads,
4 blocks), AdamW, ``--steps`` steps, in fp32, bf16 or mixed (autocast bf16), with the flash or the
memory-efficient attention kernel (``torch.nn.attention.sdpa_kernel`` in the run, ``attention=`` in the
estimate), with and without activation checkpointing per block, and with expandable segments on and off.
The truth: ``max_memory_allocated``, ``max_memory_reserved`` and NVML's used bytes for this process after
the steps (the caching allocator never returns memory on its own, so the end is the peak). The estimate:
``memprof.estimate(..., gpu=GpuSpec of this device, alloc_conf=the same string)``: ``peak_bytes``
(tensors), ``device_memory.peak_reserved`` and ``device_peak``. Each ratio is simulated / measured; a
ratio below 1 is an under-estimate, the expensive error, and the worst one is printed last.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from typing import Any

PRECISIONS = ("fp32", "bf16", "mixed")
ATTENTION = ("flash", "efficient")
CHECKPOINT = (False, True)
EXPANDABLE = (False, True)


def build(checkpoint: bool, dtype: Any, device: Any) -> Any:
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.checkpoint import checkpoint as ckpt

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: Any) -> Any:
            b, s, d = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
            x = x + self.out(a)
            return x + self.down(F.gelu(self.up(self.n2(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(1024, 8) for _ in range(4))

        def forward(self, x: Any) -> Any:
            for blk in self.blocks:
                x = ckpt(blk, x, use_reentrant=False) if checkpoint else blk(x)
            return x

    torch.manual_seed(0)
    return Net().to(device=device, dtype=dtype)


def case(precision: str, attention: str, checkpoint: bool, expandable: bool, steps: int) -> dict[str, Any]:
    """One configuration, in this process (started with the right PYTORCH_CUDA_ALLOC_CONF)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import memprof
    from memprof.anatomy.gpus import GpuSpec

    device = torch.device("cuda")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = build(checkpoint, dtype, device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 1024, 1024, device=device, dtype=dtype)
    backend = SDPBackend.FLASH_ATTENTION if attention == "flash" else SDPBackend.EFFICIENT_ATTENTION
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel(backend):
        for _ in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "mixed"):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize()
    measured = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
                "device_used": _nvml_used()}
    props = torch.cuda.get_device_properties(0)
    spec = GpuSpec(props.name, capacity_bytes=int(props.total_memory), compute_capability=(props.major, props.minor))
    conf = "expandable_segments:True" if expandable else ""
    est = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps), inputs=x,
                           loss_fn=lambda out: out.float().pow(2).mean(),
                           precision=precision if precision == "mixed" else None, attention=attention, gpu=spec,
                           alloc_conf=conf, steps=steps)
    simulated = {"allocated": est.peak_bytes, "reserved": est.device_memory.peak_reserved,
                 "device_used": est.device_peak}
    ratios = {k: (simulated[k] / measured[k] if measured[k] else None) for k in simulated}
    return {"precision": precision, "attention": attention, "checkpoint": checkpoint, "expandable": expandable,
            "measured": measured, "simulated": simulated, "ratio": ratios, "fits": est.fits}


def _nvml_used() -> "int | None":
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except Exception:
        return None
    return None


def run_matrix(steps: int = 2) -> list[dict[str, Any]]:
    """Every configuration in its own process; prints one line each and the worst under-estimate."""
    rows = []
    here = os.path.dirname(os.path.abspath(__file__))
    grid = itertools.product(PRECISIONS, ATTENTION, CHECKPOINT, EXPANDABLE)
    for precision, attention, checkpoint, expandable in grid:
        env = dict(os.environ)
        env.pop("PYTORCH_ALLOC_CONF", None)
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True" if expandable else ""
        arg = json.dumps([precision, attention, checkpoint, expandable, steps])
        proc = subprocess.run([sys.executable, os.path.join(here, "device_matrix.py"), arg], env=env,
                              capture_output=True, text=True)
        label = f"{precision:5s} {attention:9s} ckpt={int(checkpoint)} expandable={int(expandable)}"
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"label": label, "error": tail})
            print(f"{label}: FAILED {tail}", flush=True)
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["label"] = label
        rows.append(row)
        r = row["ratio"]
        print(f"{label}: simulated/measured allocated {_fmt(r['allocated'])}, reserved {_fmt(r['reserved'])}, "
              f"device used {_fmt(r['device_used'])}", flush=True)
    worst = min(((row["ratio"][k], row["label"], k) for row in rows if "ratio" in row for k in row["ratio"]
                 if row["ratio"][k] is not None), default=None)
    if worst is not None:
        word = "under-estimate" if worst[0] < 1 else "no under-estimate; the lowest ratio"
        print(f"worst: {word} {worst[0]:.4f} ({worst[2]}, {worst[1]})", flush=True)
    return rows


def _fmt(v: "float | None") -> str:
    return "n/a" if v is None else f"{v:.4f}"


if __name__ == "__main__":  # one configuration, in a fresh process
    p, a, c, e, n = json.loads(sys.argv[1])
    print(json.dumps(case(p, a, c, e, n)))
