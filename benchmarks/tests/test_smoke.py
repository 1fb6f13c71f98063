"""The benchmark scripts run end to end with tiny sizes and write their outputs.

Each runs as a subprocess, as a user runs it (``python benchmarks/<script>.py``),
with the --quick sizes; together they take about a minute on 2 CPU cores, which is why they run apart from the
test suite: ``python -m pytest -q -n auto benchmarks/tests`` (CI runs both).
"""

import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _run(args, timeout=120):
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def test_accuracy_quick(tmp_path):
    out_json, out_md = tmp_path / "acc.json", tmp_path / "acc.md"
    _run([BENCH / "accuracy.py", "--quick", "--models", "mlp,gpt", "--precisions", "fp32,bf16",
          "--optimizers", "adamw", "--json", out_json, "--markdown", out_md])
    data = json.loads(out_json.read_text())
    assert [(r["model"], r["precision"]) for r in data["results"]] == [
        ("mlp", "fp32"), ("mlp", "bf16"), ("gpt", "fp32"), ("gpt", "bf16")]
    for r in data["results"]:
        assert r["measured_peak"] > 0 and r["simulated_peak"] > 0
        steady = r["reconcile"]["steady"]["categories"]
        # Model states at the end of an optimizer step are exactly the formula (fp32 and bf16 alike).
        assert [steady[c]["gap"] for c in ("weights", "gradients", "optimizer_states")] == [0, 0, 0]
    assert "| model | precision | optimizer |" in out_md.read_text()


def test_estimate_scale_quick(tmp_path):
    out_json = tmp_path / "scale.json"
    _run([BENCH / "estimate_scale.py", "--quick", "--json", out_json])
    data = json.loads(out_json.read_text())
    assert not data["failures"]
    (r,) = data["results"]
    assert r["config"] == "tiny" and r["parameters"] > 0
    assert r["predicted_peak_bytes"] > 0 and r["ru_maxrss_kib"] > 0
    assert r["bytes_per_param_adamw"] == 8.0
    # Steady model states of a bf16 AdamW run: at least the textbook 8 B/param; more by the `step`
    # counters and the 512-byte rounding of each tensor the estimate applies for a CUDA target.
    steady = sum(r["simulated_steady"][c] for c in ("weights", "gradients", "optimizer_states"))
    assert steady >= r["textbook_model_states_bytes"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-CUDA path")
def test_gpu_validate_without_cuda(tmp_path):
    proc = _run([BENCH / "gpu_validate.py", "--out", tmp_path / "gv"], timeout=60)
    assert "no CUDA device; nothing to validate" in proc.stdout
    data = json.loads((tmp_path / "gv" / "gpu-validate.json").read_text())
    assert data["status"] == "no CUDA device; nothing to validate"


def test_overhead_quick(tmp_path):
    out_json, out_md = tmp_path / "oh.json", tmp_path / "oh.md"
    _run([BENCH / "overhead.py", "--quick", "--workloads", "gpt", "--variants",
          "memprof_exact,memprof_paused,null_dispatch,bare_control", "--no-memory", "--json", out_json,
          "--markdown", out_md])
    data = json.loads(out_json.read_text())
    (r,) = data["results"]
    assert r["workload"] == "gpt" and set(r["variants"]) == {"bare", "memprof_exact", "memprof_paused", "null_dispatch",
                                                             "bare_control"}
    # The cost of an empty profiling block, against one bare step of the demo's model.
    assert data["session"]["empty_block_ms"] > 0 and data["session"]["bare_step_ms"] > 0
    for v in r["variants"].values():
        # Three estimates of the same ratio, each from the timed rounds.
        assert len(v["round_times_s"]) == 2 and all(t > 0 for t in v["round_times_s"])
        assert v["ratio_to_bare"] > 0 and v["paired_ratio"] > 0 and v["ratio_of_best_rounds"] > 0
        # The interval of the paired median holds the median (over two rounds: between the two ratios).
        lo, hi = v["paired_ratio_ci95"]
        ratios = [t / b for t, b in zip(v["round_times_s"], r["variants"]["bare"]["round_times_s"])]
        assert min(ratios) <= lo <= v["paired_ratio"] <= hi <= max(ratios)
    assert r["variants"]["bare"]["paired_ratio"] == 1.0 and r["variants"]["bare"]["paired_ratio_ci95"] == [1.0, 1.0]
    assert "median over rounds of (variant / bare of the same round)" in out_md.read_text()


def test_overhead_breakdown_quick(tmp_path):
    out_json = tmp_path / "bd.json"
    _run([BENCH / "overhead_breakdown.py", "--quick", "--json", out_json])
    data = json.loads(out_json.read_text())
    counts = data["machine"]["dispatched_ops_per_step"]
    # Every phase of the step runs ops; the for-loop AdamW step alone dispatches several per parameter.
    assert set(counts) == {"forward", "backward", "optimizer"} and min(counts.values()) > 0
    assert counts["optimizer"] > 4 * 52  # 52 parameter tensors in the 4-layer model (tied embedding once)
    assert set(data["variants"]) >= {"bare", "exact", "light", "null_dispatch", "hooks_only"}
    assert len(data["costs_ms"]) == 5


def test_light_mode_parts_quick(tmp_path):
    out_json, out_md = tmp_path / "parts.json", tmp_path / "parts.md"
    _run([BENCH / "light_mode_parts.py", "--quick", "--json", out_json, "--markdown", out_md])
    data = json.loads(out_json.read_text())
    assert set(data["variants"]) == {"bare", "bare_control", "saved_tensor_hooks_identity",
                                     "saved_tensor_hooks_detached", "module_forward_hooks", "grad_hooks",
                                     "all_mechanisms", "memprof_light"}
    assert data["variants"]["bare"]["wall_ratio"] == 1.0 and data["variants"]["bare"]["cpu_ratio"] == 1.0
    assert all(v["wall_ms"] > 0 and v["cpu_ms"] > 0 for v in data["variants"].values())
    assert "| memprof_light |" in out_md.read_text()


def test_long_run_quick(tmp_path):
    out_json = tmp_path / "lr.json"
    _run([BENCH / "long_run.py", "--quick", "--steps", "600", "--light-steps", "800", "--json", out_json], timeout=300)
    r = json.loads(out_json.read_text())["results"]
    assert r["exact"]["steps"] == 600 and r["exact"]["report_lines"] <= 80
    assert r["exact"]["steps_kept_in_full"] <= 5 and r["exact"]["trace_bytes"] > 0
    assert [run["steps"] for run in r["light"]] == [500, 800]


def test_exports_quick(tmp_path):
    out_json = tmp_path / "ex.json"
    _run([BENCH / "exports.py", "--quick", "--json", out_json], timeout=300)
    r = json.loads(out_json.read_text())["results"]
    assert r["plain"]["steps"] == 300 and r["scheduled"]["steps_kept"] > r["plain"]["steps_kept"]
    assert all(r["plain"][f"{k}_bytes"] > 0 for k in ("chrome", "memory_viz", "html"))
    assert r["oom"]["dumps"] == 1 and r["oom"]["seconds"] > 0


def test_generation_scale_quick(tmp_path):
    out_json = tmp_path / "generation.json"
    _run([BENCH / "generation_scale.py", "--quick", "--json", out_json])
    (r,) = json.loads(out_json.read_text())["results"]
    assert r["config"] == "tiny" and r["prompt_len"] == 32 and r["max_new_tokens"] == 32
    # The simulated cache at the end of generation is the formula's: 2 x 2 layers x 8 x 63 tokens x 2 x 16 x 2 B.
    assert r["kv_cache_end_bytes"] == r["kv_cache_formula_bytes"] == 2 * 2 * 8 * 63 * 2 * 16 * 2


def test_plan_scale_quick(tmp_path):
    out_json = tmp_path / "plan.json"
    _run([BENCH / "plan_scale.py", "--quick", "--json", out_json])
    data = json.loads(out_json.read_text())
    (row,) = data["plan_rows"]
    assert row["parallel"] == "fsdp" and row["max_batch_size"] >= 1 and row["verified"]
    assert data["estimate"]["breakdown"]["weights"] > 0


def test_published_quick(tmp_path):
    # The --quick rows on 2-layer BERTs: the script's code paths (the 2022 HF Trainer's loop in fp32 and fp16, with
    # and without checkpointing; every counter's reading; the other estimators) in 10 s instead of 60; the rows at
    # full size, whose errors are the published comparison, are `python benchmarks/published.py --quick`.
    out_json, out_md = tmp_path / "pub.json", tmp_path / "pub.md"
    _run([BENCH / "published.py", "--quick", "--layers", "2", "--json", out_json, "--markdown", out_md], timeout=400)
    data = json.loads(out_json.read_text())
    assert not data["failures"] and data["layers_override"] == 2
    assert "every model cut to 2 layers" in out_md.read_text()
    # The --quick rows, in the data file's order.
    assert [r["id"] for r in data["results"]] == ["bert-l-fp32-b1-ga4", "bert-l-fp32-b1-ga4-gc", "bert-l-fp16-b1-ga4-gc"]
    rows = {r["id"]: r for r in json.loads((BENCH / "published_rows.json").read_text())["rows"]}
    for r in data["results"]:
        # The published figure is the row's, in bytes: MiB from the source's nvidia-smi reading.
        assert rows[r["id"]]["unit"] == "MiB" and r["published_bytes"] == rows[r["id"]]["published"] * 2**20
        # nvidia-smi is compared with memprof's device peak: peak reserved + memory outside torch.
        parts = r["memprof_parts"]
        assert r["counter"] == "nvidia-smi" and r["memprof_bytes"] == parts["device_peak"]
        assert parts["device_peak"] == parts["peak_reserved"] + parts["outside_torch"]
        assert parts["peak_reserved"] >= parts["peak_allocated"] > 0
        assert r["memprof_error_pct"] == round(100 * (r["memprof_bytes"] - r["published_bytes"])
                                               / r["published_bytes"], 2)
        # accelerate's "Training using Adam" is 4 x the fp32 model size for float32 and 2 x for float16 (its
        # estimate_training_usage), the fp32 size being 4 B per parameter plus the buffers.
        acc = r["others"]["accelerate"]["bytes"]
        factor = 4 if r["id"].startswith("bert-l-fp32") else 2
        assert acc % factor == 0 and acc // factor >= 4 * r["parameters"]
    summary = data["summary"]["memprof"]
    assert summary["rows"] == 3 and 0 <= summary["under_estimates"] <= 3
    assert "| estimator | median abs. error |" in out_md.read_text()


def test_all_mechanisms_is_light_modes_floor_and_leaves_nothing_behind():
    # light_mode_parts' "all_mechanisms" stands for what light mode installs, with nothing in it: the saved-tensor
    # pair only inside the model's call (the loss outside it saves through no pair), hooks on every module and
    # parameter, all gone after.
    sys.path.insert(0, str(BENCH))
    import light_mode_parts
    from overhead import build_workload

    wl = build_workload("gpt", torch.device("cpu"), True)
    inp, target = wl.batch
    with light_mode_parts._all_mechanisms(wl.model)():
        logits = wl.model(inp)
        loss = wl.loss_fn(logits, target)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # popped at the model's end
        # The loss's own node saved outside the model's call: no pair packed it.
        assert all(getattr(loss.grad_fn, name).unpack_hook is None
                   for name in dir(loss.grad_fn) if name.startswith("_raw_saved_")
                   and getattr(loss.grad_fn, name) is not None)
        # The head's matrix multiply saved inside it: the pair packed its input.
        node = logits.grad_fn
        while not any(n.startswith("_raw_saved_") for n in dir(node)):
            node = node.next_functions[0][0]
        raw = [getattr(node, n) for n in dir(node) if n.startswith("_raw_saved_")]
        assert any(r is not None and not isinstance(r, (list, tuple)) and r.unpack_hook is not None for r in raw)
        loss.backward()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in wl.model.modules())
    assert all(not p._post_accumulate_grad_hooks for p in wl.model.parameters())
