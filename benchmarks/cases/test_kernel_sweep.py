"""Every CPU rule of :mod:`memprof.simulate.cpu_kernels` against the real kernel, over torch's own operator samples
(``benchmarks/cpu_kernel_sweep.py``, two sweeps of a Python process each). The suite holds each rule to the real
kernel on its own cases (tests/integration/test_sim_cpu_kernels.py)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from memprof.simulate.cpu_kernels import MIXED_OPINFOS, RULES, SWEPT_OPINFOS

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sweep(*args):
    # Ended at 500 s, before pytest-timeout's 600 s ends the test: the failure then shows the script's output.
    proc = subprocess.run([sys.executable, "benchmarks/cpu_kernel_sweep.py", "--quiet", "--max-samples", "12", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=500)
    # Exit status 1: an output still differs with the rules, a rule breaks a fake kernel, or a sample calls other
    # ops and allocates other bytes.
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| `aten.")]
    return {row[1].strip(" `").split("[")[0]: row[-2].strip() for row in rows}


def test_every_cpu_rule_matches_the_real_kernel_over_torchs_samples():
    # The sweep over the OpInfos that reach a rule, a dozen samples of each (spread over its list) without and with
    # gradients, fp32 and bf16, then the norms and losses with a bf16 input among fp32 tensors.
    found = {**_sweep("--ops", ",".join(SWEPT_OPINFOS)), **_sweep("--mixed", "--ops", ",".join(MIXED_OPINFOS))}
    rules = {str(op) for op in RULES}
    assert set(found) <= rules  # every op whose output differs has a rule ...
    assert set(found.values()) == {"exact"}  # ... which gives every output the real kernel's bytes
    # The samples reach the rules about bytes (im2col, the layout rule and the backward ones: the cases above).
    assert {"aten.mse_loss.default", "aten.col2im.default", "aten._embedding_bag.default",
            "aten._sparse_mm_reduce_impl.default", "aten.native_batch_norm.default",
            "aten.native_group_norm.default", "aten.native_layer_norm.default", "aten.huber_loss.default"} <= set(found)
