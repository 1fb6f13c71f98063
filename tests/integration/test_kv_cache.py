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


def _generated(model, ids, new_tokens, mode="exact"):
    """The trace of a greedy generation of exactly ``new_tokens`` tokens after ``ids``, profiled."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with memprof.profile(model, mode=mode) as prof:
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0)
    return prof.report().trace


def _storage_sum(tensors):
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


@pytest.mark.parametrize("mode", ["exact", "light"])
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
        trace = _generated(model, ids, 5, mode)
    finally:
        handle.remove()
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
    rec = memprof.Report(trace).reconcile(at=(0, "decode", "end", 3))
    assert rec.row("kv_cache").formula == rec.row("kv_cache").measured == formula


class _OwnCache(nn.Module):
    """A cache of this model's own design: a list (or tuple) of key tensors it returns and is given back."""

    def __init__(self, container=list):
        super().__init__()
        self.proj, self.container = nn.Linear(8, 8), container

    def forward(self, x, cache=None):
        k = self.proj(x)
        return k.sum(), self.container([k] if cache is None else [torch.cat([cache[0], k], dim=1)])


def test_a_users_own_cache_handed_back_is_the_cache():
    model = _OwnCache(list).eval()
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


def test_an_evaluation_loop_whose_outputs_carry_a_cache_stays_a_forward():
    model = _models()["llama-gqa"][0]  # transformers' default use_cache=True: every output holds a cache
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with memprof.profile(model, opt) as prof:
            for _ in range(2):
                model(ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    for _ in range(5):
                        model(ids, labels=ids)
    rep = prof.report()
    assert {p.phase.value for p in rep.trace.phases} <= {"forward", "backward", "optimizer", "other"}
    assert rep.trace.generation is None and rep.trace.peak[C.KV_CACHE] == 0
    # The training formula is untouched: the forward's activations have their per-module formula, and the
    # textbook counts training bytes/param (fp32 AdamW: 16).
    rec = rep.reconcile(at=(0, "forward", "end"))
    assert rec.row("activations").formula > 0 and rec.textbook.bytes_per_param == 16.0


def test_a_long_generation_ends_with_its_cache():
    model, kv_heads, head_dim = _models()["llama-gqa"]
    model.eval()
    trace = _generated(model, torch.zeros(2, 5, dtype=torch.long), 100)
    decode = [p for p in trace.phases if p.phase.value == "decode"]
    assert len(decode) == 64  # 63 of their own, the other 36 calls in the 64th
    assert any("35 further decode calls joined" in n for n in trace.notes)
    # 5 + 99 tokens at the end of the last call, also in the folded phase.
    assert decode[-1].end[C.KV_CACHE] == kv_cache_bytes(2, 2, 104, kv_heads, head_dim, bytes_per_element=4)
    assert trace.generation.tokens[-1][-1] == 104


def test_a_sliding_window_model_has_a_prefill_and_a_capped_formula():
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, sliding_window=8)).eval()
    trace = _generated(model, torch.zeros(1, 4, dtype=torch.long), 3)
    kinds = [p.phase.value for p in trace.phases if p.phase.value in ("prefill", "decode")]
    assert kinds == ["prefill", "decode", "decode"]
    assert trace.generation.sliding_window == 8
    # 4 + 2 tokens, under the window: 2 x 2 layers x 1 x 6 x 2 kv heads x head dim 8 x 4 bytes.
    last = [p for p in trace.phases if p.phase.value == "decode"][-1]
    assert last.end[C.KV_CACHE] == kv_cache_bytes(2, 1, 6, 2, 8, bytes_per_element=4, sliding_window=8)
    assert kv_cache_bytes(2, 1, 100, 2, 8, bytes_per_element=4, sliding_window=8) == \
        kv_cache_bytes(2, 1, 8, 2, 8, bytes_per_element=4)


def test_a_users_tuple_cache_labels_the_prefill_once_it_comes_back():
    model = _OwnCache(tuple).eval()
    with torch.no_grad(), memprof.profile(model) as prof:
        _, cache = model(torch.randn(2, 4, 8))
        for _ in range(3):
            _, cache = model(torch.randn(2, 1, 8), cache)
    trace = prof.report().trace
    assert [(p.phase.value, p.occurrence) for p in trace.phases if p.phase.value != "other"] == \
        [("prefill", 0), ("decode", 0), ("decode", 1), ("decode", 2)]
    last = [p for p in trace.phases if p.phase.value == "decode"][-1]
    # At the end of the last call the loop's variable still holds the cache it handed in (6 tokens) beside the
    # one returned (7 tokens): a cache grown by concatenation is two copies for a moment. (6 + 7) x 2 x 8 x 4 B.
    assert last.end[C.KV_CACHE] == (6 + 7) * 2 * 8 * 4
    assert trace.generation.tokens[-1][-1] == 7 and trace.generation.tokens[0] == (0, "prefill", 0, 4)


def test_a_training_forward_that_stores_into_its_input_keeps_no_cache():
    model = nn.Linear(16, 16)
    batch = {"x": torch.randn(4, 16)}

    def step():
        h = model(batch["x"])
        batch["features"] = h.detach() * 1.0  # kept in the caller's dict, as some pipelines do
        h.sum().backward()

    with memprof.profile(model) as prof:
        step()
        step()
    assert prof.report().trace.peak[C.KV_CACHE] == 0


def test_falcon_multi_query_has_one_key_value_head_in_the_formula():
    from memprof.collect.cache_facts import _cache_shape

    cfg = transformers.FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, vocab_size=64,
                                    multi_query=True, new_decoder_architecture=False)
    assert _cache_shape(cfg) == (2, 1, 8, None)
