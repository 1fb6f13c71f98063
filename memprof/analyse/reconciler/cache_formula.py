"""The cache formula at a moment of a recorded generation: :mod:`memprof.anatomy.caches` applied to the
run's :class:`~memprof.record.parts.GenerationFacts`.

The bytes come from the model's config (its :class:`~memprof.anatomy.CacheSpec`); the run gives the
batch, the element size, the tokens around each call and, at a peak inside a call, how many of the
storages the call put in the cache existed by then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...anatomy.caches import CacheSpec, bytes_at, call_slots
from ...vocabulary import Phase
from ...errors import MemprofError, is_interrupt

if TYPE_CHECKING:
    from ...record.parts import GenerationFacts, PhaseRecord
    from ...record.trace import Trace

__all__ = ["cache_formula", "cache_spec_of"]

_CALLS = (Phase.PREFILL, Phase.DECODE)


def cache_spec_of(gen: "GenerationFacts") -> "CacheSpec | None":
    """The run's cache spec; for a file written before memprof recorded one, the uniform attention cache its
    shape fields describe (every layer full attention, or sliding-window attention with a window)."""
    try:
        if gen.cache is not None:
            return CacheSpec.from_dict(dict(gen.cache))
        if None in (gen.layers, gen.kv_heads, gen.head_dim):
            return None
        kind = "sliding_attention" if gen.sliding_window else "full_attention"
        return CacheSpec(layers=(kind,) * int(gen.layers or 0), kv_heads=int(gen.kv_heads or 0),
                         head_dim=int(gen.head_dim or 0), sliding_window=gen.sliding_window or None)
    # A file whose numbers make no cache: no formula rather than a wrong one.
    except (MemprofError, TypeError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return None


def cache_formula(trace: "Trace", moment: "PhaseRecord", which: str) -> "int | None":
    """The cache's bytes at ``which`` (``"start"``, ``"peak"`` or ``"end"``) of the phase ``moment``.

    Between calls (the loop's "other" phases) the cache is what the last call left; at the start of a call,
    what the call before it left. None where there is no formula: no spec, no element size (keys and
    values of different dtypes), before the first call, and after the last one but at its start (whether
    the caller still holds the cache then is not the model's to say).
    """
    gen = trace.generation
    spec = cache_spec_of(gen) if gen is not None else None
    if gen is None or spec is None or gen.batch is None or gen.itemsize is None:
        return None
    try:
        return _formula(trace, gen, spec, moment, which)
    except MemprofError as failure:  # token counts that contradict each other (a hand-edited file): no formula
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return None


def _formula(trace: "Trace", gen: "GenerationFacts", spec: CacheSpec, moment: "PhaseRecord", which: str
             ) -> "int | None":
    calls = [p for p in trace.phases if p.phase in _CALLS and gen.tokens_at(p.step, p.phase.value, p.occurrence)
             is not None]
    here = next((i for i, p in enumerate(trace.phases) if _same(p, moment)), None)
    if here is None:
        return None
    before = [p for p in trace.phases[:here] if any(p is c for c in calls)]
    is_call = any(_same(c, moment) for c in calls)
    if not is_call and not before:
        following = trace.phases[here + 1] if here + 1 < len(trace.phases) else None
        if which == "end" and following is not None and any(following is c for c in calls):
            # What comes in with the first call: an encoder's output, claimed as that call begins (none where
            # the encoder runs in that call's phase).
            return _first_start(spec, gen, following)
        return None  # before the first call: no cache yet
    held = gen.moment(moment.step, moment.phase.value, moment.occurrence, which) if not is_call else None
    if held is not None and before:
        # Between or after the calls: the run recorded whether the last call's cache object was still held then.
        return _at(spec, gen, calls, before[-1], "end") if held.written else 0
    if not is_call and which != "start" and not any(any(p is c for c in calls) for p in trace.phases[here:]):
        return None  # after the last call the cache lives as long as the caller holds it (generate() drops it)
    if is_call and which == "start" and moment.phase is Phase.PREFILL:
        return _first_start(spec, gen, moment)  # a prefill fills a cache of its own, empty when it begins
    if not is_call or which == "start":
        if before:
            return _at(spec, gen, calls, before[-1], "end")
        return _first_start(spec, gen, moment)
    return _at(spec, gen, calls, moment, which)


def _first_start(spec: CacheSpec, gen: "GenerationFacts", call: "PhaseRecord") -> int:
    """The cache as a generation's first call begins: only what comes in with it (an encoder's output, unless
    the encoder runs in that call's phase)."""
    assert gen.batch is not None and gen.itemsize is not None  # cache_formula checked
    slots = call_slots(spec, batch=gen.batch, itemsize=gen.itemsize, before=0, after=0,
                       encoder_tokens=gen.encoder_tokens or 0, max_cache_len=gen.max_cache_len,
                       encoder_made=_encoder_made(gen, call))
    return sum(s.before for s in slots)


def _encoder_made(gen: "GenerationFacts", call: "PhaseRecord") -> bool:
    """Did this call's phase begin with the encoder's forward (so that it makes the encoder's output)?"""
    return call.phase is Phase.PREFILL and (call.step, call.occurrence) in gen.encoder_prefills


def _same(a: "PhaseRecord", b: "PhaseRecord") -> bool:
    return a is b or (a.step, a.phase, a.occurrence) == (b.step, b.phase, b.occurrence)


def _at(spec: CacheSpec, gen: "GenerationFacts", calls: list[PhaseRecord], phase: "PhaseRecord", which: str) -> int:
    key = (phase.step, phase.phase.value, phase.occurrence)
    m = gen.moment(*key, which)
    if which == "peak" and (m is None or m.written is None):
        which, m = "end", gen.moment(*key, "end")  # where the call had got is unknown: its end
    if m is not None:
        earlier, before, after = m.earlier, m.before, m.after
    else:  # a file without cache moments: the tokens after each call, one call per phase
        tokens = [gen.tokens_at(p.step, p.phase.value, p.occurrence) or 0 for p in calls]
        i = next(i for i, p in enumerate(calls) if _same(p, phase))
        after = tokens[i]
        before = tokens[i - 1] if i >= 1 and phase.phase is Phase.DECODE else 0
        earlier = tokens[i - 2] if i >= 2 and before and calls[i - 1].phase is Phase.DECODE else 0
    assert gen.batch is not None and gen.itemsize is not None  # cache_formula checked
    slots = call_slots(spec, batch=gen.batch, itemsize=gen.itemsize, before=before, after=after,
                       earlier=earlier, max_cache_len=gen.max_cache_len, encoder_tokens=gen.encoder_tokens or 0,
                       encoder_made=_encoder_made(gen, phase))
    if which == "peak" and m is not None and m.written is not None:
        return bytes_at(slots, written=m.written, overlap=m.overlap)
    return sum(s.after for s in slots)

