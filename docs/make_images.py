"""Regenerate the figures of docs/notebooks.md, docs/viewers.md and docs/oom.md (docs/images/*.png).

Run from the repository root:  python docs/make_images.py
It profiles three AdamW steps of a small built-in TinyGPT on CPU (a few
seconds), draws the three plots of memprof.plot, and, where Chromium is
installed (Debian's chromium package), takes screenshots of the standalone
HTML report of that run and of an OOM dump in a headless browser.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import tempfile

import matplotlib

matplotlib.use("Agg")

import torch

import memprof
from memprof.vocabulary import Category
from memprof.demo import TinyGPT, synthetic_tokens
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


def oom_dump(folder: str) -> memprof.Report:
    """Three steps of TinyGPT, then an out-of-memory error halfway through the fourth forward."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=500, hidden=128, layers=2, heads=4, max_seq=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def explode(module, args):
        if prof.phases.step == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB (a stand-in for the GPU)")

    handle = model.blocks[1].register_forward_pre_hook(explode)
    try:
        with memprof.profile(model, optimizer, oom_dump=folder) as prof:
            for i in range(4):
                x, y = synthetic_tokens(batch=8, seq=64, vocab=500, seed=i)
                TinyGPT.loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    except torch.OutOfMemoryError:
        pass
    finally:
        handle.remove()
    assert prof.oom_dump_path is not None
    return memprof.load(prof.oom_dump_path)


def screenshot(report: memprof.Report, name: str, height: int) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print(f"no chromium: {name} not redrawn (apt-get install -y chromium)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        page = pathlib.Path(tmp) / "report.html"
        report.export_html(page)
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={tmp}/profile", f"--window-size=1000,{height}",
                        f"--screenshot={OUT / name}", page.as_uri()], check=True, capture_output=True, timeout=120)
    print(f"wrote {OUT / name}")


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
    screenshot(report, "html-report.png", 900)
    with tempfile.TemporaryDirectory() as folder:
        screenshot(oom_dump(folder), "oom-report.png", 700)


if __name__ == "__main__":
    main()
