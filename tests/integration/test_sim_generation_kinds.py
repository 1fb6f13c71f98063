"""memprof.estimate_generation for the models people serve now: mixture-of-experts, state-space hybrids,
encoder-decoder models, beam search and sampling. Each simulated generation (batch 2, prompt 12, 8 new tokens)
equals a real CPU run of the very same calls (memprof.simulate.decoding.Decoding on real tensors) at every phase
moment (each prefill, decode and in-between phase's start, peak and end, every category), and its cache equals
the cache formulas (memprof.anatomy.caches) at every prefill and decode moment."""

from __future__ import annotations

import warnings

import pytest
import torch

import memprof
from memprof import Category as C
from memprof.analyse.reconciler.formula import formula_at
from memprof.errors import InvalidArgumentError, SimulationError
from memprof.simulate.decoding import Decoding
from memprof.simulate.generation import choosing
from memprof.vocabulary import Phase

from moe_models import T, build, forced, moe_configs

B, P, N = 2, 12, 8


def moments(trace):
    return [(p.step, p.phase, p.occurrence, p.start, p.peak, p.end) for p in trace.phases]


def real_generation(model, prompt=P, routing=None, new=N, **kwargs):
    """The simulation's calls on the real model, profiled (routing recorded)."""
    model.eval()
    encdec = model.config.is_encoder_decoder
    loop = Decoding(model, B, torch.device("cpu"), chooser=choosing(model, max_length=(1 if encdec else prompt) + new,
                                                                    **kwargs))
    loop.prompt(prompt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad(), forced(routing), memprof.profile(model, record_routing=True) as prof:
            loop.prefill()
            for _ in range(new - 1):
                loop.call(1)
    return prof.report()


def simulated(model, prompt=P, new=N, **kwargs):
    return memprof.estimate_generation(model, batch_size=B, prompt_len=prompt, max_new_tokens=new, device="cpu",
                                       **kwargs)


def assert_cache_is_the_formula(trace, new=N):
    calls = [p for p in trace.phases if p.phase in (Phase.PREFILL, Phase.DECODE)]
    assert [p.phase for p in calls] == [Phase.PREFILL] + [Phase.DECODE] * (new - 1)
    for p in calls:
        for moment in ("start", "peak", "end"):
            assert formula_at(trace, (p.step, p.phase, moment, p.occurrence))[C.KV_CACHE] == \
                getattr(p, moment)[C.KV_CACHE], (p.phase, p.occurrence, moment)


@pytest.mark.parametrize("name", sorted(moe_configs()))
def test_a_moe_generation_with_the_real_routing_replayed_equals_the_real_run(name):
    real = real_generation(build(name))
    est = simulated(build(name), routing=real)
    assert moments(est.trace) == moments(real.trace)
    assert est.trace.generation == real.trace.generation
    assert_cache_is_the_formula(est.trace)


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_the_per_expert_loop_under_balanced_routing_equals_a_real_run_forced_balanced(name):
    real = real_generation(build(name, "eager"), routing="balanced")
    est = simulated(build(name, "eager"))
    assert moments(est.trace) == moments(real.trace)
    if name == "gpt_oss":
        # Its own routing: a few tokens per decode call route unevenly, and the loop's buffers follow the largest
        # expert's tokens (docs/accuracy.md has the table); the estimate's note says so.
        natural = real_generation(build(name, "eager"))
        assert natural.trace.peak.total > est.trace.peak.total
        assert any("up to 8 % below a generation" in n for n in est.notes)


def _t5():
    torch.manual_seed(0)
    return T.T5ForConditionalGeneration(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0))


def _whisper():
    torch.manual_seed(0)
    return T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, decoder_start_token_id=1, pad_token_id=0))


def _bart():
    torch.manual_seed(0)
    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64))


@pytest.mark.parametrize("build_model, prompt", [(_t5, 12), (_whisper, 32)], ids=["t5", "whisper"])
def test_an_encoder_decoder_generation_equals_the_real_run(build_model, prompt):
    # Whisper's encoder takes its whole window: 2 x max_source_positions = 32 mel frames.
    real = real_generation(build_model(), prompt)
    est = simulated(build_model(), prompt)
    assert moments(est.trace) == moments(real.trace)
    assert_cache_is_the_formula(est.trace)
    assert est.trace.generation.encoder_tokens == prompt // (2 if prompt == 32 else 1)
    assert any(n.startswith("encoder-decoder: the encoder ran once") for n in est.notes)


def test_bart_differs_by_the_decoder_mask_transformers_builds_only_on_fake_tensors():
    real = real_generation(_bart())
    est = simulated(_bart())
    calls = [(s, r) for s, r in zip(est.trace.phases, real.trace.phases) if s.phase in (Phase.PREFILL, Phase.DECODE)]
    # masking_utils._ignore_causal_mask_sdpa skips the decoder's self-attention mask once it has checked that the
    # padding mask is all ones; on fake tensors is_tracing() is true and the (2, 1, 1, tokens) bool mask is built:
    # 2 x (n + 1) B at decode call n. The prefill's peak is its encoder's forward (the encoder runs in the
    # prefill), where no such mask is made: the same in both.
    assert [s.peak.total - r.peak.total for s, r in calls] == [0] + [2 * t for t in range(2, N + 1)]
    assert [s.end for s, _ in calls] == [r.end for _, r in calls]


@pytest.mark.parametrize("build_model, prompt", [(None, P), (_t5, 12)], ids=["llama", "t5"])
def test_beam_search_equals_the_real_run_and_keeps_batch_times_beams_caches(build_model, prompt):
    make = build_model or _llama
    real = real_generation(make(), prompt, num_beams=3)
    est = simulated(make(), prompt, num_beams=3)
    assert moments(est.trace) == moments(real.trace)
    assert_cache_is_the_formula(est.trace)
    assert est.trace.generation.batch == B * 3
    assert any(n.startswith("beam search: 3 beams per sequence (6 sequences") for n in est.notes)


def _llama():
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                            max_position_embeddings=64))


def test_sampling_runs_transformers_warpers_and_equals_the_real_run():
    kwargs = dict(do_sample=True, temperature=0.7, top_k=10, top_p=0.9)
    real = real_generation(_llama(), **kwargs)
    est = simulated(_llama(), **kwargs)
    assert moments(est.trace) == moments(real.trace)
    assert any("TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper" in n for n in est.notes)


def test_a_long_beam_search_grows_the_cache_and_ends_as_the_full_run():
    from memprof.simulate import generation

    # 18 new tokens: 17 decode calls, one more than run one by one.
    jumped = memprof.estimate_generation(_llama(), batch_size=2, prompt_len=5, max_new_tokens=18, num_beams=2)
    assert any("were not run one by one" in n for n in jumped.notes)
    limit, generation._RUN_ALL = generation._RUN_ALL, 1000
    try:
        full = memprof.estimate_generation(_llama(), batch_size=2, prompt_len=5, max_new_tokens=18, num_beams=2)
    finally:
        generation._RUN_ALL = limit
    last, last_full = ([p for p in e.trace.phases if p.phase is Phase.DECODE][-1] for e in (jumped, full))
    assert (last.start, last.peak, last.end) == (last_full.start, last_full.peak, last_full.end)


def _ssm(name):
    c = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, max_position_embeddings=64)
    attn = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    mamba2 = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8)
    cfgs = {
        "mamba": lambda: T.MambaForCausalLM(T.MambaConfig(vocab_size=64, hidden_size=32, state_size=4,
                                                          num_hidden_layers=2, intermediate_size=64, time_step_rank=4,
                                                          conv_kernel=4)),
        "mamba2": lambda: T.Mamba2ForCausalLM(T.Mamba2Config(vocab_size=64, hidden_size=32, state_size=8,
                                                             num_hidden_layers=2, num_heads=8, head_dim=8, n_groups=1,
                                                             expand=2, chunk_size=8, conv_kernel=4)),
        "bamba": lambda: T.BambaForCausalLM(T.BambaConfig(**c, **attn, attn_layer_indices=[1], **mamba2)),
        "zamba2": lambda: T.Zamba2ForCausalLM(T.Zamba2Config(
            **c, layers_block_type=["mamba", "hybrid"], mamba_d_state=8, n_mamba_heads=4, mamba_headdim=16,
            chunk_size=8, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, hybrid_layer_ids=[1])),
        "falcon_h1": lambda: T.FalconH1ForCausalLM(T.FalconH1Config(**c, **attn, mamba_d_ssm=64, **mamba2)),
        "qwen3_next": lambda: T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
            **c, **attn, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"])),
        "granitemoehybrid": lambda: T.GraniteMoeHybridForCausalLM(T.GraniteMoeHybridConfig(
            **c, **attn, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
            layer_types=["mamba", "attention"], **mamba2)),
    }
    torch.manual_seed(0)
    return cfgs[name]()


HYBRIDS = ["mamba", "mamba2", "bamba", "zamba2", "falcon_h1", "qwen3_next", "granitemoehybrid"]


@pytest.mark.parametrize("name", HYBRIDS)
def test_state_space_hybrids_simulate_exactly_in_generation(name):
    # 4 new tokens: Mamba-1's scan is a Python loop per token, simulated op by op.
    real = real_generation(_ssm(name), new=4)
    routing = real if real.trace.routing.calls else None  # Qwen3-Next and GraniteMoeHybrid route to experts
    est = simulated(_ssm(name), new=4, routing=routing)
    assert moments(est.trace) == moments(real.trace)
    assert_cache_is_the_formula(est.trace, new=4)


@pytest.mark.parametrize("name", ["qwen3_next", "granitemoehybrid"])
def test_hybrids_with_experts_simulate_exactly_in_training(name):
    # (Jamba is among the MoE architectures of test_sim_moe.py; the pure state-space models have no router.)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model = _ssm(name)
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt, record_routing=True) as prof:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        del loss  # the loop has ended: its last loss is released, as the estimate's loop releases it
    trained = memprof.estimate(_ssm(name), lambda ps: torch.optim.AdamW(ps), inputs=dict(input_ids=ids, labels=ids),
                               loss_fn=lambda o: o.loss, device="cpu", steps=1, routing=prof.report())
    assert moments(trained.trace) == moments(prof.report().trace)


def test_a_failed_generation_says_which_call_of_the_generation_failed():
    class Reads(torch.nn.Module):  # reads a value inside its decode calls
        def forward(self, x):
            return x * int(x.sum().item())

    model = _llama()
    model.model.layers[0].mlp.act_fn = Reads()
    with pytest.raises(SimulationError, match=r"the simulated generation \(prefill\) failed: "
                                              r"DataDependentOutputException: .* \(at .*test_sim_generation_kinds.py"):
        simulated(model)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_beams=0), "num_beams must be a whole number >= 1"),
    (dict(top_p=0.0), "top_p must be a number in"),
    (dict(do_sample="yes"), "do_sample must be True or False"),
    (dict(prompt_len=10), "encodes a fixed window of 32 mel frames"),
])
def test_bad_generation_arguments_are_refused_in_one_sentence(kwargs, message):
    model = _whisper() if "prompt_len" in kwargs else _llama()
    args = dict(batch_size=1, prompt_len=32 if "prompt_len" not in kwargs else kwargs.pop("prompt_len"),
                max_new_tokens=2)
    with pytest.raises(InvalidArgumentError, match=message):
        memprof.estimate_generation(model, **args, **kwargs)
