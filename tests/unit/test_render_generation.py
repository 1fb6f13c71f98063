"""The "Generation" section of a hand-built generation's reports: the text report's lines and the HTML page's
heading and table show the same figures (memprof.analyse.generation.generation_summary, computed once)."""

from __future__ import annotations

import html
import re

import memprof
from memprof.analyse.generation import generation_summary
from memprof.record.parts import GenerationFacts

from factories import bd, phase, trace


def report_html(t) -> str:
    """The notebook view as the facade makes it: the renderer is handed the generation's summary."""
    return memprof.Report(t)._repr_html_()


def report_page(t) -> str:
    """The standalone page as the facade makes it."""
    return memprof.Report(t).to_html()

# One token of cache: 2 layers x K,V x batch 2 x 2 heads x 8 x 4 B = 512 B.
TOKEN = 2 * 2 * 2 * 2 * 8 * 4


def _generation(*, encoder_tokens=None, last_tokens=7):
    """A prefill of 4 tokens, decode calls to 5 and 6 tokens, then a last decode phase ending at ``last_tokens``
    (more than one more: decode calls folded into one phase); temporaries at the decode peaks 100, 110, 120 B."""
    tokens = (4, 5, 6, last_tokens)
    phases = []
    for i, n in enumerate(tokens):
        kind, occ = ("prefill", 0) if i == 0 else ("decode", i - 1)
        before = bd(weights=1000, kv_cache=tokens[i - 1] * TOKEN if i else 0)
        peak = bd(weights=1000, kv_cache=n * TOKEN, temporaries=90 + 10 * i)
        end = bd(weights=1000, kv_cache=n * TOKEN)
        phases.append(phase(0, kind, start=before, peak=peak, end=end, occurrence=occ))
        phases.append(phase(0, "other", start=end, peak=end, end=end, occurrence=i))
    gen = GenerationFacts(layers=2, kv_heads=2, head_dim=8, itemsize=4, batch=2, encoder_tokens=encoder_tokens,
                          tokens=tuple((0, p.phase.value, p.occurrence, n) for p, n in zip(phases[::2], tokens)))
    return trace(phases=tuple(phases), generation=gen)


def _section(markup):
    """The generation section of a page: its heading and its table's rows, as text."""
    m = re.search(r">(Generation: [^<]*)</div>(<table.*?</table>)", markup, re.S)
    assert m is not None
    rows = [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", r, re.S)]
            for r in re.findall(r"<tr.*?</tr>", m.group(2), re.S)]
    return html.unescape(m.group(1)), rows


def test_the_text_report_and_the_page_show_the_same_generation_figures():
    t = _generation()
    text = str(memprof.Report(t)).splitlines()
    start = text.index(next(line for line in text if line.startswith("Generation:")))
    # The last decode phase took the cache from 6 to 7 tokens: +512 B per token; 7 tokens are 3584 B = 3.5 KiB.
    assert text[start:start + 4] == [
        "Generation: batch 2, prompt 4 tokens, 3 decode phase(s), 7 tokens in the cache at the end",
        "  kv_cache at the end of the last call: 3.5 KiB",
        "  kv_cache per token: +512 B",
        "  temporaries at the decode peaks: 100 B (first) to 120 B (last)"]
    for markup in (report_html(t), report_page(t)):
        assert _section(markup) == (
            "Generation: batch 2, prompt 4 tokens, 3 decode phase(s), 7 tokens in the cache at the end",
            [["generation", ""], ["kv_cache at the end of the last call", "3.5 KiB"],
             ["kv_cache per token", "+512 B"], ["temporaries at the decode peaks", "100 B (first) to 120 B (last)"]])


def test_a_folded_last_phase_grows_per_token_not_per_phase():
    # Decode calls to 10 tokens folded into the last phase: 4 tokens added, (10 - 6) x 512 B, +512 B per token.
    g = generation_summary(_generation(last_tokens=10))
    assert (g.tokens_at_end, g.cache_at_end, g.growth_per_token) == (10, 10 * TOKEN, TOKEN)


def test_an_encoder_decoder_generation_names_its_encoder_input_and_decoder_prompt():
    t = _generation(encoder_tokens=12)
    head = "Generation: batch 2, encoder 12 tokens, decoder prompt 4 tokens, 3 decode phase(s), 7 tokens in the " \
        "cache at the end"
    assert head in str(memprof.Report(t)).splitlines()
    assert _section(report_page(t))[0] == head


def test_a_run_without_a_generation_has_no_section():
    t = _generation()
    plain = trace(phases=t.phases)
    assert generation_summary(plain) is None
    assert "Generation:" not in report_page(plain) and "Generation:" not in str(memprof.Report(plain))
