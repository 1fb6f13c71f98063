"""Saved-bytes rules for transformers' own layer types, against what memprof measures them saving."""

from __future__ import annotations

import warnings

import pytest
import torch

import memprof
from memprof.anatomy.activations import TensorMeta, module_saved_bytes

transformers = pytest.importorskip("transformers")


def _measured(model, kwargs, dtype=torch.float32):
    model = model.to(dtype)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with memprof.profile(model, opt) as prof:
            model(**kwargs).loss.backward()
            opt.step()
    return prof.report(), model


def _check(report, model, type_name, shape, dtype):
    modules = dict(model.named_modules())
    seen = 0
    for rec in report.trace.modules:
        if rec.type != type_name:
            continue
        predicted = module_saved_bytes(modules[rec.path], TensorMeta(shape, dtype))
        assert predicted == rec.activations, (rec.path, predicted, rec.activations)
        seen += 1
    assert seen
    # No longer among the modules without a formula.
    assert type_name not in memprof.anatomy.predict_activations(report.trace).modules_without_rule


IDS = torch.randint(0, 100, (2, 16))  # b = 2, s = 16


def test_gpt2_conv1d_and_new_gelu():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    report, model = _measured(transformers.GPT2LMHeadModel(cfg), dict(input_ids=IDS, labels=IDS))
    # NewGELU on the MLP's 4h = 128 features: 4 tensors of 2 x 16 x 128 fp32 = 4 * 16,384 bytes.
    _check(report, model, "NewGELUActivation", (2, 16, 128), torch.float32)
    modules = dict(model.named_modules())
    c_attn = next(r for r in report.trace.modules if r.path.endswith("attn.c_attn"))
    # Conv1D saves its input for the weight's gradient: 2 x 16 x 32 fp32 = 4,096 bytes.
    assert module_saved_bytes(modules[c_attn.path], TensorMeta((2, 16, 32), torch.float32)) == c_attn.activations == 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_rms_norm(dtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    report, model = _measured(transformers.LlamaForCausalLM(cfg), dict(input_ids=IDS, labels=IDS), dtype)
    # fp32: input + normed (2 x 4 x 1,024) + rsqrt per row (4 x 32) = 8,320; bf16: fp32 copy (4 x 1,024)
    # + rsqrt (128) + bf16 normed (2 x 1,024) = 6,272.
    _check(report, model, "LlamaRMSNorm", (2, 16, 32), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_t5_layer_norm(dtype):
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    report, model = _measured(transformers.T5ForConditionalGeneration(cfg), dict(input_ids=IDS, labels=IDS), dtype)
    # 8 x 1,024 + 4 x 32 = 8,320 bytes in fp32 and in bf16 alike.
    _check(report, model, "T5LayerNorm", (2, 16, 32), dtype)


def test_an_estimate_names_the_mask_bytes_a_real_run_may_skip():
    """transformers builds attention masks in full on shape-only tensors where a real run checks their
    values and skips them: the estimate bounds those bytes in its notes instead of drifting silently."""
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)

    def build():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        return model

    kw = dict(input_ids=IDS, labels=IDS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=kw, loss_fn=lambda out: out.loss,
                               device="cpu")
        model = build()
        opt = torch.optim.AdamW(model.parameters())
        with memprof.profile(model, opt) as prof:  # the estimate's own loop: 2 steps, the loss not kept
            for _ in range(2):
                loss = model(**kw).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
            del loss  # the loop has ended: its last loss is released, as the estimate's loop releases it
        real = prof.report()
    (note,) = [n for n in est.notes if n.startswith("transformers.masking_utils built")]
    bound = memprof.parse_size(note.split(" built ")[1].split(" of tensors")[0])
    drift = est.trace.peak.total - real.trace.peak.total
    assert 0 < drift <= bound  # the simulation's excess is within what the note names
    assert torch._C._len_torch_function_stack() == 0


def test_a_model_without_transformers_gets_no_such_note():
    est = memprof.estimate(torch.nn.Linear(4, 4), None, inputs=torch.empty(2, 4), device="cpu")
    assert not any("masking" in n for n in est.notes)


def test_llama_silu_activation():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    report, model = _measured(transformers.LlamaForCausalLM(cfg), dict(input_ids=IDS, labels=IDS))
    # F.silu saves its input, the gate projection's output: 2 x 16 x 64 fp32 = 8,192 bytes.
    _check(report, model, "SiLUActivation", (2, 16, 64), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_copy_of_llama_rms_norm_under_another_name_takes_its_rule(dtype):
    # MistralRMSNorm is LlamaRMSNorm's code under Mistral's name ("Copied from"): found by its compiled forward.
    from memprof.anatomy.hf_rules import computes_like

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    report, model = _measured(transformers.MistralForCausalLM(cfg), dict(input_ids=IDS, labels=IDS), dtype)
    norm = type(model.model.norm)
    assert norm.__name__ == "MistralRMSNorm"
    assert computes_like(norm) == ("transformers.models.llama.modeling_llama.LlamaRMSNorm",)
    # Same bytes as LlamaRMSNorm: fp32 8,320; bf16 6,272.
    _check(report, model, "MistralRMSNorm", (2, 16, 32), dtype)


def test_a_layer_that_computes_differently_is_not_taken_for_a_copy():
    # Gemma's RMSNorm scales by (1 + weight) in fp32: different code, so no borrowed rule.
    from memprof.anatomy.hf_rules import computes_like
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    assert computes_like(GemmaRMSNorm) == ()
