"""An estimate says what it assumed: the training loop and the loss's lifetime, the MoE routing, the cache."""

from __future__ import annotations

import warnings

import torch

import memprof

from moe_models import T, build


def _notes(est, start):
    return [n for n in est.notes if n.startswith(start)]


def test_a_generation_names_its_routing_and_its_cache():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = memprof.estimate_generation(build("deepseek_v3"), batch_size=2, prompt_len=4, max_new_tokens=2,
                                          device="cpu")
    (routing,) = _notes(est, "MoE routing assumed: balanced")
    (cache,) = _notes(est, "cache assumed:")
    assert "(1 full attention layer(s))" in cache and "kv_lora_rank" in cache and "DeepSeek-V2" in cache


def test_a_sliding_window_and_an_unsized_cache_are_said():
    torch.manual_seed(0)
    gemma = T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"]))
    est = memprof.estimate_generation(gemma, batch_size=1, prompt_len=4, max_new_tokens=2, device="cpu")
    (cache,) = _notes(est, "cache assumed:")
    assert "1 sliding attention, 1 full attention layer(s), a window of 4 tokens" in cache
    from memprof.simulate.generation import _cache_note

    # A model without a transformers config: no cache memprof can size, and the note says the figure is measured.
    assert "memprof cannot size this config's cache" in _cache_note(torch.nn.Linear(2, 2))


def test_a_training_estimate_names_its_loop_and_the_loss_lifetime():
    est = memprof.estimate(torch.nn.Linear(4, 4), lambda ps: torch.optim.SGD(ps, lr=0.1), inputs=torch.randn(2, 4),
                           device="cpu")
    (loop,) = _notes(est, "the training loop:")
    assert loop.startswith("the training loop: 2 steps of forward and loss, backward(), optimizer.step(), zero_grad()")
    assert "the loss held through the step" in loop
