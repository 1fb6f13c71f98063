"""The standalone HTML page of a real ``generate()`` shows the text report's "Generation" section, figure for
figure, for a decoder-only model and an encoder-decoder one."""

from __future__ import annotations

import html
import re
import warnings

import pytest
import torch

import memprof
from memprof import Category as C
from memprof.vocabulary import Phase

T = pytest.importorskip("transformers")


def _llama():
    return T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64)), \
        {"input_ids": torch.randint(3, 64, (2, 12))}


def _t5():
    return T.T5ForConditionalGeneration(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0)), \
        {"input_ids": torch.randint(3, 64, (2, 10))}


@pytest.mark.parametrize("build", [_llama, _t5], ids=["llama", "t5"])
def test_the_page_of_a_generation_shows_the_text_reports_generation_section(build, tmp_path):
    torch.manual_seed(0)
    model, inputs = build()
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with memprof.profile(model) as prof:
            model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    report = prof.report()
    text = str(report).splitlines()
    i = next(n for n, line in enumerate(text) if line.startswith("Generation:"))
    section = [text[i]] + [line for line in text[i + 1:i + 4]]
    report.export_html(tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    m = re.search(r">(Generation: [^<]*)</div>(<table.*?</table>)", page, re.S)
    assert m is not None
    cells = [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
             for row in re.findall(r"<tr.*?</tr>", m.group(2), re.S)]
    cells = [c for c in cells if c]  # the heading row has no <td>
    # The same heading and the same figures, line for line.
    assert [html.unescape(m.group(1))] + [f"  {k}: {v}" for k, v in cells] == section
    # And those figures are the run's: the cache at the end of the last decode call, 4 decode calls.
    last = [p for p in report.trace.phases if p.phase is Phase.DECODE][-1]
    assert f"  kv_cache at the end of the last call: {memprof.units.format_bytes(last.end[C.KV_CACHE])}" in section
    assert ", 4 decode phase(s), " in section[0]
