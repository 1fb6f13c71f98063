"""A rank's per-degree formula table (:class:`memprof.analyse.reconciler.per_rank.RankTable`) and the rank classes
of merged simulated ranks, as text (:mod:`.html` renders the same as HTML). Data in, strings out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..units import format_bytes, one_line
from .common import signed

if TYPE_CHECKING:
    from ..analyse.merge import RankClassLike
    from ..analyse.reconciler.per_rank import RankTable

__all__ = ["rank_table_lines", "class_lines", "ranks_text"]

_NOT = "not modelled"


def _b(v: "int | None", missing: str = _NOT) -> str:
    return missing if v is None else format_bytes(v)


def rank_table_lines(table: "RankTable | None") -> list[str]:
    """The table under a reconciliation: per category the per-rank formula, its bytes, the run's (measured, or
    simulated for a rank of an estimate) and the gap with its named parts."""
    if table is None:
        return []
    actual = "simulated" if table.simulated else "measured"
    mesh = " × ".join(f"{n} {s}" for n, s in table.degrees)
    lines = ["", f"Per rank: rank {table.rank} of {table.world_size}, mesh {mesh}",
             f"  {'category':<18}{'formula':>12}{actual:>12}{'gap':>12}  per-rank formula"]
    for r in table.rows:
        lines.append(one_line(f"  {r.category.value:<18}{_b(r.value):>12}{_b(r.actual, 'not measured'):>12}"
                              f"{signed(r.gap) if r.gap is not None else '':>12}  {r.formula}"))
        for name, nbytes, sentence in r.parts:
            lines.append(one_line(f"  {'':<18}{'':>12}{'':>12}{signed(nbytes):>12}  {name}: {sentence}"))
        rest = r.unexplained
        if r.parts and rest:
            lines.append(f"  {'':<18}{'':>12}{'':>12}{signed(rest):>12}  unexplained")
        elif not r.parts and r.gap:
            lines.append(f"  {'':<18}{'':>12}{'':>12}{'':>12}  (gap not named: unexplained)")
    lines.extend(one_line(f"  - {n}") for n in table.notes)
    return lines


def class_lines(classes: "tuple[RankClassLike, ...]", worst: int) -> list[str]:
    """Rank classes of simulated ranks (ranks that hold the same memory): their members, the rank simulated,
    pipeline stages, peak and where."""
    if not classes:
        return []
    out = [f"  {'class':>5}  {'ranks':<24}{'simulated':>10}  {'stages':<8}{'peak':>12}  where"]
    for i, c in enumerate(classes):
        mark = " *" if c.representative == worst else ""
        stages = ",".join(map(str, c.stages)) or "-"
        out.append(one_line(f"  {i:>5}  {ranks_text(c.ranks):<24}{c.representative:>10}  {stages:<8}"
                            f"{format_bytes(c.peak_bytes):>12}  step {c.peak_step} {c.peak_phase}{mark}"))
    return out


def ranks_text(ranks: "tuple[int, ...]") -> str:
    """Ranks as stretches: 0-3, 8-11."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans[:6])
    return text + (f" (+{len(spans) - 6} more)" if len(spans) > 6 else "")
