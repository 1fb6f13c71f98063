"""What every renderer shares: one spelling for a missing figure, one palette, one module table.

Renderers take a Trace (or anything holding one as ``.trace``, through ``as_trace``) or a result of
:mod:`memprof.analyse` or :mod:`memprof.simulate` and return output; none of them reaches back into a profile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple, TypedDict

from ..vocabulary import Category, Phase
from ..record.trace import Breakdown, parent_path
from ..units import format_bytes

if TYPE_CHECKING:
    from ..record.trace import Trace

__all__ = ["NOT_MEASURED", "NO_FORMULA", "NO_ESTIMATE", "quiet", "size", "signed", "CATEGORY_COLORS", "PHASE_COLORS",
           "WATERFALL_COLORS", "own_rows", "clip_path", "largest", "ModuleColumns", "module_columns"]

#: A figure the run did not measure: never printed as 0.
NOT_MEASURED = "not measured"
#: A category the textbook has no formula for at that moment.
NO_FORMULA = "no formula"
#: A category an estimate has no figure for (its simulation did not reproduce it).
NO_ESTIMATE = "no estimate"

#: One color per category, used by every plot and by the HTML report. Mid-tone
#: colors (seaborn's "deep" palette) that keep their contrast on light and dark backgrounds.
CATEGORY_COLORS: dict[Category, str] = {
    Category.WEIGHTS: "#4C72B0",
    Category.BUFFERS: "#8172B3",
    Category.GRADIENTS: "#DD8452",
    Category.OPTIMIZER_STATES: "#C44E52",
    Category.ACTIVATIONS: "#55A868",
    Category.INPUTS: "#937860",
    Category.KV_CACHE: "#2F8F8F",
    Category.COMMUNICATION: "#7F7F3F",
    Category.TEMPORARIES: "#CCB974",
    Category.ALLOCATOR_OVERHEAD: "#64B5CD",
    Category.OUTSIDE_TORCH: "#DA8BC3",
}

def quiet(cat: Category, *values: "int | None") -> bool:
    """A row a table leaves out: the KV cache of a run that kept none (training), collective buffers of a run
    on one process, and either in files from before the category existed. Every other category is shown,
    "not measured" included."""
    return cat in (Category.KV_CACHE, Category.COMMUNICATION) and not any(values)


#: Background bands of the timeline, one color per phase.
PHASE_COLORS: dict[Phase, str] = {
    Phase.FORWARD: "#4C72B0",
    Phase.BACKWARD: "#DD8452",
    Phase.OPTIMIZER: "#C44E52",
    Phase.OTHER: "#8C8C8C",
    Phase.PREFILL: "#4C72B0",
    Phase.DECODE: "#2F8F8F",
}

#: Waterfall colors: increases, decreases, and the start / end totals.
WATERFALL_COLORS = {"up": "#C44E52", "down": "#55A868", "total": "#4C72B0", "unexplained": "#8C8C8C"}


def size(n: "int | None", missing: str = NOT_MEASURED) -> str:
    """Bytes in IEC units, or ``missing`` for a figure that does not exist (never "0")."""
    return missing if n is None else format_bytes(n)


def signed(n: "int | None", missing: str = "") -> str:
    """A signed delta: ``+1.5 KiB``, ``-3 B``, ``0 B``."""
    if n is None:
        return missing
    return ("+" if n > 0 else "") + format_bytes(n)


def largest(bd: Breakdown) -> str:
    """The largest measured category of a breakdown, in words (``activations 4.5 MiB``)."""
    measured = [(c, v) for c, v in bd.measured().items() if v]
    if not measured:
        return "-"
    c, v = max(measured, key=lambda cv: cv[1])
    return f"{c.value} {format_bytes(v)}"


def clip_path(s: str, n: int) -> str:
    """``s`` in at most ``n`` characters: a dotted module path keeps its first parts and its last one
    (``encoder.block.3…wo``), which tell blocks apart; anything else keeps its start."""
    if len(s) <= n:
        return s
    parts = s.split(".")
    if len(parts) < 2 or len(parts[-1]) + 2 > n:
        return s[: n - 1] + "…"
    head, tail = "", parts[-1]
    for part in parts[:-1]:
        candidate = f"{head}.{part}" if head else part
        if len(candidate) + 1 + len(tail) > n:
            break
        head = candidate
    for part in reversed(parts[len(head.split(".")) if head else 0:-1]):
        candidate = f"{part}.{tail}"
        if len(head) + 1 + len(candidate) > n:
            break
        tail = candidate
    if not head:
        return (parts[0][: n - len(tail) - 2] + "…" + tail) if n - len(tail) - 2 > 0 else "…" + tail[-(n - 1):]
    return f"{head}…{tail}"


class ModuleColumns(NamedTuple):
    """What a module table of a run shows: the saved activations (and ranks by them), the backward peaks,
    and its title."""

    saved: bool
    backward: bool
    title: str


def module_columns(trace: "Trace") -> ModuleColumns:
    """The module table's columns for ``trace``. A run in which no backward ran (inference) has no
    backward peak to show, and, unless a forward under autograd kept tensors all the same (or what was
    saved is not measured), no saved activations either: its table ranks the modules by the peak of
    their forward calls instead of showing columns of 0 B and "not measured"."""
    backward = (any(p.phase is Phase.BACKWARD for p in trace.phases)
                or any(s.phase is Phase.BACKWARD for s in trace.phase_stats)
                or any(m.peak_backward is not None for m in trace.modules))
    saved = backward or any(m.activations is None or m.activations > 0 for m in trace.modules)
    if saved:
        return ModuleColumns(True, backward, "Top modules by saved activations")
    return ModuleColumns(False, False, "Top modules by peak forward (no backward ran: nothing was saved for one)")


class OwnRow(TypedDict):
    """A row of :func:`own_rows`: a leaf module, or a container's own ops (``own``), and its bytes."""

    path: str
    type: str
    own: bool
    label: str
    activations: "int | None"
    parameters: "int | None"
    peak_forward: "int | None"


#: The byte columns of an :class:`OwnRow`.
OwnFigure = Literal["activations", "parameters", "peak_forward"]


def own_rows(trace: "Trace", include_own: bool) -> list[OwnRow]:
    """Leaf modules, plus the part of each container that its own ops hold.

    A container's figures include its children's, so showing both would count
    bytes twice. Its *own* share (its figure minus its direct children's, never
    below 0) is what ops written in its ``forward`` saved, such as the
    attention scores of a hand-written attention block.
    """
    mods = {m.path: m for m in trace.modules}
    children: dict[str, list[str]] = {p: [] for p in mods}
    for path in mods:
        if path == "<model>":
            continue
        parent = parent_path(path) or "<model>"
        while parent not in mods and parent != "<model>":
            parent = parent_path(parent) or "<model>"
        if parent in children:
            children[parent].append(path)
    rows: list[OwnRow] = []
    for path, m in mods.items():
        kids = children.get(path, [])
        if not kids:
            if path == "<model>":
                continue
            rows.append({"path": path, "type": m.type, "own": False, "label": f"{path} ({m.type})",
                         "activations": m.activations, "parameters": m.parameters,
                         "peak_forward": m.peak_forward})
            continue
        if not include_own:
            continue
        act = None
        if m.activations is not None:
            act = max(0, m.activations - sum(mods[k].activations or 0 for k in kids))
        params = max(0, (m.parameters or 0) - sum(mods[k].parameters or 0 for k in kids))
        if act or params:
            rows.append({"path": path, "type": m.type, "own": True, "label": f"{path} ({m.type}, own ops)",
                         "activations": act, "parameters": params, "peak_forward": None})
    return rows
