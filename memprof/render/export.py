"""Writing a run in the formats other viewers open: Chrome/Perfetto, memory_viz, a standalone HTML page.

Each function takes a Trace and a path, refuses a run with nothing measured (rather than write an empty
file) and writes atomically. :class:`memprof.Report` has them as methods, and ``memprof export`` on the
command line.
"""

from __future__ import annotations

import os
import pickle
from typing import TYPE_CHECKING, Sequence

from ..errors import NotMeasuredError
from ..record.files import write_bytes_atomic, write_json_atomic, write_text_atomic
from ..record.trace import as_trace

if TYPE_CHECKING:
    from ..analyse.generation import GenerationSummary
    from ..analyse.reconciler import Reconciliation
    from ..record.trace import Trace

__all__ = ["export_chrome_trace", "export_memory_viz", "export_html", "html_page"]


def _measured(trace: "Trace", what: str, *, live_is_enough: bool = False) -> "Trace":
    t = as_trace(trace)
    if not t.phases and not (live_is_enough and t.live_at_error is not None):
        raise NotMeasuredError(
            f"nothing to export as {what}: the run recorded no phase (nothing ran inside the profile, or a "
            "schedule recorded no step); profile at least one forward, backward or optimizer step")
    return t


def export_chrome_trace(trace: "Trace", path: "str | os.PathLike[str]") -> None:
    """Write the run as a Chrome trace (JSON) for ui.perfetto.dev and chrome://tracing: a counter track
    per category and the total, spans for steps, phases and module calls, an instant event at each
    phase's peak with its composition (see :mod:`memprof.render.chrome`)."""
    from .chrome import chrome_trace

    doc = chrome_trace(_measured(trace, "a Chrome trace"))
    write_json_atomic(path, doc)


def export_memory_viz(trace: "Trace", path: "str | os.PathLike[str]") -> None:
    """Write the run as a pickled memory snapshot that pytorch.org/memory_viz and
    ``torch.cuda._memory_viz`` open, each block's frames naming its category, module and phase
    (what a block stands for: :mod:`memprof.render.memory_viz`)."""
    from .memory_viz import memory_viz_snapshot

    snap = memory_viz_snapshot(_measured(trace, "a memory_viz snapshot"))
    write_bytes_atomic(path, pickle.dumps(snap, protocol=4))


def html_page(trace: "Trace", reconciliation: "Reconciliation | str | None" = None,
              levers: "Sequence[str]" = (), generation: "GenerationSummary | None" = None) -> str:
    """The report as one self-contained HTML document (no script, no network): peak composition,
    timeline, phases, modules, ``reconciliation`` (see :func:`memprof.render.page.report_page`); an OOM dump
    leads with what was live then and its ``levers``; a generation has its ``generation`` section."""
    from .page import report_page

    # An OOM dump taken before any phase closed still holds what was live: a page worth writing.
    return report_page(_measured(trace, "an HTML report", live_is_enough=True), reconciliation, levers, generation)


def export_html(trace: "Trace", path: "str | os.PathLike[str]",
                reconciliation: "Reconciliation | str | None" = None, levers: "Sequence[str]" = (),
                generation: "GenerationSummary | None" = None) -> None:
    """Write :func:`html_page` to ``path``."""
    write_text_atomic(path, html_page(trace, reconciliation, levers, generation))
