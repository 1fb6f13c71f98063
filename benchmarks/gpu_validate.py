"""Validate memprof's CUDA figures against torch.cuda's allocator counters and NVML.

Run from the repository root on a machine with a CUDA device::

    python benchmarks/gpu_validate.py --out results/
    python benchmarks/gpu_validate.py --out results/ --models gpt,cnn --precisions fp32 --optimizers adamw

Needs only torch (with CUDA) and this repository; ``nvidia-ml-py`` is used
when installed (``pip install nvidia-ml-py``) for the NVML rows. Without a
CUDA device the script prints "no CUDA device; nothing to validate" and
exits 0 (it writes a one-line status JSON when ``--out`` is given).

What is checked
---------------
For every model of ``benchmarks/accuracy.py``'s zoo (batch × ``--scale``), in
fp32, bf16 and amp (autocast bf16), with AdamW and SGD-momentum, the same
deterministic ``--steps``-step training run is done three times on a fresh
model, each after ``gc.collect()`` + ``torch.cuda.empty_cache()``:

1. ``bare``: no memprof; ``torch.cuda.reset_peak_memory_stats()`` before,
   then ``max_memory_allocated()``, ``max_memory_reserved()`` and
   ``memory_stats()`` (``allocated_bytes.all.peak``, ``reserved_bytes.all.peak``,
   ``reserved_bytes.all.current``, ``inactive_split_bytes.all.current``) after;
   NVML's figure for this process (or the device, if NVML does not list
   processes), and ``context = NVML used − reserved``. This is the truth.
2. ``exact``: under ``memprof.profile(model, opt, mode="exact")``.
3. ``light``: under ``memprof.profile(model, opt, mode="light")`` (light mode
   resets torch's peak counters at phase boundaries, which is why the truth
   comes from the bare run, not from the counters after a memprof run).

For each memprof run: its peak total (allocated bytes at its peak) against the
bare ``max_memory_allocated``; its ``allocator_overhead`` at the peak against
``reserved − allocated``; its ``outside_torch`` against NVML − reserved; and
whether the model-state categories equal the independent sums over the
tensors (``numel × element_size`` rounded up to 512 bytes). Plus
``memprof.estimate(..., device="cuda")`` (simulated on meta tensors) against
the bare peak. Writes ``gpu-validate.json`` and ``gpu-validate.md`` into
``--out``.

``--device-matrix`` runs only the device-memory matrix of ``benchmarks/device_matrix.py``:
``memprof.estimate(..., gpu=)`` against the measured allocated, reserved and NVML peaks, for fp32, bf16
and mixed precision, flash and memory-efficient attention, with and without activation checkpointing,
with expandable segments on and off; each configuration's ratios, then the worst under-estimate.

``--allocator-source`` runs only the allocator-events check of ``benchmarks/allocator_source_check.py``: on the
benchmark GPT, the phase records reduced from the caching allocator's own events (``source="allocator"``)
against the dispatch mode's, byte for byte, and the wall clock of exact mode through allocator events against a
bare step and a do-nothing dispatch mode (paired medians of alternated runs; the target is 1.03x a bare step).
Writes ``allocator-source.json`` and ``allocator-source.md``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
import traceback
from typing import Any

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
try:
    import memprof
except ImportError:  # running from a checkout without installation
    sys.path.insert(0, os.path.join(_HERE, ".."))
    import memprof

NO_CUDA = "no CUDA device; nothing to validate"


# ---------------------------------------------------------------------------- NVML (optional)


class Nvml:
    """This process's device memory from NVML, or the device's used memory when processes are not listed."""

    def __init__(self, device: torch.device) -> None:
        self.handle: Any = None
        self.note = ""
        try:
            import pynvml  # the nvidia-ml-py distribution
        except ImportError:
            self.note = "nvidia-ml-py not installed: NVML rows not measured"
            return
        try:
            pynvml.nvmlInit()
            props = torch.cuda.get_device_properties(device)
            uuid = getattr(props, "uuid", None)
            if uuid is not None:
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(("GPU-" + str(uuid)).encode())
            else:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self.pynvml = pynvml
        except Exception as exc:  # NVML absent in the container, driver mismatch, ...
            self.handle = None
            self.note = f"NVML unavailable: {exc}"

    def used(self) -> tuple["int | None", str]:
        """(bytes, source): source is 'process' or 'device' (whole GPU, when this PID is not listed)."""
        if self.handle is None:
            return None, "not measured"
        nv = self.pynvml
        try:
            for p in nv.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if p.pid == os.getpid() and p.usedGpuMemory is not None:
                    return int(p.usedGpuMemory), "process"
            return int(nv.nvmlDeviceGetMemoryInfo(self.handle).used), "device"
        except Exception as exc:
            return None, f"error: {exc}"


# ---------------------------------------------------------------------------- one run


def _clean(device: torch.device) -> int:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def _round512(n: int) -> int:
    return (n + 511) // 512 * 512


def _states_truth(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Independent sums: bytes of weights, buffers, grads, optimizer state, each storage rounded to 512 B."""
    def size(t: torch.Tensor) -> int:
        return _round512(t.untyped_storage().nbytes())

    params = {id(p): p for p in model.parameters()}
    out = {
        "weights": sum(size(p) for p in params.values()),
        "buffers": sum(size(b) for b in {id(b): b for b in model.buffers()}.values()),
        "gradients": sum(size(p.grad) for p in params.values() if p.grad is not None),
        "optimizer_states": 0,
    }
    seen: set[int] = set()
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                key = v.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    out["optimizer_states"] += size(v)
    return out


def run_once(acc: Any, model_name: str, precision: str, optimizer: str, mode: str, steps: int, scale: int,
             device: torch.device, nvml: Nvml) -> dict[str, Any]:
    leftover = _clean(device)
    case = acc.build_case(model_name, False, device, scale=scale)
    acc.apply_precision(case, precision)
    opt = acc.make_optimizer(optimizer, case.model.parameters())
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    rep = None
    if mode == "bare":
        acc.train_steps(case, opt, steps, precision)
    else:
        with memprof.profile(case.model, opt, mode=mode) as prof:
            acc.train_steps(case, opt, steps, precision)
        rep = prof.report()
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    stats = torch.cuda.memory_stats(device)
    nv_used, nv_src = nvml.used()
    reserved_now = torch.cuda.memory_reserved(device)
    out: dict[str, Any] = {
        "mode": mode,
        "seconds": seconds,
        "allocated_before_build": leftover,
        "max_memory_allocated": torch.cuda.max_memory_allocated(device),
        "max_memory_reserved": torch.cuda.max_memory_reserved(device),
        "memory_allocated_end": torch.cuda.memory_allocated(device),
        "memory_reserved_end": reserved_now,
        "allocated_bytes.all.peak": stats.get("allocated_bytes.all.peak"),
        "reserved_bytes.all.peak": stats.get("reserved_bytes.all.peak"),
        "reserved_bytes.all.current": stats.get("reserved_bytes.all.current"),
        "inactive_split_bytes.all.current": stats.get("inactive_split_bytes.all.current"),
        "inactive_split_bytes.all.peak": stats.get("inactive_split_bytes.all.peak"),
        "nvml_used": nv_used,
        "nvml_source": nv_src,
        "nvml_minus_reserved": (nv_used - reserved_now) if nv_used is not None else None,
        "tensor_sums_end": _states_truth(case.model, opt),
    }
    if rep is not None:
        C = memprof.Category
        out["memprof_peak"] = {c.value: rep.peak[c] for c in C}
        out["memprof_peak_total"] = rep.peak.total
        out["memprof_end"] = {c.value: rep.trace.end[c] for c in C}
        out["memprof_peak_where"] = {"step": rep.trace.peak_step,
                                     "phase": rep.trace.peak_phase.value if rep.trace.peak_phase else None}
        out["memprof_notes"] = list(rep.trace.notes)
    del case, opt, rep
    return out


def validate_case(acc: Any, model_name: str, precision: str, optimizer: str, steps: int, scale: int,
                  device: torch.device, nvml: Nvml) -> dict[str, Any]:
    res: dict[str, Any] = {"model": model_name, "precision": precision, "optimizer": optimizer}
    for mode in ("bare", "exact", "light"):
        try:
            res[mode] = run_once(acc, model_name, precision, optimizer, mode, steps, scale, device, nvml)
        except Exception as exc:
            res[mode] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    try:
        _clean(device)
        case = acc.build_case(model_name, False, "cpu", scale=scale)
        acc.apply_precision(case, precision)
        est = memprof.estimate(case.model, lambda ps: acc.make_optimizer(optimizer, ps), inputs=case.inputs,
                               targets=case.targets, loss_fn=case.loss_fn, device="cuda",
                               precision="amp" if precision == "amp" else None, steps=steps)
        res["estimate_cuda"] = {"peak_bytes": est.peak_bytes,
                                "simulated": {c.value: est.peak[c] for c in memprof.Category},
                                "notes": list(est.notes)}
    except Exception as exc:
        res["estimate_cuda"] = {"error": f"{type(exc).__name__}: {exc}"}
    bare = res.get("bare", {})
    truth = bare.get("max_memory_allocated")
    checks: dict[str, Any] = {}
    for mode in ("exact", "light"):
        r = res.get(mode, {})
        if "memprof_peak_total" in r and truth:
            checks[f"{mode}_peak_vs_max_allocated_pct"] = 100.0 * (r["memprof_peak_total"] - truth) / truth
        if "memprof_end" in r:
            end = r["memprof_end"]
            sums = r["tensor_sums_end"]
            checks[f"{mode}_model_states_equal_tensor_sums"] = all(end.get(k) == v for k, v in sums.items())
            if r.get("nvml_minus_reserved") is not None and end.get("outside_torch") is not None:
                checks[f"{mode}_outside_torch_vs_nvml_minus_reserved"] = end["outside_torch"] - r["nvml_minus_reserved"]
            oh = end.get("allocator_overhead")
            res_end, alloc_end = r.get("memory_reserved_end"), r.get("memory_allocated_end")
            if oh is not None and res_end is not None:
                checks[f"{mode}_overhead_end_vs_reserved_minus_allocated"] = oh - (res_end - alloc_end)
    est_peak = res.get("estimate_cuda", {}).get("peak_bytes")
    if est_peak and truth:
        checks["estimate_vs_max_allocated_pct"] = 100.0 * (est_peak - truth) / truth
    res["checks"] = checks
    return res


# ---------------------------------------------------------------------------- output


def _mib(n: "float | None") -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def _pct(v: "float | None") -> str:
    return "n/a" if v is None else f"{v:+.1f} %"


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "All sizes MiB. *bare*: torch's counters in a run without memprof (the truth). "
        "*exact*, *light*: memprof's peak total and its difference from bare max_memory_allocated.",
        "",
        "| model | precision | optimizer | bare max_allocated | bare max_reserved | inactive split (end) "
        "| NVML used | NVML − reserved | exact peak | exact vs bare | light peak | light vs bare "
        "| memprof outside_torch (exact, end) | estimate(cuda) peak | estimate vs bare "
        "| model states = tensor sums (exact/light) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        b, f, li, ch = r.get("bare", {}), r.get("exact", {}), r.get("light", {}), r.get("checks", {})
        if "error" in b:
            lines.append(f"| {r['model']} | {r['precision']} | {r['optimizer']} | error: {b['error'][:80]} |")
            continue
        est = r.get("estimate_cuda", {})
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['optimizer']} | {_mib(b.get('max_memory_allocated'))} "
            f"| {_mib(b.get('max_memory_reserved'))} | {_mib(b.get('inactive_split_bytes.all.current'))} "
            f"| {_mib(b.get('nvml_used'))} ({b.get('nvml_source')}) | {_mib(b.get('nvml_minus_reserved'))} "
            f"| {_mib(f.get('memprof_peak_total')) if 'error' not in f else 'error'} "
            f"| {_pct(ch.get('exact_peak_vs_max_allocated_pct'))} "
            f"| {_mib(li.get('memprof_peak_total')) if 'error' not in li else 'error'} "
            f"| {_pct(ch.get('light_peak_vs_max_allocated_pct'))} "
            f"| {_mib((f.get('memprof_end') or {}).get('outside_torch'))} | {_mib(est.get('peak_bytes'))} "
            f"| {_pct(ch.get('estimate_vs_max_allocated_pct'))} "
            f"| {ch.get('exact_model_states_equal_tensor_sums')}/{ch.get('light_model_states_equal_tensor_sums')} |")
    errors = [(r, m) for r in results for m in ("bare", "exact", "light", "estimate_cuda")
              if isinstance(r.get(m), dict) and "error" in r[m]]
    if errors:
        lines += ["", "Errors:", ""]
        lines += [f"- {r['model']}/{r['precision']}/{r['optimizer']} {m}: {r[m]['error']}" for r, m in errors]
    return "\n".join(lines) + "\n"


def oom_check(device: torch.device) -> dict[str, Any]:
    """The OOM forensics path on the device itself: ``oom_dump=`` with torch's OOM observer. A request
    larger than the device is made inside a profile with memory history on; the dump must hold the
    allocator's exact request, the free and total memory, a snapshot beside it, and the snapshot's
    blocks at the parameters' addresses must be attributed to weights."""
    import tempfile

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    total = torch.cuda.get_device_properties(device).total_memory
    too_much = total + (1 << 30)
    out: dict[str, Any] = {"requested": too_much}
    folder = tempfile.mkdtemp(prefix="memprof-oom-check-")
    torch.cuda.memory._record_memory_history(max_entries=10000)
    began = time.perf_counter()
    prof = None
    try:
        with memprof.profile(model, oom_dump=folder) as prof:
            model(torch.randn(64, 256, device=device)).sum().backward()
            torch.empty(too_much, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        out["seconds_to_leave_block"] = round(time.perf_counter() - began, 3)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    if prof is None or prof.oom_dump_path is None:
        out["error"] = "no dump written"
        return out
    report = memprof.load(prof.oom_dump_path)
    oom = report.trace.oom
    out.update({"dump": os.path.basename(prof.oom_dump_path), "observer_requested": oom.requested,
                "device_free": oom.device_free, "device_total": oom.device_total, "snapshot": oom.snapshot})
    weights_truth = sum(_round512(p.untyped_storage().nbytes()) for p in model.parameters())
    if oom.snapshot:
        frame = report.attribute_snapshot(os.path.join(folder, oom.snapshot))
        by_cat = frame.groupby("category")["size"].sum().to_dict() if len(frame) else {}
        out["snapshot_bytes_by_category"] = {k: int(v) for k, v in by_cat.items()}
        out["weights_truth_rounded"] = weights_truth
    out["ok"] = bool(oom.requested and oom.requested >= too_much and oom.device_total == total and oom.snapshot
                     and out.get("snapshot_bytes_by_category", {}).get("weights", 0) >= weights_truth)
    return out


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results",
                    help="folder for gpu-validate.json and gpu-validate.md (default results/)")
    ap.add_argument("--models", default=None, help="comma list (default: the whole zoo of accuracy.py)")
    ap.add_argument("--precisions", default="fp32,bf16,amp")
    ap.add_argument("--optimizers", default="adamw,sgd")
    ap.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    ap.add_argument("--scale", type=int, default=4, help="multiply accuracy.py's batch sizes (default 4)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--only-oom", action="store_true", help="run only the OOM forensics check (seconds)")
    ap.add_argument("--device-matrix", action="store_true",
                    help="only the device-memory matrix (benchmarks/device_matrix.py): estimate(gpu=) against measured "
                         "allocated, reserved and NVML peaks over precision x attention x checkpointing x expandable "
                         "segments, each in a fresh process; writes device-matrix.json")
    ap.add_argument("--allocator-source", action="store_true",
                    help="only the allocator-events check (benchmarks/allocator_source_check.py): source='allocator' "
                         "against the dispatch mode byte for byte, and its wall clock against a bare step; writes "
                         "allocator-source.json and allocator-source.md")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print(NO_CUDA)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu-validate.json"), "w") as fh:
                json.dump({"status": NO_CUDA, "torch": torch.__version__,
                           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}, fh, indent=1)
        return 0

    if args.allocator_source:
        import allocator_source_check as check  # benchmarks/allocator_source_check.py

        result = check.run_check(torch.device(args.device))
        text = check.markdown(result)
        print(text)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "allocator-source.json"), "w") as fh:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), **result}, fh, indent=1)
        with open(os.path.join(args.out, "allocator-source.md"), "w") as fh:
            fh.write(text)
        return 0
    if args.device_matrix:
        from device_matrix import run_matrix  # benchmarks/device_matrix.py

        rows = run_matrix(args.steps)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "device-matrix.json"), "w") as fh:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "results": rows}, fh, indent=1)
        return 0
    import accuracy as acc  # the zoo: benchmarks/accuracy.py

    device = torch.device(args.device)
    torch.cuda.set_device(device)
    models = [m.strip() for m in (args.models or ",".join(acc.MODELS)).split(",") if m.strip()]
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    for m in models:
        if m not in acc.MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(acc.MODELS)}")
    torch.zeros(1, device=device)  # create the CUDA context before NVML looks for this process
    nvml = Nvml(device)
    info = {
        "gpu": torch.cuda.get_device_name(device),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "memprof": memprof.__version__,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["python", os.path.relpath(__file__)] + (sys.argv[1:] if argv is None else argv)),
        "nvml_note": nvml.note,
    }
    print(f"# {info['gpu']}, CUDA {info['cuda']}, torch {info['torch']}; {nvml.note or 'NVML available'}", flush=True)
    t_all = time.perf_counter()
    results = []
    oom = oom_check(device)
    info["oom_check"] = oom
    print(f"OOM forensics: {'ok' if oom.get('ok') else 'FAILED'} {json.dumps(oom)}", flush=True)
    if args.only_oom:
        models = []
    for m in models:
        for p in precisions:
            for o in optimizers:
                r = validate_case(acc, m, p, o, args.steps, args.scale, device, nvml)
                results.append(r)
                ch = r["checks"]
                print(f"{m:5s} {p:5s} {o:6s} bare max_alloc {_mib(r.get('bare', {}).get('max_memory_allocated'))} MiB; "
                      f"exact {_pct(ch.get('exact_peak_vs_max_allocated_pct'))}, light "
                      f"{_pct(ch.get('light_peak_vs_max_allocated_pct'))}, estimate "
                      f"{_pct(ch.get('estimate_vs_max_allocated_pct'))}", flush=True)
    info["seconds_total"] = round(time.perf_counter() - t_all, 1)
    md = markdown(results)
    print()
    print(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu-validate.json"), "w") as fh:
        json.dump({"machine": info, "results": results}, fh, indent=1)
    with open(os.path.join(args.out, "gpu-validate.md"), "w") as fh:
        fh.write(f"Command: `{info['command']}`; {info['gpu']}, CUDA {info['cuda']}, torch {info['torch']}, "
                 f"{info['date']}, {info['seconds_total']} s.\n\n" + md
                 + f"\nOOM forensics ({'ok' if oom.get('ok') else 'FAILED'}): `{json.dumps(oom)}`\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
