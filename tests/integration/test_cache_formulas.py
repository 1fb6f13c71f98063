"""The cache formulas against measured caches, architecture by architecture.

Each model is a tiny config of a transformers class on CPU, generating 8 tokens greedily after a prompt of 12
(batch 2, fp32). For each: memprof's cache at the end of every call equals the cache object's own storages
(tests/helpers.py's CacheOracle, storages deduplicated), its cache at the generation's peak is one the cache
object held at some op of that call, and the formula equals the measured cache at the peak and at the end (and
at every call's start, peak and end). The end's bytes are also written out as arithmetic.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import memprof
from memprof import Category as C
from memprof.vocabulary import Phase
from memprof.analyse.reconciler.formula import formula_at

from helpers import CacheOracle

transformers = pytest.importorskip("transformers")
T = transformers
# Attention shapes shared by the decoder-only models: 2 key/value heads of 8, 2 layers, vocabulary 64.
H = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
# Bytes of one layer's keys and values per token: K and V x batch 2 x 2 heads x 8 x 4 B.
KV = 2 * 2 * 2 * 8 * 4
# The Mamba-2 mixers below: inner width 64, one group, state 4, kernel 4, 4 heads of 16.
MAMBA2_LAYER = 2 * (64 + 2 * 4) * 4 * 4 + 2 * 4 * 16 * 4 * 4  # conv (batch, 72, 4) + state (batch, 4, 16, 4), fp32

ZOO = {
    # Grouped-query attention: 19 tokens (12 + the 7 new tokens fed back) in both layers.
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, **H)), 2 * 19 * KV),
    # A window of 8: each layer keeps min(18, 7) + 1 = 8 tokens after the last decode call.
    "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(num_hidden_layers=2, sliding_window=8, **H)), 2 * 8 * KV),
    # One sliding layer (8 tokens) and one full layer (19).
    "gemma3": (lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        num_hidden_layers=2, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"], **H)),
        (8 + 19) * KV),
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(num_hidden_layers=2, num_local_experts=4,
                                                             num_experts_per_tok=2, **H)), 2 * 19 * KV),
    "qwen2-moe": (lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, **H)), 2 * 19 * KV),
    # Multi-head latent attention: the latent (16) and the rotary key (8) per token and layer, one "head".
    "deepseek-v3": (lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=64, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1)), 2 * 2 * 19 * (16 + 8) * 4),
    # Sliding and full layers; the attention sinks are a learned logit per head, nothing cached.
    "gpt-oss": (lambda: T.GptOssForCausalLM(T.GptOssConfig(
        num_hidden_layers=2, head_dim=8, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"], **H)), (8 + 19) * KV),
    # A Mamba layer (conv (2, 64, 4) and state (2, 64, 4), fp32) then an attention layer of 19 tokens.
    "jamba": (lambda: T.JambaForCausalLM(T.JambaConfig(
        num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=2, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, **H)),
        2 * 64 * 4 * 4 * 2 + 19 * KV),
    # Two Mamba layers: no growth with tokens.
    "mamba": (lambda: T.MambaForCausalLM(T.MambaConfig(num_hidden_layers=2, hidden_size=32, state_size=4,
                                                       conv_kernel=4, expand=2, vocab_size=64)),
              2 * (2 * 64 * 4 * 4 * 2)),
    "qwen3": (lambda: T.Qwen3ForCausalLM(T.Qwen3Config(num_hidden_layers=2, head_dim=8, **H)), 2 * 19 * KV),
    "phi3": (lambda: T.Phi3ForCausalLM(T.Phi3Config(num_hidden_layers=2, pad_token_id=0, **H)), 2 * 19 * KV),
    # Hybrid layers, Mamba-2 mixer (inner 32: conv (2, 40, 4), state (2, 4, 8, 4)) beside attention, in each.
    "falcon-h1": (lambda: T.FalconH1ForCausalLM(T.FalconH1Config(
        num_hidden_layers=2, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=4,
        mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=8, head_dim=8, **H)),
        2 * (2 * 40 * 4 * 4 + 2 * 4 * 8 * 4 * 4 + 19 * KV)),
    # A Mamba-2 layer, then a hybrid layer whose shared attention has 4 key/value heads of 16.
    "zamba2": (lambda: T.Zamba2ForCausalLM(T.Zamba2Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
        intermediate_size=64, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=4,
        layers_block_type=["mamba", "hybrid"], chunk_size=8, adapter_rank=4)),
        2 * MAMBA2_LAYER + 2 * 2 * 19 * 4 * 16 * 4),
    # A gated-delta-rule layer (conv (2, 64, 4), state (2, 4, 8, 8)) then an attention layer.
    "qwen3-next": (lambda: T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
        num_hidden_layers=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], **H)),
        2 * 64 * 4 * 4 + 2 * 4 * 8 * 8 * 4 + 19 * KV),
}
# Sliding-window layers after the prefill: DynamicSlidingWindowLayer keeps a view of the whole concatenation, so
# the 12 prompt tokens (not the window's 8) until the first decode call replaces it.
PREFILL_END = {"mistral": 2 * 12 * KV, "gemma3": (12 + 12) * KV, "gpt-oss": (12 + 12) * KV}
# Encoder-decoder models: 8 decoder tokens (the start token and 7 fed back) in self-attention, keys and values
# over the encoder's tokens in cross-attention (4 heads of 8), and the encoder's output (width 32) handed back.
ENC_DEC = {
    "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0)), 12),
    "whisper": (lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        max_target_positions=64, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None)), 16),
}


def _generate(model, inputs, new_tokens=8, **kwargs):
    """Profile a greedy generation of ``new_tokens`` tokens, with the cache oracle watching every op."""
    oracle = CacheOracle(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with memprof.profile(model) as prof, oracle:
                model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0, **kwargs)
    finally:
        oracle.close()
    return prof.report(), oracle


def _check(report, oracle):
    """Measured == the cache object's storages at every call's end, the peak's cache is one the cache object
    held then, and the formula == measured at every call's start, peak and end and at the global peak."""
    trace = report.trace
    calls = [p for p in trace.phases if p.phase in (Phase.PREFILL, Phase.DECODE)]
    assert [p.phase for p in calls] == [Phase.PREFILL] + [Phase.DECODE] * 7
    assert [p.end[C.KV_CACHE] for p in calls] == oracle.ends
    peak_call = next(i for i, p in enumerate(calls) if p.peak == trace.peak and p.phase is trace.peak_phase)
    assert trace.peak[C.KV_CACHE] in oracle.values[peak_call]
    for p in calls:
        for moment in ("start", "peak", "end"):
            measured = getattr(p, moment)[C.KV_CACHE]
            assert formula_at(trace, (p.step, p.phase, moment, p.occurrence))[C.KV_CACHE] == measured, (p, moment)
    row = report.reconcile(at="peak").row("kv_cache")
    assert row.formula == row.measured == trace.peak[C.KV_CACHE]
    last = calls[-1]
    row = report.reconcile(at=(last.step, "decode", "end", last.occurrence)).row("kv_cache")
    assert row.formula == row.measured == oracle.ends[-1]
    return trace


@pytest.mark.parametrize("name", list(ZOO))
def test_the_formula_is_the_measured_cache_at_the_peak_and_the_end(name):
    build, end_bytes = ZOO[name]
    torch.manual_seed(0)
    report, oracle = _generate(build().eval(), {"input_ids": torch.randint(3, 64, (2, 12))})
    _check(report, oracle)
    assert oracle.ends[-1] == end_bytes
    if name in PREFILL_END:
        assert oracle.ends[0] == PREFILL_END[name]


@pytest.mark.parametrize("name", list(ENC_DEC))
def test_an_encoder_decoder_cache_holds_self_and_cross_attention_and_the_encoders_output(name):
    build, source = ENC_DEC[name]
    torch.manual_seed(0)
    model = build().eval()
    inputs = ({"input_features": torch.randn(2, 8, 2 * source)} if name == "whisper"
              else {"input_ids": torch.randint(3, 64, (2, source))})
    report, oracle = _generate(model, inputs)
    trace = _check(report, oracle)
    assert trace.generation.encoder_tokens == source
    # Self-attention 2 layers x K,V x 2 x 8 tokens x 4 x 8 x 4 B; cross-attention the same over the encoder's
    # tokens; the encoder's output 2 x tokens x 32 x 4 B.
    assert oracle.ends[-1] == 2 * 2 * 2 * 8 * 4 * 8 * 4 + 2 * 2 * 2 * source * 4 * 8 * 4 + 2 * source * 32 * 4


def test_a_sliding_window_fills_while_decoding():
    build, _ = ZOO["mistral"]
    torch.manual_seed(0)
    report, oracle = _generate(build().eval(), {"input_ids": torch.randint(3, 64, (2, 5))})
    _check(report, oracle)
    # A prompt of 5 under the window of 8: each layer holds 5, 6, 7 tokens, then min(tokens - 1, 7) + 1 = 8.
    assert oracle.ends == [2 * n * KV for n in (5, 6, 7, 8, 8, 8, 8, 8)]


def test_a_static_cache_is_its_allocated_length_from_the_first_call():
    build, _ = ZOO["gemma3"]
    torch.manual_seed(0)
    model = build().eval()
    cache = T.StaticCache(config=model.config, max_cache_len=32)
    report, oracle = _generate(model, {"input_ids": torch.randint(3, 64, (2, 12)), "past_key_values": cache})
    trace = _check(report, oracle)
    assert trace.generation.max_cache_len == 32
    # A full layer of 32 tokens and a sliding layer of min(32, 8) tokens, from the prefill on.
    assert oracle.ends[0] == oracle.ends[-1] == (32 + 8) * KV
