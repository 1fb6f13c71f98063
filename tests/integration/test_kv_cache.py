"""The KV cache, measured: what a generation keeps from one forward to the next is its own category, equal at
the end of generation to the formula and to an independent sum of the cache's tensors."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import memprof
from memprof import Category as C
from memprof.anatomy import kv_cache_bytes

transformers = pytest.importorskip("transformers")


def _models():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                                n_positions=64))
    # Grouped-query attention: 4 query heads share 2 key/value heads.
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64))
    return {"gpt2": (gpt2, 2, 16), "llama-gqa": (llama, 2, 8)}  # model, kv heads, head dim


def _storage_sum(tensors):
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


@pytest.mark.parametrize("mode", ["full", "light"])
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_the_cache_at_the_end_of_generation_equals_the_formula_and_its_tensors(name, mode):
    model, kv_heads, head_dim = _models()[name]
    model.eval()
    ids = torch.randint(0, 64, (3, 7))  # batch 3, prompt 7
    kept = {}

    def keep(module, args, kwargs, output):  # the cache as the last call leaves it, for the independent sum
        kept["cache"] = output.past_key_values

    handle = model.register_forward_hook(keep, with_kwargs=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with memprof.profile(model, mode=mode) as prof:
                model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    finally:
        handle.remove()
    trace = prof.report().trace
    phases = [(p.phase.value, p.occurrence) for p in trace.phases if p.phase.value in ("prefill", "decode")]
    assert phases == [("prefill", 0), ("decode", 0), ("decode", 1), ("decode", 2), ("decode", 3)]
    last = [p for p in trace.phases if p.phase.value == "decode"][-1]
    # 7 prompt tokens + 4 fed back (the fifth new token is never fed back) = 11 tokens in the cache, fp32:
    # 2 (K and V) x 2 layers x 3 sequences x 11 tokens x kv_heads x head_dim x 4 bytes.
    formula = 2 * 2 * 3 * 11 * kv_heads * head_dim * 4
    assert formula == kv_cache_bytes(2, 3, 11, kv_heads, head_dim, bytes_per_element=4)
    assert last.end[C.KV_CACHE] == formula
    cache = kept["cache"]
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert _storage_sum(tensors) == formula
    # The cache grows by one token per decode call: 2 x 2 x 3 x kv_heads x head_dim x 4 bytes.
    ends = [p.end[C.KV_CACHE] for p in trace.phases if p.phase.value in ("prefill", "decode")]
    per_token = 2 * 2 * 3 * kv_heads * head_dim * 4
    assert [b - a for a, b in zip(ends, ends[1:])] == [per_token] * 4
    # The attention mask and position ids the loop builds between calls are not the cache.
    assert trace.generation.tokens[-1][-1] == 11 and trace.generation.batch == 3
    rec = prof.report().reconcile(at=(0, "decode", "end", 3))
    assert rec.row("kv_cache").formula == rec.row("kv_cache").measured == formula


def test_a_users_own_cache_handed_back_is_the_cache():
    class Tiny(nn.Module):
        # A cache of this model's own design: a list of key tensors it returns and is given back.
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x, cache=None):
            k = self.proj(x)
            cache = [k] if cache is None else [torch.cat([cache[0], k], dim=1)]
            return k.sum(), cache

    model = Tiny().eval()
    with torch.no_grad(), memprof.profile(model) as prof:
        _, cache = model(torch.randn(2, 4, 8))
        for _ in range(3):
            _, cache = model(torch.randn(2, 1, 8), cache=cache)
    trace = prof.report().trace
    decode = [p for p in trace.phases if p.phase.value == "decode"]
    assert len(decode) == 3
    # Handed back in each decode call: at the start of the last one the cache holds 4 + 2 tokens of 2 x 8 fp32.
    assert decode[-1].start[C.KV_CACHE] == 2 * 6 * 8 * 4


def test_training_runs_keep_no_cache_and_say_nothing_of_it(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with memprof.profile(model) as prof:
        model(torch.randn(4, 8)).sum().backward()
    rep = prof.report()
    assert rep.trace.peak[C.KV_CACHE] == 0 and rep.trace.generation is None
    assert "kv_cache" not in str(rep)
