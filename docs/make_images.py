"""Regenerate the figures of docs/notebooks.md (docs/images/*.png).

Run from the repository root:  python docs/make_images.py
It profiles three AdamW steps of a small built-in TinyGPT on CPU (a few
seconds) and draws the three plots of memprof.plot.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")

import torch

import memprof
from memprof.categories import Category
from memprof.examples import TinyGPT, synthetic_tokens
from memprof.render.plot import plot_modules, plot_timeline, plot_waterfall

OUT = pathlib.Path(__file__).resolve().parent / "images"


def profile_tinygpt() -> memprof.Report:
    torch.manual_seed(0)
    model = TinyGPT(vocab=500, hidden=128, layers=2, heads=4, max_seq=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [synthetic_tokens(batch=8, seq=64, vocab=500, seed=i) for i in range(3)]
    with memprof.profile(model, optimizer) as prof:
        for x, y in batches:
            TinyGPT.loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return prof.report()


def growth_steps(report: memprof.Report) -> list[tuple[str, int]]:
    """From the start of profiling to the global peak, category by category (what docs/notebooks.md shows)."""
    start, peak = report.start, report.peak
    steps = [("start of profiling", start.total)]
    for cat in Category:
        if start[cat] is not None and peak[cat] is not None and peak[cat] != start[cat]:
            steps.append((cat.value, peak[cat] - start[cat]))
    steps.append(("peak", peak.total))
    return steps


def main() -> None:
    OUT.mkdir(exist_ok=True)
    report = profile_tinygpt()
    figures = {
        "timeline.png": plot_timeline(report),
        "modules.png": plot_modules(report, top=12),
        "waterfall.png": plot_waterfall(growth_steps(report), title="From the start of profiling to the peak"),
    }
    for name, fig in figures.items():
        fig.savefig(OUT / name, dpi=100)
        print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
