"""estimate(precision="bf16"/"fp16") on every target: it crashed for CPU targets (fake tensors cannot be
cast after they are made); on a CPU target it equals a real run at that precision to the byte."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memprof
from memprof.cli import main


def _build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_a_cpu_target_equals_a_real_run_at_that_precision(precision, dtype):
    x = torch.randn(8, 16)
    # fp32 inputs: the estimate casts floating inputs as it casts the model, as a 16-bit run feeds them.
    est = memprof.estimate(_build(), lambda ps: torch.optim.AdamW(ps), inputs=x, device="cpu", precision=precision)
    x = x.to(dtype)
    model = _build().to(dtype)
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert est.trace.peak == prof.report().trace.peak  # every category, to the byte
    # Weights in 16 bits: (16*16 + 16 + 16 + 16 + 16*4 + 4) elements * 2 bytes = 372 * 2 = 744 bytes.
    assert est.trace.peak[memprof.Category.WEIGHTS] == 744


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_cuda_target_simulates_16_bit_weights(precision):
    est = memprof.estimate(_build(), lambda ps: torch.optim.AdamW(ps), inputs=torch.randn(8, 16), device="cuda",
                           precision=precision)
    # 6 parameter tensors of 16-bit elements, each rounded up to the caching allocator's 512 bytes.
    assert est.trace.peak[memprof.Category.WEIGHTS] == 6 * 512


def test_the_cli_estimates_in_16_bits(tmp_path, monkeypatch, capsys):
    (tmp_path / "zoo16.py").write_text(
        "import torch\n"
        "def build(batch_size):\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))\n"
        "    return {'model': model, 'inputs': torch.randn(batch_size, 16)}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["estimate", "zoo16:build", "--batch-size", "4", "--device", "cpu", "--precision", "bf16"]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("precision", ["mixed", "amp"])
def test_mixed_precision_on_a_cpu_target_equals_a_real_autocast_run(precision):
    from memprof.examples import TinyGPT, synthetic_tokens

    def build():
        torch.manual_seed(0)
        return TinyGPT(vocab=100, hidden=64, layers=2, heads=2, max_seq=32, dropout=0.1)

    x, y = synthetic_tokens(4, 32, 100, seed=0)
    est = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=x, targets=y, loss_fn=TinyGPT.loss,
                           device="cpu", precision=precision)
    model = build()
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = TinyGPT.loss(model(x), y)
            loss.backward()
            del loss  # as the estimate's loop does: the loss's 4 bytes are not held through the step
            opt.step()
            opt.zero_grad()
    # Every category at the peak, to the byte: bf16 activations, the cached bf16 weight copies, fp32 states.
    assert est.trace.peak == prof.report().trace.peak
    assert any("CPU autocast" in n for n in est.notes)
    # Phase by phase too, not only at the peak.
    assert [p.peak for p in est.trace.phases] == [p.peak for p in prof.report().trace.phases]


def test_mixed_precision_on_a_cuda_target_says_it_is_not_simulated():
    est = memprof.estimate(_build(), None, inputs=torch.randn(8, 16), device="cuda", precision="mixed")
    assert any("autocast does not apply to meta tensors" in n for n in est.notes)
