"""memprof.estimate_generation: a generation simulated on shape-only tensors equals a real run of the same calls
to the byte, phase by phase, and its KV cache equals the formula and a real generate()'s cache."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import memprof
from memprof import Category as C
from memprof.anatomy import kv_cache_bytes
from memprof.errors import InvalidArgumentError

transformers = pytest.importorskip("transformers")


def _llama(**kw):
    torch.manual_seed(0)
    cfg = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)
    cfg.update(kw)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                                n_positions=64)).eval()


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama-gqa", "gpt2"])
def test_a_simulated_generation_equals_a_real_run_of_the_same_calls(build):
    from memprof.simulate.generation import _Loop

    model = build()
    est = memprof.estimate_generation(model, batch_size=3, prompt_len=7, max_new_tokens=5, device="cpu")
    loop = _Loop(model, 3, torch.device("cpu"))  # the calls the simulation makes, on real tensors
    loop.prompt(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad(), memprof.profile(model) as prof:
            loop.call(7)
            for _ in range(4):
                loop.call(1)
    real = prof.report().trace
    # Every phase (prefill, each decode, the loop's work between them), every category, to the byte.
    assert [(p.phase, p.occurrence, p.start, p.peak, p.end) for p in est.trace.phases] == \
        [(p.phase, p.occurrence, p.start, p.peak, p.end) for p in real.phases]
    assert est.trace.generation == real.generation


def test_the_cache_equals_the_formula_and_a_real_generate():
    model = _llama()
    est = memprof.estimate_generation(model, batch_size=3, prompt_len=7, max_new_tokens=5, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with memprof.profile(model) as prof:
            model.generate(torch.zeros(3, 7, dtype=torch.long), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                           pad_token_id=0)

    def cache_ends(trace):
        return [p.end[C.KV_CACHE] for p in trace.phases if p.phase.value in ("prefill", "decode")]

    # 2 layers x 3 sequences x 2 kv heads x head dim 8 x 4 bytes x 2 (K, V) per token: 7 tokens, then 8 ... 11.
    expected = [kv_cache_bytes(2, 3, n, 2, 8, bytes_per_element=4) for n in range(7, 12)]
    assert cache_ends(est.trace) == cache_ends(prof.report().trace) == expected
    rec = est.report().reconcile(at=(0, "decode", "end", 3))
    assert rec.row("kv_cache").formula == rec.row("kv_cache").measured == expected[-1]
    assert rec.row("gradients").formula == 0 and rec.row("activations").formula == 0


def test_a_long_generation_grows_the_cache_directly_and_ends_as_the_full_run():
    from memprof.simulate import generation

    model = _llama()
    jumped = memprof.estimate_generation(model, batch_size=2, prompt_len=5, max_new_tokens=40, device="cpu")
    assert any("were not run one by one" in n for n in jumped.notes)
    full_limit, generation._RUN_ALL = generation._RUN_ALL, 1000
    try:
        full = memprof.estimate_generation(model, batch_size=2, prompt_len=5, max_new_tokens=40, device="cpu")
    finally:
        generation._RUN_ALL = full_limit
    last = [p for p in jumped.trace.phases if p.phase.value == "decode"][-1]
    last_full = [p for p in full.trace.phases if p.phase.value == "decode"][-1]
    # The last decode call of both: 5 + 39 = 44 tokens in the cache at its end, the same peak.
    assert last.end[C.KV_CACHE] == last_full.end[C.KV_CACHE] == kv_cache_bytes(2, 2, 44, 2, 8, bytes_per_element=4)
    assert last.peak == last_full.peak
    assert jumped.trace.generation.tokens[-1][-1] == 44


def test_a_cuda_target_in_bf16_keeps_a_bf16_cache():
    with torch.device("meta"):
        model = _llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    est = memprof.estimate_generation(model, batch_size=4, prompt_len=64, max_new_tokens=9, device="cuda",
                                      precision="bf16")
    last = [p for p in est.trace.phases if p.phase.value == "decode"][-1]
    # 64 + 8 = 72 tokens; each layer's K and V: 4 x 2 x 72 x 64 x 2 bytes = 73,728 B, a multiple of 512.
    assert last.end[C.KV_CACHE] == kv_cache_bytes(2, 4, 72, 2, 64, bytes_per_element=2) == 4 * 73728
    assert est.trace.generation.itemsize == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be a whole number >= 1"),
    (dict(prompt_len=100, max_new_tokens=29), "positions for 128"),
    (dict(batch_size=True), "batch_size must be a whole number"),
])
def test_bad_arguments_are_refused_in_one_sentence(kwargs, message):
    args = dict(batch_size=1, prompt_len=4, max_new_tokens=2)
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=message):
        memprof.estimate_generation(_llama(), **args)


def test_a_model_without_a_generation_interface_is_refused():
    with pytest.raises(InvalidArgumentError, match="no generation interface"):
        memprof.estimate_generation(nn.Linear(4, 4), batch_size=1, prompt_len=4, max_new_tokens=2)


def test_greedy_keeps_the_last_calls_logits_copy_while_the_next_one_is_made():
    # generate()'s _sample rebinds next_token_logits to the fp32 copy of the new call's last logits: the previous
    # call's copy is alive while it is made, beside the model's output. The simulation freed it first and was one
    # row of logits under (a new user's sweep: 1,023,689 B of 5,133,737 B for a 32,000-word vocabulary, batch 8).
    batch, vocab = 8, 4000
    model = _llama(vocab_size=vocab)
    model.generation_config.eos_token_id = None
    est = memprof.estimate_generation(model, batch_size=batch, prompt_len=2, max_new_tokens=4, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with memprof.profile(model) as prof:
            model.generate(torch.ones(batch, 2, dtype=torch.long), max_new_tokens=4, do_sample=False, pad_token_id=0)
    row = batch * vocab * 4  # one fp32 row of logits per sequence: 128,000 B
    for trace in (est.trace, prof.report().trace):
        between = [p.peak[C.TEMPORARIES] for p in trace.phases if p.phase.value == "other" and p.occurrence >= 2]
        # The model's fp32 output, the previous copy and the new one: three rows, and generate()'s few bytes more.
        assert len(between) == 3 and all(3 * row <= t < 3 * row + 1024 for t in between), between


def test_logits_processors_a_generation_config_asks_for_are_named_as_not_simulated():
    # generate() adds a processor for each (a repetition penalty clones the scores); the simulation runs none.
    model = _llama()
    est = memprof.estimate_generation(model, batch_size=2, prompt_len=4, max_new_tokens=3, device="cpu")
    assert not any("generation config sets" in n for n in est.notes)
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.min_new_tokens = 2
    est = memprof.estimate_generation(model, batch_size=2, prompt_len=4, max_new_tokens=3, device="cpu")
    assert any(n.startswith("the model's generation config sets repetition_penalty=1.3, min_new_tokens=2: generate() "
                            "runs a logits processor") for n in est.notes), est.notes
