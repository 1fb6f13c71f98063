"""A Llama layer under torch.autocast (bf16 over fp32 weights) against Korthikanti et al.'s 34sbh + 5as²b: every
byte of the gap named from the trace's facts, in a real CPU autocast run and in a CUDA-target estimate."""

from __future__ import annotations

import warnings

import pytest
import torch

import memprof
from memprof.analyse.reconciler.mixed_layers import mixed_layer_gap

T = pytest.importorskip("transformers")

# One layer: s = 16, b = 2, h = 64, a = 4 heads of d = 16 (2 key/value heads), gated MLP of width F = 96.
S, B, H, A, D, F = 16, 2, 64, 4, 16, 96
SBH, SB, AS2B = S * B * H, S * B, A * S * S * B  # 2,048, 32, 2,048
IDS = torch.zeros(B, S, dtype=torch.long)


def _llama(attention="eager"):
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=H, intermediate_size=F, num_hidden_layers=1, num_attention_heads=A,
                        num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = attention
    return T.LlamaForCausalLM(cfg)


def _causes(rounding):
    def r(x):
        return -(-x // rounding) * rounding

    return {
        # q, k, v, o: 64x64, 32x64, 32x64, 64x64; gate, up: 96x64; down 64x96; 2 B each.
        "autocast weight copies": 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 96 * 64),
        # 2 RMSNorms: fp32 input and output (4sbh each) and rstd (4sb) less the textbook's 2sbh.
        "fp32 norm inputs and outputs": 2 * (4 * SBH + 4 * SBH + r(4 * SB) - 2 * SBH),
        # q/k/v: 2 casts more; gate/up: 1; 2sbh each.
        "separate 16-bit casts of one input": 3 * 2 * SBH,
        "softmax in fp32": 4 * AS2B - 2 * AS2B,
        "no dropout: attention mask": -AS2B,
        "no dropout": -2 * SBH,
        # cos and sin: (1, s, d) fp32.
        "rotary embeddings": 2 * 4 * S * D,
        # 4 tensors of 2sbF against 16sbh.
        "gated MLP": 4 * 2 * SB * F - 16 * SBH,
    }


def test_a_real_cpu_autocast_run_names_every_byte_of_the_gap():
    model = _llama()
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with memprof.profile(model, opt) as prof:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=IDS, labels=IDS).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            del loss
    rec = prof.report().reconcile()
    gap = rec.mixed_layer
    assert gap is not None and gap.path == "model.layers.0"
    assert gap.textbook == 34 * SBH + 5 * AS2B == 79_872
    assert {name: b for name, b, _ in gap.causes} == _causes(1)
    # The layer's own saved bytes (memprof's module record) less the textbook: all of it named.
    assert gap.measured == 170_240 and gap.unexplained == 0
    assert gap.measured - gap.textbook == sum(_causes(1).values())  # 90,368 B
    text = str(rec)
    assert "textbook 34sbh + 5as²b" in text and "separate 16-bit casts of one input" in text


def test_a_cuda_target_estimate_shows_the_textbook_beside_the_causes():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = memprof.estimate(_llama(), lambda ps: torch.optim.AdamW(ps), inputs=dict(input_ids=IDS, labels=IDS),
                               loss_fn=lambda o: o.loss, device="cuda", precision="mixed", steps=1)
    gap = mixed_layer_gap(est.trace)
    # On CUDA every allocation is rounded to 512 B: each 128 B rstd takes 512.
    assert {name: b for name, b, _ in gap.causes} == _causes(512)
    assert gap.unexplained == 0 and gap.measured == 170_240 + 2 * (512 - 128)
    text = str(est)
    assert "Activations of one layer (model.layers.0; s=16, b=2, h=64, a=4, F=96)" in text
    assert "78.0 KiB" in text and "autocast weight copies" in text


def test_a_run_without_autocast_has_no_such_layer():
    model = _llama()
    with memprof.profile(model) as prof:
        model(input_ids=IDS, labels=IDS).loss.backward()
    assert prof.report().reconcile().mixed_layer is None


def test_a_fused_attention_kernel_replaces_the_s_squared_terms():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = memprof.estimate(_llama("sdpa"), lambda ps: torch.optim.AdamW(ps),
                               inputs=dict(input_ids=IDS, labels=IDS), loss_fn=lambda o: o.loss, device="cuda",
                               precision="mixed", steps=1)
    gap = mixed_layer_gap(est.trace)
    expected = _causes(512)
    for name in ("softmax in fp32", "no dropout: attention mask"):
        del expected[name]
    # The flash kernel: none of the textbook's 5as²b; an fp32 logsumexp (a x s x b x 4 = 512 B) and its 8-byte
    # philox seed and offset, 512 B each on CUDA.
    expected["fused attention"] = -5 * AS2B + 4 * A * S * B + 2 * 512
    # K and V of 2 key/value heads of 16, not 4: 2 x (2sbh - 2 x s x b x 32) = 4,096 B fewer.
    expected["grouped-query attention"] = -2 * (2 * SBH - 2 * S * B * 32)
    assert {name: b for name, b, _ in gap.causes} == expected
    assert gap.unexplained == 0
