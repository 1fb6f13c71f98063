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

    def real(keep_loss):
        model = _build().to(dtype)
        opt = torch.optim.AdamW(model.parameters())
        with memprof.profile(model, opt) as prof:
            for _ in range(2):
                loss = model(x).sum()
                loss.backward()
                if not keep_loss:
                    del loss
                opt.step()
                opt.zero_grad()
            if keep_loss:
                del loss  # the loop has ended: its last loss is released, as the estimate's loop releases it
        return prof.report().trace

    assert est.trace.peak == real(keep_loss=True).peak  # every category, to the byte
    # The peak is AdamW's step, with the step's 16-bit loss held (a 0-dim tensor: 2 bytes of temporaries), as a
    # loop that logs its loss after the step holds it; a loop that drops it before the step peaks 2 bytes lower.
    assert est.trace.peak_phase is memprof.Phase.OPTIMIZER
    dropped = real(keep_loss=False).peak
    assert est.trace.peak.total - dropped.total == 2
    assert est.trace.peak[memprof.Category.TEMPORARIES] - dropped[memprof.Category.TEMPORARIES] == 2
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


def _tiny_gpt():
    from memprof.demo import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(vocab=100, hidden=64, layers=2, heads=2, max_seq=32, dropout=0.1)


@pytest.mark.parametrize("precision, dtype", [("mixed", torch.bfloat16), ("amp", torch.bfloat16),
                                              ("mixed-fp16", torch.float16)])
def test_mixed_precision_on_a_cpu_target_equals_a_real_autocast_run(precision, dtype):
    from memprof.demo import TinyGPT, synthetic_tokens

    x, y = synthetic_tokens(4, 32, 100, seed=0)
    est = memprof.estimate(_tiny_gpt(), lambda ps: torch.optim.AdamW(ps), inputs=x, targets=y, loss_fn=TinyGPT.loss,
                           device="cpu", precision=precision)
    model = _tiny_gpt()
    opt = torch.optim.AdamW(model.parameters())
    # mixed-fp16 is the fp16 recipe: torch.amp.GradScaler scales the loss and unscales the gradients in place.
    scaler = torch.amp.GradScaler("cpu") if precision == "mixed-fp16" else None
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=dtype):
                loss = TinyGPT.loss(model(x), y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
        del loss  # the loop has ended: its last loss is released, as the estimate's loop releases it
    # Every category at the peak, to the byte: 16-bit activations, the cached 16-bit weight copies, fp32 states
    # (and for mixed-fp16 the scaler's scale, growth tracker and inf flag).
    assert est.trace.peak == prof.report().trace.peak
    assert any("CPU autocast" in n for n in est.notes)
    # Phase by phase too, not only at the peak.
    assert [p.peak for p in est.trace.phases] == [p.peak for p in prof.report().trace.phases]
    assert est.trace.autocast_dtype == str(dtype).replace("torch.", "")
def test_mixed_precision_on_a_cuda_target_runs_cudas_autocast_policy():
    # Linear(16,16) -> LayerNorm(16) -> ReLU -> Linear(16,4), batch 4096; every size below is a multiple of 512,
    # so the CUDA target's rounding changes nothing.
    est = memprof.estimate(_build(), None, inputs=torch.randn(4096, 16), device="cuda", precision="mixed")
    assert any("CUDA's autocast policy in bfloat16" in n for n in est.notes)
    assert est.trace.autocast_dtype == "bfloat16"
    forward = est.trace.phases[0]
    # Saved by the end of the forward, by CUDA's lists (aten/src/ATen/autocast_mode.h):
    #   linear 1 (16-bit): the bf16 cast of x for the weight's gradient      4096*16*2 = 131,072
    #   layer_norm (fp32 list): its input cast back to fp32                  4096*16*4 = 262,144
    #                           mean and rstd                              2*4096*4   =  32,768
    #   relu: its fp32 output                                                4096*16*4 = 262,144
    #   linear 2 (16-bit): the bf16 cast of relu's output                    4096*16*2 = 131,072
    #                      its bf16 weight copy (16*4*2 = 128 B -> a 512-byte block)        512
    # 819,712 B: more than the fp32 run's 557,056 at peak, as on a GPU, where autocast's fp32 LayerNorm keeps
    # an fp32 copy of its bf16 input.
    assert forward.end["activations"] == 131072 + 262144 + 32768 + 262144 + 131072 + 512
    assert dict(forward.tags_end)["norm_statistics"] == 32768
    assert dict(forward.tags_end)["autocast_weight_copy"] == 512
