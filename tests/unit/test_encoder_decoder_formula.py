"""The kv_cache formula of an encoder-decoder generation on hand-built traces: a prefill that begins with the
encoder's forward (the encoder's output made in it), one from a file written before memprof ran the encoder in
the prefill, and the loop's phases between and after the calls, where the run recorded whether the last call's
cache object was still held."""

from __future__ import annotations

import json

from factories import bd, phase, trace

import memprof
from memprof.anatomy import CacheSpec
from memprof.analyse.reconciler.formula import formula_at
from memprof.record.cache import CacheMoment
from memprof.record.parts import GenerationFacts

# Two decoder layers of 2 key/value heads of 8, cross-attention over 5 encoder tokens, an encoder output of width
# 16; batch 1, 4 B elements.
SPEC = CacheSpec(layers=("full_attention",) * 2, kv_heads=2, head_dim=8, cross_attention=True, encoder_hidden=16)
TOKEN = 2 * 8 * 4  # one layer's K (or V) per decoder token: 2 heads x 8 x 4 B = 64
CROSS = 5 * TOKEN  # one layer's cross-attention K (or V): 5 encoder tokens = 320
ENCODER = 5 * 16 * 4  # the encoder's output: 5 tokens x 16 x 4 B = 320
# After the prefill (1 decoder token): the encoder's output and, per layer, K, V, cross K, cross V.
PREFILL_END = ENCODER + 2 * (2 * TOKEN + 2 * CROSS)  # 320 + 2 x (128 + 640) = 1856
DECODE_END = PREFILL_END + 2 * 2 * TOKEN  # a second decoder token in both layers' K and V: 1856 + 256 = 2112


def _trace(*, encoder_prefill=True, written=3, held=None):
    """other, prefill, other, decode, other (the last one after the last call); ``held``: for the two "other"
    phases after a call, whether the cache object was held at their (peak, end), or None: no record."""
    moments = [CacheMoment(0, "prefill", 0, "peak", 0, 0, 1, written=written),
               CacheMoment(0, "prefill", 0, "end", 0, 0, 1), CacheMoment(0, "decode", 0, "end", 0, 1, 2),
               CacheMoment(0, "decode", 0, "peak", 0, 1, 2, written=0)]
    if held is not None:
        for occ, tokens in ((1, (0, 0, 1)), (2, (0, 1, 2))):
            moments += [CacheMoment(0, "other", occ, m, *tokens, written=int(h)) for m, h in zip(("peak", "end"),
                                                                                                  held[occ - 1])]
    gen = GenerationFacts(layers=2, kv_heads=2, head_dim=8, itemsize=4, batch=1, cache=SPEC.to_dict(),
                          tokens=((0, "prefill", 0, 1), (0, "decode", 0, 2)), encoder_tokens=5,
                          moments=tuple(moments), encoder_prefills=((0, 0),) if encoder_prefill else ())
    z = bd(kv_cache=0)
    phases = (phase(0, "other", start=z, peak=z, end=z), phase(0, "prefill", start=z, peak=z, end=z),
              phase(0, "other", start=z, peak=z, end=z, occurrence=1), phase(0, "decode", start=z, peak=z, end=z),
              phase(0, "other", start=z, peak=z, end=z, occurrence=2))
    return trace(phases=phases, generation=gen)


def _kv(tr, at):
    return formula_at(tr, at)["kv_cache"]


def test_a_prefill_that_runs_the_encoder_begins_empty_and_makes_the_encoders_output_first():
    # Nothing before the encoder runs; the "other" phase before the prefill ends with nothing either.
    assert _kv(_trace(), (0, "prefill", "start")) == _kv(_trace(), (0, "other", "end")) == 0
    # A peak inside the encoder's forward: nothing written yet.
    assert _kv(_trace(written=0), (0, "prefill", "peak")) == 0
    # A peak after the encoder, before the decoder's first layer: its output, 320 B.
    assert _kv(_trace(written=1), (0, "prefill", "peak")) == ENCODER
    # Then layer 0's K and V: 320 + 64 + 64.
    assert _kv(_trace(written=3), (0, "prefill", "peak")) == ENCODER + 2 * TOKEN
    assert _kv(_trace(), (0, "prefill", "end")) == PREFILL_END


def test_a_file_whose_prefill_began_at_the_decoders_call_has_the_encoders_output_from_the_start():
    old = _trace(encoder_prefill=False, written=2)
    assert _kv(old, (0, "prefill", "start")) == _kv(old, (0, "other", "end")) == ENCODER
    # Two storages written by the peak: layer 0's K and V, beside the encoder's output that came in.
    assert _kv(old, (0, "prefill", "peak")) == ENCODER + 2 * TOKEN
    assert _kv(old, (0, "prefill", "end")) == PREFILL_END


def test_between_and_after_the_calls_the_cache_is_the_last_calls_while_its_object_is_held():
    # Held at both moments of both phases: the prefill's cache between the calls, the decode call's after them.
    held = _trace(held=((True, True), (True, True)))
    assert _kv(held, (0, "other", "peak", 1)) == _kv(held, (0, "other", "end", 1)) == PREFILL_END
    assert _kv(held, (0, "other", "peak", 2)) == _kv(held, (0, "other", "end", 2)) == DECODE_END
    # generate() returned within the last phase: held at its peak, let go by its end.
    gone = _trace(held=((True, True), (True, False)))
    assert _kv(gone, (0, "other", "peak", 2)) == DECODE_END
    assert _kv(gone, (0, "other", "end", 2)) == 0
    # Without the record (an older file): between the calls the last call's cache, after the last one no formula.
    bare = _trace()
    assert _kv(bare, (0, "other", "peak", 1)) == PREFILL_END
    assert _kv(bare, (0, "other", "peak", 2)) is None


def test_the_encoders_prefills_are_saved_and_read_back(tmp_path):
    tr = _trace(held=((True, True), (True, False)))
    path = tmp_path / "t.json"
    memprof.Report(tr).save(path)
    back = memprof.load(path).trace
    assert back.generation == tr.generation
    assert back.generation.encoder_prefills == ((0, 0),)
    # A file without the field reads as none.
    data = json.loads(path.read_text())
    del data["generation"]["encoder_prefills"]
    path.write_text(json.dumps(data))
    assert memprof.load(path).trace.generation.encoder_prefills == ()
