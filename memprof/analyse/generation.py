"""A generation in a few figures: what the text report's and the HTML page's "Generation" sections show.

Computed once here, from the trace's prefill and decode phases and its :class:`~memprof.record.parts.GenerationFacts`,
so that the two views cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..vocabulary import Category, Phase

if TYPE_CHECKING:
    from ..record.trace import Trace

__all__ = ["GenerationSummary", "generation_summary"]


@dataclass(frozen=True)
class GenerationSummary:
    """The figures of a run that decoded with a cache (None: the run did not record it).

    ``prompt_tokens``: the tokens the (first) prefill put in the cache: the prompt, or an encoder-decoder
    model's decoder start; ``encoder_tokens``: an encoder-decoder model's encoder input. ``cache_at_end``: the
    kv_cache at the end of the last prefill or decode call, holding ``tokens_at_end`` tokens. ``growth_per_token``:
    what the last call added to the cache per token it added (None with fewer than two decode calls, or where
    the bytes do not divide by the tokens). ``temporaries``: the temporaries at the first and the last decode
    phase's peak.
    """

    batch: "int | None"
    prompt_tokens: "int | None"
    encoder_tokens: "int | None"
    decode_phases: int
    tokens_at_end: "int | None"
    cache_at_end: "int | None"
    growth_per_token: "int | None"
    temporaries: "tuple[int | None, int | None] | None"


def generation_summary(trace: "Trace") -> "GenerationSummary | None":
    """The summary of ``trace``'s generation, or None for a run that did not decode with a cache."""
    gen = trace.generation
    if gen is None:
        return None
    calls = [p for p in trace.phases if p.phase in (Phase.PREFILL, Phase.DECODE)]
    prefills = [p for p in calls if p.phase is Phase.PREFILL]
    decodes = [p for p in calls if p.phase is Phase.DECODE]
    tokens = [gen.tokens_at(p.step, p.phase.value, p.occurrence) for p in calls]
    prompt = gen.tokens_at(prefills[0].step, "prefill", prefills[0].occurrence) if prefills else None
    at_end = tokens[-1] if tokens else (gen.tokens[-1][3] if gen.tokens else None)
    kv = [p.end[Category.KV_CACHE] for p in calls]
    growth = None
    if len(decodes) >= 2 and None not in kv[-2:] and None not in tokens[-2:]:
        added_bytes = kv[-1] - kv[-2]  # type: ignore[operator]
        added_tokens = tokens[-1] - tokens[-2]  # type: ignore[operator]
        if added_tokens > 0 and added_bytes % added_tokens == 0:
            growth = added_bytes // added_tokens
    temps = (decodes[0].peak[Category.TEMPORARIES], decodes[-1].peak[Category.TEMPORARIES]) if len(decodes) >= 2 \
        else None
    return GenerationSummary(batch=gen.batch, prompt_tokens=prompt, encoder_tokens=gen.encoder_tokens,
                             decode_phases=len(decodes), tokens_at_end=at_end, cache_at_end=kv[-1] if kv else None,
                             growth_per_token=growth, temporaries=temps)
