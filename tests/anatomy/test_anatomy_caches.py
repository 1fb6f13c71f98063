"""The cache formulas (memprof.anatomy.caches) and cache_spec on configs, the arithmetic written out.

Shapes labelled "-shaped" are a published model's cache dimensions used as inputs; every expected figure is
the product in the comment beside it. The formulas are checked against real transformers models in
tests/integration/test_cache_formulas.py.
"""

from __future__ import annotations

import pytest

from memprof.anatomy import (CacheSpec, bytes_at, cache_bytes, cache_spec, call_slots, kv_cache_bytes,
                             latent_attention_dims, sliding_kept_tokens)
from memprof.record.cache import CacheMoment
from memprof.errors import InvalidArgumentError, TraceFormatError
from memprof.record.parts import GenerationFacts

GiB = 2**30


def test_full_attention_is_the_uniform_kv_cache():
    # Llama-2-7B-shaped: 32 layers, 32 key/value heads of 128, bf16, one sequence of 4,096 tokens:
    # 2 x 32 x 4096 x 32 x 128 x 2 B = 2 GiB.
    spec = CacheSpec(layers=("full_attention",) * 32, kv_heads=32, head_dim=128)
    assert cache_bytes(spec, 1, 4096, itemsize=2) == kv_cache_bytes(32, 1, 4096, 32, 128) == 2 * GiB
    # After a prefill of the same tokens: the same (a full layer keeps every token whatever the call).
    assert cache_bytes(spec, 1, 4096, itemsize=2, added=4096) == 2 * GiB


@pytest.mark.parametrize("before,added,window,kept", [
    (0, 12, 8, 12),   # a prefill longer than the window: the whole prompt (a view of the concatenation)
    (12, 1, 8, 8),    # the first decode call after it: the last 7 and the new one
    (5, 1, 8, 6),     # under the window: everything
    (7, 1, 8, 8),     # the window just filled
    (100, 1, 8, 8),
    (100, 3, 8, 10),  # three tokens in one call: 7 kept + 3 new
])
def test_a_sliding_layer_holds_min_of_its_tokens_and_window_minus_one_plus_the_new_ones(before, added, window,
                                                                                       kept):
    assert sliding_kept_tokens(before, added, window) == kept


def test_sliding_and_full_layers_each_keep_their_own():
    # gpt-oss-20b-shaped: 24 layers alternating sliding (window 128) and full, 8 key/value heads of 64, bf16.
    config = {"num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
              "hidden_size": 2880, "sliding_window": 128,
              "layer_types": ["sliding_attention", "full_attention"] * 12}
    spec = cache_spec(config)
    assert spec.layers == ("sliding_attention", "full_attention") * 12 and spec.sliding_window == 128
    per_token_layer = 2 * 8 * 64 * 2  # K and V x 8 heads x 64 x 2 B = 2,048 B
    # After a decode call at 32,768 tokens: 12 full layers x 32,768 tokens + 12 sliding layers x 128 tokens.
    assert cache_bytes(spec, 1, 32768, itemsize=2) == (12 * 32768 + 12 * 128) * per_token_layer == 808_452_096
    # The uniform formula counts all 24 layers at 32,768 tokens: 1,610,612,736 B, about twice as much.
    assert kv_cache_bytes(24, 1, 32768, 8, 64) == 24 * 32768 * per_token_layer == 1_610_612_736
    # After a prefill of 32,768 tokens every layer holds them all (the sliding ones until the first decode call).
    assert cache_bytes(spec, 1, 32768, itemsize=2, added=32768) == 24 * 32768 * per_token_layer


def test_multi_head_latent_attention_caches_the_latent_and_the_rotary_key():
    # DeepSeek-V3-shaped: 128 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128.
    dims = dict(num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    assert latent_attention_dims(**dims) == (1, 512, 64)  # (d_c + d_h^R) = 576 = 4.5 d_h (DeepSeek-V2, Table 1)
    assert latent_attention_dims(**dims, kept="expanded") == (128, 192, 128)  # 128 x (192 + 128) = 40,960
    config = {"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168,
              **{k: v for k, v in dims.items() if k != "num_heads"}}
    spec = cache_spec(config)
    assert (spec.kv_heads, spec.head_dim, spec.value_head_dim) == (1, 512, 64)
    # 61 layers x 4,096 tokens x 576 x 2 B, where keys and values of 128 heads would be 40,960 / 576 = 71x more.
    assert cache_bytes(spec, 1, 4096, itemsize=2) == 61 * 4096 * 576 * 2
    with pytest.raises(InvalidArgumentError, match="latent"):
        latent_attention_dims(**dims, kept="compressed")


def test_state_space_layers_keep_the_same_states_at_any_length():
    # Mamba-shaped: 64 layers, hidden 2,560, expand 2 (d_inner 5,120), d_state 16, d_conv 4; bf16 model.
    config = {"model_type": "mamba", "num_hidden_layers": 64, "hidden_size": 2560, "intermediate_size": 5120,
              "state_size": 16, "conv_kernel": 4, "expand": 2, "layer_types": ["linear_attention"] * 64}
    spec = cache_spec(config)
    assert (spec.conv_channels, spec.conv_kernel, spec.recurrent_elements) == (5120, 4, 5120 * 16)
    # Per layer and sequence: the convolution state 5,120 x 4 x 2 B and the SSM state 5,120 x 16 x 4 B (float32).
    per_layer = 5120 * 4 * 2 + 5120 * 16 * 4
    assert cache_bytes(spec, 8, 1, itemsize=2, added=1) == cache_bytes(spec, 8, 100_000, itemsize=2) \
        == 64 * 8 * per_layer


def test_hybrid_configs_place_their_attention_layers():
    # Jamba-v0.1-shaped, a plain dict: attention where i % 8 == 4, Mamba elsewhere; 8 key/value heads of 128.
    jamba = cache_spec({"num_hidden_layers": 32, "attn_layer_period": 8, "attn_layer_offset": 4, "hidden_size": 4096,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "mamba_d_state": 16, "mamba_d_conv": 4,
                        "mamba_expand": 2})
    assert [i for i, k in enumerate(jamba.layers) if k == "full_attention"] == [4, 12, 20, 28]
    assert (jamba.kv_heads, jamba.head_dim, jamba.conv_channels, jamba.recurrent_elements) == (8, 128, 8192, 8192 * 16)
    # 4 attention layers x 2 x 8 x 128 x 2 B per token, and 28 Mamba layers' fixed states.
    per_token = 4 * 2 * 8 * 128 * 2
    states = 28 * (8192 * 4 * 2 + 8192 * 16 * 4)
    assert cache_bytes(jamba, 1, 1000, itemsize=2) == 1000 * per_token + states
    bamba = cache_spec({"num_hidden_layers": 4, "attn_layer_indices": [2], "hidden_size": 64, "num_attention_heads": 4,
                        "mamba_n_heads": 8, "mamba_d_head": "auto", "mamba_n_groups": 2, "mamba_d_state": 16,
                        "mamba_d_conv": 4, "mamba_expand": 2})
    assert bamba.layers == ("linear_attention", "linear_attention", "full_attention", "linear_attention")
    # Mamba-2: a convolution over x, B and C (128 + 2 x 2 x 16 channels) and a state of 8 heads x 16 x 16.
    assert (bamba.conv_channels, bamba.recurrent_elements) == (128 + 2 * 2 * 16, 8 * 16 * 16)


def test_a_hybrid_layer_writes_in_its_models_order():
    common = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_n_groups": 1, "mamba_d_state": 4,
              "mamba_d_conv": 4, "mamba_expand": 1, "layer_types": ["hybrid"]}
    falcon = cache_spec({**common, "model_type": "falcon_h1"})  # FalconH1DecoderLayer: the mixer, then attention
    zamba = cache_spec({**common, "model_type": "zamba2"})  # Zamba2HybridLayer: the shared attention, then Mamba
    names = [s.name.split(" ", 2)[2] for s in call_slots(falcon, batch=1, itemsize=4, before=0, after=3)]
    assert names == ["convolution state", "recurrent state", "keys", "values"]
    names = [s.name.split(" ", 2)[2] for s in call_slots(zamba, batch=1, itemsize=4, before=0, after=3)]
    assert names == ["keys", "values", "convolution state", "recurrent state"]


def test_inside_a_call_the_written_storages_hold_their_new_bytes():
    spec = CacheSpec(layers=("full_attention",) * 2, kv_heads=1, head_dim=2)
    slots = call_slots(spec, batch=1, itemsize=4, before=3, after=4)
    old, new = 3 * 2 * 4, 4 * 2 * 4  # one K or V slot: tokens x 2 x 4 B
    assert bytes_at(slots, written=0) == 4 * old
    assert bytes_at(slots, written=3) == 3 * new + old
    # torch.cat making layer 1's values: their old storage still lives, beside every new one made so far.
    assert bytes_at(slots, written=4, overlap=True) == 4 * new + old
    sliding = CacheSpec(layers=("sliding_attention",), kv_heads=1, head_dim=2, sliding_window=4)
    slots = call_slots(sliding, batch=1, itemsize=4, earlier=0, before=6, after=7)
    # Before: the prefill's 6 tokens; after: min(6, 3) + 1 = 4. While the values are concatenated the old keys
    # live too (DynamicSlidingWindowLayer replaces both once both are made).
    assert [(s.before, s.after) for s in slots] == [(6 * 8, 4 * 8)] * 2
    assert bytes_at(slots, written=2, overlap=True) == 2 * 4 * 8 + 2 * 6 * 8


def test_a_static_cache_is_its_allocated_length():
    spec = CacheSpec(layers=("sliding_attention", "full_attention"), kv_heads=2, head_dim=8, sliding_window=8)
    # StaticLayer of 32 tokens and StaticSlidingWindowLayer of min(32, 8): 2 x 2 x 8 x 4 B per token.
    for tokens in (1, 12, 20):
        assert cache_bytes(spec, 1, tokens, itemsize=4, max_cache_len=32) == (32 + 8) * 2 * 2 * 8 * 4
    first = call_slots(spec, batch=1, itemsize=4, before=0, after=12, max_cache_len=32)
    assert all(s.before == 0 and s.renewed for s in first)  # allocated by the first call


def test_an_encoder_decoder_cache_counts_cross_attention_and_the_encoder_output():
    # T5-shaped: 6 decoder layers, 8 heads of d_kv 64, d_model 512; 10 decoder tokens, 100 encoder tokens, fp32.
    spec = cache_spec({"is_encoder_decoder": True, "num_layers": 6, "num_decoder_layers": 6, "num_heads": 8,
                       "d_kv": 64, "d_model": 512})
    assert spec.cross_attention and spec.encoder_hidden == 512 and len(spec.layers) == 6
    self_attn = 6 * 2 * 10 * 8 * 64 * 4
    cross = 6 * 2 * 100 * 8 * 64 * 4
    encoder_output = 100 * 512 * 4
    assert cache_bytes(spec, 1, 10, itemsize=4, encoder_tokens=100) == self_attn + cross + encoder_output


@pytest.mark.parametrize("config", [
    None,
    {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32, "layer_types": ["conv", "full_attention"]},
    {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32, "layer_types": ["linear_attention"] * 2},
    {"num_attention_heads": 4, "hidden_size": 32},
], ids=["no config", "a layer kind memprof does not size", "state-space sizes missing", "no layer count"])
def test_a_config_memprof_cannot_size_gives_no_spec(config):
    assert cache_spec(config) is None


def test_a_spec_says_what_it_lacks():
    with pytest.raises(InvalidArgumentError, match="kv_heads"):
        CacheSpec(layers=("full_attention",))
    with pytest.raises(InvalidArgumentError, match="sliding_window"):
        CacheSpec(layers=("sliding_attention",), kv_heads=1, head_dim=8)
    with pytest.raises(InvalidArgumentError, match="unknown cache layer kind"):
        CacheSpec(layers=("conv",))
    spec = CacheSpec(layers=("full_attention",), kv_heads=1, head_dim=8)
    with pytest.raises(InvalidArgumentError, match="must not shrink"):
        call_slots(spec, batch=1, itemsize=2, before=5, after=4)
    assert CacheSpec.from_dict(spec.to_dict()) == spec


def test_generation_facts_keep_the_cache_in_a_file_and_read_older_files():
    spec = CacheSpec(layers=("full_attention",), kv_heads=1, head_dim=8)
    facts = GenerationFacts(layers=1, kv_heads=1, head_dim=8, itemsize=4, batch=2, tokens=((0, "prefill", 0, 5),),
                            cache=spec.to_dict(), encoder_tokens=None, max_cache_len=16,
                            moments=(CacheMoment(0, "prefill", 0, "peak", 0, 0, 5, written=1, overlap=False),))
    assert GenerationFacts.from_dict(facts.to_dict()) == facts
    older = {k: v for k, v in facts.to_dict().items() if k not in ("cache", "encoder_tokens", "max_cache_len",
                                                                   "moments")}
    loaded = GenerationFacts.from_dict(older)
    assert loaded.cache is None and loaded.moments == () and loaded.tokens == facts.tokens
    bad = dict(facts.to_dict(), moments=[[0, "prefill", 0, "middle", 0, 0, 5, 1, False]])
    with pytest.raises(TraceFormatError, match="cache moment"):
        GenerationFacts.from_dict(bad)
