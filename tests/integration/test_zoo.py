"""A zoo of the architectures people train and serve now, each pinned three ways on a tiny CPU config:

1. the measured cache equals the cache object's own tensors (tests/helpers.py's CacheOracle: an independent sum,
   storages deduplicated) at the end of every call of a real generation, and the cache at each call's peak is
   one the cache object held at some op of that call;
2. the cache formula (memprof.anatomy.caches) equals the measured cache at every call's start, peak and end;
3. the simulation equals the real run at every phase moment (each phase's start, peak and end, every
   category): a training step (a mixture of experts under its real routing replayed) and a generation.

Hidden size 32, vocabulary 64, one decoder layer where the architecture has one kind of layer, two where it mixes
kinds (sliding and full attention, Mamba and attention); batch 2, a prompt of 6, 4 new tokens (a sliding window
of 4, so the window applies from the prefill on).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import memprof
from memprof import Category as C
from memprof.analyse.reconciler.formula import formula_at
from memprof.simulate.decoding import Decoding
from memprof.simulate.generation import choosing
from memprof.vocabulary import Phase

from helpers import CacheOracle
from moe_models import T

B, P, N = 2, 6, 4
IDS = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1))
_ONE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=64)
_TWO = {**_ONE, "num_hidden_layers": 2}
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8)
_EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)

ZOO = {
    "llama-gqa": lambda: T.LlamaForCausalLM(T.LlamaConfig(**_ONE)),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**_ONE, sliding_window=4)),
    "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        **_TWO, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**_ONE, pad_token_id=0)),
    "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**_ONE, **_EXPERTS)),
    "qwen3-moe": lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        **_ONE, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=8)),
    "deepseek-v3": lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        **{**_ONE, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8)),
    "gpt-oss": lambda: T.GptOssForCausalLM(T.GptOssConfig(
        **{**_TWO, "intermediate_size": 32}, **_EXPERTS, head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"])),
    "olmoe": lambda: T.OlmoeForCausalLM(T.OlmoeConfig(**{**_ONE, "intermediate_size": 32}, num_experts=4,
                                                      num_experts_per_tok=2)),
    "granitemoe": lambda: T.GraniteMoeForCausalLM(T.GraniteMoeConfig(**{**_ONE, "intermediate_size": 32},
                                                                     **_EXPERTS)),
    "jamba": lambda: T.JambaForCausalLM(T.JambaConfig(
        **_TWO, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=0, mamba_d_state=4, mamba_dt_rank=4, mamba_expand=2,
        use_mamba_kernels=False)),
    "mamba": lambda: T.MambaForCausalLM(T.MambaConfig(vocab_size=64, hidden_size=32, state_size=4,
                                                      num_hidden_layers=1, intermediate_size=64, time_step_rank=4,
                                                      conv_kernel=4)),
    "bamba": lambda: T.BambaForCausalLM(T.BambaConfig(**_TWO, attn_layer_indices=[1], **_MAMBA2)),
    "falcon-h1": lambda: T.FalconH1ForCausalLM(T.FalconH1Config(**_ONE, mamba_d_ssm=64, **_MAMBA2)),
    "zamba2": lambda: T.Zamba2ForCausalLM(T.Zamba2Config(
        **{**_TWO, "num_key_value_heads": 4}, layers_block_type=["mamba", "hybrid"], mamba_d_state=8,
        n_mamba_heads=4, mamba_headdim=16, chunk_size=8, hybrid_layer_ids=[1])),
    "qwen3-next": lambda: T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
        **_TWO, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"])),
    "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0)),
    "whisper": lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=8,
        max_target_positions=32, decoder_start_token_id=1, pad_token_id=0)),
}


def _build(name):
    torch.manual_seed(0)
    return ZOO[name]()


def moments(trace):
    return [(p.step, p.phase, p.occurrence, p.start, p.peak, p.end) for p in trace.phases]


def _prompt_len(model):
    # Whisper's encoder takes its whole window: 2 x max_source_positions mel frames.
    return 2 * model.config.max_source_positions if model.config.model_type == "whisper" else P


@pytest.mark.parametrize("name", list(ZOO))
def test_a_generation_caches_as_its_cache_object_and_formula_say_and_simulates_exactly(name):
    model = _build(name).eval()
    prompt = _prompt_len(model)
    encdec = model.config.is_encoder_decoder
    loop = Decoding(model, B, torch.device("cpu"), chooser=choosing(model, max_length=(1 if encdec else prompt) + N))
    loop.prompt(prompt)
    oracle = CacheOracle(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad(), memprof.profile(model, record_routing=True) as prof, oracle:
                loop.prefill()
                for _ in range(N - 1):
                    loop.call(1)
    finally:
        oracle.close()
    real = prof.report()
    trace = real.trace
    calls = [p for p in trace.phases if p.phase in (Phase.PREFILL, Phase.DECODE)]
    assert [p.phase for p in calls] == [Phase.PREFILL] + [Phase.DECODE] * (N - 1)
    # 1. measured == the cache object's own storages at every call's end; each call's peak cache is one it held.
    assert [p.end[C.KV_CACHE] for p in calls] == oracle.ends
    assert oracle.ends[-1] > 0
    assert all(p.peak[C.KV_CACHE] in held for p, held in zip(calls, oracle.values))
    # 2. the formula == measured at every call's start, peak and end (so at the generation's peak and end).
    for p in calls:
        for moment in ("start", "peak", "end"):
            assert formula_at(trace, (p.step, p.phase, moment, p.occurrence))[C.KV_CACHE] == \
                getattr(p, moment)[C.KV_CACHE], (p.phase, p.occurrence, moment)
    # 3. the simulated generation == the real one (a mixture of experts under the real routing replayed).
    est = memprof.estimate_generation(_build(name), batch_size=B, prompt_len=prompt, max_new_tokens=N,
                                      device="cpu", routing=real if trace.routing.calls else None)
    assert moments(est.trace) == moments(trace)


@pytest.mark.parametrize("name", list(ZOO))
def test_a_training_step_simulates_exactly(name):
    model = _build(name)
    if model.config.is_encoder_decoder:
        inputs = ({"input_features": torch.randn(2, 8, 2 * model.config.max_source_positions)}
                  if model.config.model_type == "whisper" else {"input_ids": IDS})
        inputs["labels"] = IDS
    else:
        inputs = {"input_ids": IDS, "labels": IDS}
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with memprof.profile(model, opt, record_routing=True) as prof:
            loss = model(**inputs).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            del loss  # the loop has ended: its last loss is released, as the estimate's loop releases it
        real = prof.report()
        est = memprof.estimate(_build(name), lambda ps: torch.optim.AdamW(ps), inputs=inputs,
                               loss_fn=lambda o: o.loss, device="cpu", steps=1,
                               routing=real if real.trace.routing.calls else None)
    assert moments(est.trace) == moments(real.trace)
    assert real.trace.peak.total > 0
