"""Encoder-decoder models through ``generate()``: T5, BART and Whisper built from tiny configs on CPU.

``generate()`` runs the encoder once (``_prepare_encoder_decoder_kwargs_for_generation`` calls
``self.get_encoder()``), then the decoder's first call (``_prefill``) with an empty ``EncoderDecoderCache``, then one
decoder call per further token: memprof's prefill is the encoder's forward through that first call, each later call a
decode. The cache is each decoder layer's self-attention keys and values (one per decoder token), its cross-attention
keys and values (one per encoder token, written by the first call) and the encoder's output, handed to every call.
Each is checked against the cache object's own tensors (tests/helpers.py's CacheOracle), against the arithmetic
written out, and against the formula at every moment of every phase, the peak included.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import memprof
from memprof import Category as C
from memprof.analyse.reconciler.formula import formula_at
from memprof.vocabulary import Phase

from helpers import CacheOracle

T = pytest.importorskip("transformers")
B, N = 2, 6  # batch, new tokens: the start token and 5 fed back, so 5 decode calls


def _t5(big):
    # d_kv = 16 where d_model / heads = 8: T5 caches inner heads of d_kv.
    return T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=64, d_model=32, d_kv=16, d_ff=512 if big else 64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0))


def _bart(big):
    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=512 if big else 64, decoder_ffn_dim=64, max_position_embeddings=128))


def _whisper(big):
    return T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=512 if big else 64, decoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=96 if big else 6, max_target_positions=64, decoder_start_token_id=1, pad_token_id=0,
        eos_token_id=2, bos_token_id=1, suppress_tokens=None, begin_suppress_tokens=None))


# name: (builder, key/value heads x head dimension of the decoder's attention)
MODELS = {"t5": (_t5, 4 * 16), "bart": (_bart, 4 * 8), "whisper": (_whisper, 4 * 8)}


def _inputs(name, model, big):
    """The encoder's input and its length in encoder tokens (Whisper's convolutions halve its mel frames)."""
    if name == "whisper":
        frames = 2 * model.config.max_source_positions
        return {"input_features": torch.randn(B, 8, frames)}, frames // 2
    source = 96 if big else 6
    return {"input_ids": torch.randint(3, 64, (B, source))}, source


def _generate(name, big):
    torch.manual_seed(0)
    build, heads_dims = MODELS[name]
    model = build(big).eval()
    inputs, source = _inputs(name, model, big)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = model.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    oracle = CacheOracle(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with memprof.profile(model) as prof, oracle:
                profiled = model.generate(**inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    finally:
        oracle.close()
    # Profiling changes nothing, and leaves no hook on the encoder.
    assert torch.equal(plain, profiled)
    assert not model.get_encoder()._forward_pre_hooks
    encoder = next(path for path, m in model.named_modules() if m is model.get_encoder())
    return prof.report(), oracle, source, heads_dims, encoder


def _cache(heads_dims, decoder_tokens, source):
    """Self-attention K and V of 2 layers over the decoder's tokens, cross-attention K and V of 2 layers over the
    encoder's tokens, and the encoder's output (width 32), batch B, 4 B elements."""
    return 2 * 2 * B * heads_dims * (decoder_tokens + source) * 4 + B * source * 32 * 4


@pytest.mark.parametrize("big", [False, True], ids=["small-encoder", "large-encoder"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_encoder_runs_in_the_prefill_and_the_formula_is_the_cache_at_every_moment(name, big):
    report, oracle, source, heads_dims, encoder = _generate(name, big)
    trace = report.trace
    assert [p.phase for p in trace.phases] == [Phase.OTHER, Phase.PREFILL] + [Phase.OTHER, Phase.DECODE] * (N - 1) \
        + [Phase.OTHER]
    assert trace.generation.encoder_prefills == ((0, 0),)
    # Every module call of the encoder was in the prefill.
    encoder_samples = [s for s in trace.timeline if s.label.startswith(encoder + ".")]
    assert encoder_samples and {s.phase for s in encoder_samples} == {Phase.PREFILL}
    calls = [p for p in trace.phases if p.phase in (Phase.PREFILL, Phase.DECODE)]
    # Measured == the cache object's own storages at every call's end; each call's peak, one the cache held then.
    assert [p.end[C.KV_CACHE] for p in calls] == oracle.ends
    assert all(p.peak[C.KV_CACHE] in held for p, held in zip(calls, oracle.values))
    # After the prefill: 1 decoder token; after the last decode call: the start token and the 5 fed back.
    assert calls[0].end[C.KV_CACHE] == _cache(heads_dims, 1, source)
    assert calls[-1].end[C.KV_CACHE] == _cache(heads_dims, N, source)
    # The prefill begins before the encoder: nothing cached.
    assert calls[0].start[C.KV_CACHE] == 0
    # The formula at every phase's start, peak and end; before the first call it has none but at the end.
    for i, p in enumerate(trace.phases):
        for moment in ("start", "peak", "end"):
            formula = formula_at(trace, (p.step, p.phase, moment, p.occurrence))[C.KV_CACHE]
            if i == 0 and moment != "end":
                assert formula is None
            else:
                assert formula == getattr(p, moment)[C.KV_CACHE], (p.phase, p.occurrence, moment)
    row = report.reconcile(at="peak").row("kv_cache")
    assert row.formula == row.measured == trace.peak[C.KV_CACHE]
    if big:
        # The encoder's forward is the generation's peak: nothing is cached until its output is made.
        assert trace.peak_phase is Phase.PREFILL and trace.peak_module.startswith(encoder + ".")
        assert row.formula == 0
    else:
        assert row.formula > 0


def test_an_encoder_called_alone_is_a_forward_not_a_prefill():
    torch.manual_seed(0)
    model = _t5(False).eval()
    ids = torch.randint(3, 64, (B, 6))
    with torch.no_grad(), memprof.profile(model) as prof:
        model.get_encoder()(input_ids=ids)
    trace = prof.report().trace
    # No decoder call continued the phase the encoder began: an ordinary forward, and no generation.
    assert [p.phase for p in trace.phases if p.phase is not Phase.OTHER] == [Phase.FORWARD]
    assert trace.generation is None
