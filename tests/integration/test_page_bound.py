"""The standalone HTML page stays under 2 MB for the worst trace that can be built: every part of it that grows
with the trace is capped (phase bands, notes, module and live-module rows, the curve's points, each text), and
what a cap leaves out is counted on the page."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest

import memprof
from memprof.record.parts import DeviceInfo, OomRecord, RankInfo
from memprof.record.trace import Sample, as_trace
from memprof.render.svg import MAX_DRAWN_BANDS
from memprof.vocabulary import Phase

from factories import bd, module, phase, trace


def report_page(t) -> str:
    """The standalone page as users get it, the reconciliation the facade computes included."""
    return memprof.Report(as_trace(t)).to_html()


# Every character of this escapes to 6 on the page (&quot;): the largest a text can grow.
QUOTES = '"' * 50_000
# Every category measured and not 0, so that the curve draws one area per category.
ALL = dict(weights=144, buffers=8, gradients=144, optimizer_states=288, activations=96, inputs=32, kv_cache=64,
           communication=16, temporaries=48, allocator_overhead=512, outside_torch=1024)
LIMIT = 2 * 2**20


@functools.cache
def _all(temporaries: int = 48):
    """``ALL`` with ``temporaries`` bytes of temporaries; Breakdowns are frozen, so the 160,000 a worst trace holds
    share the few hundred distinct ones (building each afresh took most of a test's time)."""
    return bd(**{**ALL, "temporaries": temporaries})


def _worst(steps, *, overlap, text=QUOTES, notes=None, modules=2000):
    """``steps`` steps of forward, backward and optimizer, a timeline sample per half step, a note per step and
    ``modules`` modules, every text as long as ``text``; phases either each spanning the whole run
    (``overlap``: a trace built by hand, which the loader refuses) or one after another."""
    phases = [phase(s, kind, start=_all(), peak=_all(48 + s % 97 + j), end=_all())
              for s in range(steps) for j, kind in enumerate(("forward", "backward", "optimizer"))]
    span = 1e9 / len(phases)
    phases = [dataclasses.replace(p, start_us=0.0, peak_us=1.0, end_us=1e9) if overlap else
              dataclasses.replace(p, start_us=i * span, peak_us=(i + 0.5) * span, end_us=(i + 1) * span)
              for i, p in enumerate(phases)]
    samples = tuple(Sample(i, i // 2, Phase.FORWARD, text[:1000], _all(i % 1000),
                           time_us=(i + 0.5) * span * 1.5, event="enter") for i in range(2 * steps))
    t = trace(phases=tuple(phases), timeline=samples, device="cuda",
              modules=tuple(module(f"{text[:3000]}{i}", text[:3000], parameters=144 + i, gradients=144,
                                   activations=96 + i) for i in range(modules)),
              notes=tuple(f"{text}{i}" for i in range(steps if notes is None else notes)),
              error=text, oom=OomRecord(text, requested=10, snapshot=text), live_at_error=_all(),
              live_modules_at_error=tuple((f"{text[:3000]}{i}", 100 + i) for i in range(modules)),
              peak_module=f"{text[:3000]}0" if modules else None, optimizer=text, torch_version=text, memprof_version=text,
              distributed=RankInfo(rank=0, world_size=8, backend=text, layout=text))
    return dataclasses.replace(t, device=DeviceInfo(type="cuda", name=text, rounding=512))


def _size(t) -> int:
    return len(report_page(t).encode("utf-8"))


@pytest.fixture(scope="module")
def worst_page() -> str:
    """The page of the worst trace built by hand (20,000 steps), made once for the tests that only read it."""
    return report_page(_worst(20_000, overlap=True))


def test_the_worst_trace_built_by_hand_makes_a_bounded_page_and_counts_what_it_left_out(worst_page):
    page = worst_page
    assert len(page.encode("utf-8")) < LIMIT
    # 60,000 phases (none "other"), each as wide as the plot: 1,296 bands drawn (twice the plot's 648 pixels), the
    # last an optimizer's; of the 58,704 phases after it each optimizer joins that band (same kind, overlapping),
    # the forward and backward ones are counted: 58,704 x 2 / 3 = 39,136.
    assert MAX_DRAWN_BANDS == 1_296
    assert "… 39,136 more phase bands not drawn (phases overlap)" in page
    # 20,000 notes of 50,000 characters: ten, cut at 2,000 characters each, make the 20,000 the notes may show.
    assert "… 19,990 more in report.trace.notes" in page
    assert len(re.findall(r"… \(48,00\d more characters\)</li>", page)) == 10


def test_the_page_does_not_grow_with_the_trace(worst_page):
    # Ten times the steps, notes, modules and samples: the same page but for the counts' digits.
    small, large = _size(_worst(2_000, overlap=True, modules=200)), len(worst_page.encode("utf-8"))
    assert abs(large - small) < 2_000, (small, large)
