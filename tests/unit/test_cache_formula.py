"""The kv_cache formula of a recorded generation (memprof.analyse.reconciler.cache_formula) on hand-built traces: a trace
that records where each call had got at its peak, and one saved before memprof recorded cache moments."""

from __future__ import annotations

from factories import bd, phase, trace

from memprof.anatomy import CacheSpec
from memprof.record.cache import CacheMoment
from memprof.analyse.reconciler.formula import formula_at
from memprof.record.parts import GenerationFacts

# One layer's K or V per token: 2 key/value heads x 8 x 4 B, batch 1.
PER = 2 * 8 * 4


def _phases(kv):
    """prefill, other, decode 0, other, decode 1 (the loop's work between calls), kv_cache as given per call:
    (start, peak, end)."""
    out = []
    for i, (name, occ) in enumerate((("prefill", 0), ("decode", 0), ("decode", 1))):
        start, peak, end = (bd(kv_cache=v) for v in kv[i])
        out.append(phase(0, name, start=start, peak=peak, end=end, occurrence=occ))
        if i < 2:
            out.append(phase(0, "other", start=end, peak=end, end=end, occurrence=i))
    return tuple(out)


def _kv(tr, at):
    return formula_at(tr, at)["kv_cache"]


def test_a_recorded_peak_counts_what_the_call_had_written_by_then():
    spec = CacheSpec(layers=("full_attention",) * 2, kv_heads=2, head_dim=8)
    moments = (CacheMoment(0, "prefill", 0, "peak", 0, 0, 4, written=3), CacheMoment(0, "prefill", 0, "end", 0, 0, 4),
               CacheMoment(0, "decode", 0, "peak", 0, 4, 5, written=4, overlap=True),
               CacheMoment(0, "decode", 0, "end", 0, 4, 5), CacheMoment(0, "decode", 1, "peak", 4, 5, 6, written=0),
               CacheMoment(0, "decode", 1, "end", 4, 5, 6))
    gen = GenerationFacts(layers=2, kv_heads=2, head_dim=8, itemsize=4, batch=1, cache=spec.to_dict(),
                          tokens=((0, "prefill", 0, 4), (0, "decode", 0, 5), (0, "decode", 1, 6)), moments=moments)
    tr = trace(phases=_phases([(0, 3 * 4 * PER, 4 * 4 * PER), (4 * 4 * PER, 0, 4 * 5 * PER),
                               (4 * 5 * PER, 0, 4 * 6 * PER)]), generation=gen)
    # The prefill's peak after layer 0's K and V and layer 1's K: 3 slots x 4 tokens.
    assert _kv(tr, (0, "prefill", "peak")) == 3 * 4 * PER
    # Decode 0's peak at the concatenation of layer 1's V: 4 slots of 5 tokens and the old V of 4.
    assert _kv(tr, (0, "decode", "peak", 0)) == 4 * 5 * PER + 4 * PER
    # Decode 1's peak before any write: the 5 tokens the call found; its start, the same; the loop between calls.
    assert _kv(tr, (0, "decode", "peak", 1)) == _kv(tr, (0, "decode", "start", 1)) == 4 * 5 * PER
    assert _kv(tr, (0, "other", "end", 1)) == 4 * 5 * PER
    assert _kv(tr, (0, "decode", "end", 1)) == 4 * 6 * PER


def test_an_older_file_gets_the_uniform_cache_at_its_tokens():
    # No cache spec nor moments: every layer sliding-window attention (window 4), the tokens after each call.
    gen = GenerationFacts(layers=2, kv_heads=2, head_dim=8, sliding_window=4, itemsize=4, batch=1,
                          tokens=((0, "prefill", 0, 6), (0, "decode", 0, 7), (0, "decode", 1, 8)))
    tr = trace(phases=_phases([(0, 0, 0)] * 3), generation=gen)
    # The prefill's 6 tokens, then min(6, 3) + 1 = 4 per layer; a peak without a record is the call's end.
    assert _kv(tr, (0, "prefill", "end")) == _kv(tr, (0, "prefill", "peak")) == 4 * 6 * PER
    assert _kv(tr, (0, "decode", "start", 0)) == 4 * 6 * PER
    assert _kv(tr, (0, "decode", "end", 0)) == _kv(tr, (0, "decode", "end", 1)) == 4 * 4 * PER
