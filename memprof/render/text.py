"""Text for terminals: the report, a reconciliation, a diff, an estimate, a batch-size plan.

Every renderer returns a string and prints nothing. A figure that was not
measured reads "not measured"; a formula that does not exist "no formula".
Text from a trace (module paths, notes, error messages, versions) may come
from a file or from a model's own names: every line a renderer builds is
passed through :func:`~memprof.units.one_line`, so control characters,
bidirectional overrides and newlines inside such text show as escapes and
cannot move the cursor, reorder what is read or forge a line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..vocabulary import Category, TENSOR_CATEGORIES
from ..record.trace import Breakdown, as_trace, parent_path
from ..units import format_bytes, one_line
from ..analyse.reconciler.mixed_layers import TEXTBOOK_FORM
from .ranks import class_lines, rank_table_lines
from .common import (NO_FORMULA, NOT_MEASURED, NO_ESTIMATE, clip_path, largest, module_columns, quiet, signed,
                     size)

if TYPE_CHECKING:
    from ..record.parts import RankInfo
    from ..analyse.compare import Diff
    from ..analyse.generation import GenerationSummary
    from ..analyse.merge import Merged
    from ..record.plans import BatchSizePlan
    from ..analyse.reconciler import Reconciliation, Textbook
    from ..analyse.reconciler.mixed_layers import MixedLayerGap
    from ..record.device_memory import DeviceMemory
    from ..record.estimate import Estimate
    from ..record.trace import Trace

__all__ = ["report_text", "oom_lines", "breakdown_lines", "reconciliation_text", "diff_text", "estimate_text",
           "plan_text", "merged_text"]


#: Bounds that keep ``print(report)`` short for any run: phase rows, per-phase statistics rows, notes.
MAX_PHASE_ROWS = 12
MAX_STAT_ROWS = 6
MAX_NOTES = 6


def _text(lines: "list[str]") -> str:
    """The renderer's lines as its output: each one line, whatever the text from the trace in it holds."""
    return "\n".join(one_line(line) for line in lines)


def _clipped(text: str, width: int) -> str:
    """Text from a trace in a table's column: escaped first, so that the clipping counts what is shown."""
    return clip_path(one_line(text), width)


def rank_line(d: "RankInfo") -> str:
    """Which rank of which job, and for FSDP what it shards: one line under a report's header."""
    how = ", ".join(x for x in (d.backend, d.layout) if x)
    line = f"rank {d.rank} of {d.world_size}" + (f" ({how})" if how else "")
    if d.sharded_bytes is not None:
        line += (f": parameters {size(d.sharded_bytes)} as shards (padding {size(d.padding_bytes)}), "
                 f"{size(d.unsharded_bytes)} when all gathered")
    lay = getattr(d, "layout_detail", None)
    if lay is not None:
        line += "; mesh " + " × ".join(f"{n} {s}" for n, s in lay.mesh) + (
            f", gathered in {lay.param_dtype}" if lay.param_dtype else "")
    return line


def report_text(trace: "Trace", *, top_modules: int = 8, levers: "Sequence[str]" = (),
                generation: "GenerationSummary | None" = None) -> str:
    """The readable report that ``print(report)`` shows, at most about 80 lines for any run: the peak,
    the phases of the first steps, the peak's step and the last one, every step summarised per phase,
    the top modules and the notes (``report.phases()``, ``report.phase_stats()`` and
    ``report.modules()`` hold the rest). ``levers``: an out-of-memory run's largest levers, listed under what
    was live; ``generation``: a generation's summary, its section (the facade computes both,
    :func:`memprof.report.reports.levers`, :func:`memprof.analyse.generation.generation_summary`)."""
    t = as_trace(trace)
    lines: list[str] = []
    dev = t.device.name if t.device.type == "cuda" else t.device.type
    if t.oom is not None:  # an OOM dump: what was live then comes first
        lines.extend(oom_lines(t, levers))
        lines.append("")
    lines.append(f"memprof report: {t.num_steps} step(s), mode {t.mode}, device {dev}, torch {t.torch_version}")
    if t.schedule is not None:
        spans = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in t.recorded_steps[:6])
        more = f" and {len(t.recorded_steps) - 6} more windows" if len(t.recorded_steps) > 6 else ""
        lines.append(f"recorded steps {spans or 'none'}{more} ({t.schedule})")
    if t.distributed is not None:
        lines.append(rank_line(t.distributed))
    if t.error:
        lines.append(f"profiled code raised {_prose(t.error)}")
    where = t.peak_location()
    lines.append("")
    lines.append(f"Peak {size(t.peak.total)}" + (f" ({', '.join(where)})" if where else ""))
    lines.extend(breakdown_lines(t.peak))
    if t.live_at_error is not None and t.oom is None:
        lines.append("")
        lines.extend(_live_lines(t, "Live when the error was raised", top=3))
    if generation is not None:
        lines.append("")
        lines.extend(generation_lines(generation))
    shown = 0
    if t.steps:
        lines.append("")
        phase_lines, shown = _phase_lines(t)
        lines.extend(phase_lines)
    if t.phase_stats and t.num_steps > shown:
        lines.append("")
        lines.extend(_stat_lines(t))
    if top_modules > 0:
        lines.extend(_module_lines(t, top_modules))
    if t.notes:
        lines.append("")
        lines.append("Notes")
        for note in t.notes[:MAX_NOTES]:
            lines.append(f"  - {_prose(note)}")
        if len(t.notes) > MAX_NOTES:
            lines.append(f"  ... {len(t.notes) - MAX_NOTES} more in report.trace.notes")
    return _text(lines)


def _module_lines(t: "Trace", top: int) -> list[str]:
    """The ``top`` leaf modules (a container repeats its children's figures) by saved activations, or, in a
    run that kept nothing for a backward (inference), by the peak of their forward calls, without the
    saved-bytes and backward columns that such a run cannot fill."""
    cols = module_columns(t)
    if cols.saved:
        mods = [m for m in t.modules if m.path != "<model>" and (m.activations or m.parameters)]
        mods.sort(key=lambda m: (-(m.activations or 0), -(m.parameters or 0)))
    else:
        mods = [m for m in t.modules if m.path != "<model>" and (m.peak_forward or m.parameters)]
        mods.sort(key=lambda m: (-(m.peak_forward or 0), -(m.parameters or 0)))
    parents = {parent_path(m.path) for m in t.modules}
    leaves = [m for m in mods if m.path not in parents]
    if not leaves:
        return []
    # 14 wide: "not measured" (12) keeps two blanks before it.
    head = f"  {'module':<30}{'type':<20}{'params':>11}" + (f"{'saved act':>14}" if cols.saved else "") \
        + f"{'peak fwd':>14}" + (f"{'peak bwd':>14}" if cols.backward else "")
    lines = ["", cols.title, head]
    for m in leaves[:top]:
        lines.append(f"  {_clipped(m.path, 29):<30}{_clipped(m.type, 19):<20}{size(m.parameters):>11}"
                     + (f"{size(m.activations):>14}" if cols.saved else "") + f"{size(m.peak_forward):>14}"
                     + (f"{size(m.peak_backward):>14}" if cols.backward else ""))
    return lines


def generation_lines(g: "GenerationSummary") -> list[str]:
    """A generation in a few lines (its :func:`memprof.analyse.generation.generation_summary`, which the HTML
    page shows too): the prompt, the decode calls, the cache at the end and how it and the temporaries grew per
    token."""
    return [generation_head(g)] + [f"  {name}: {value}" for name, value in generation_rows(g)]


def generation_head(g: "GenerationSummary") -> str:
    """The section's first line: batch, prompt (and encoder input), decode calls, tokens at the end."""
    head = f"Generation: batch {g.batch if g.batch is not None else '?'}"
    if g.encoder_tokens is not None:
        head += f", encoder {g.encoder_tokens} tokens"
    if g.prompt_tokens is not None:
        head += f", {'decoder prompt' if g.encoder_tokens is not None else 'prompt'} {g.prompt_tokens} tokens"
    return head + (f", {g.decode_phases} decode phase(s), "
                   f"{g.tokens_at_end if g.tokens_at_end is not None else '?'} tokens in the cache at the end")


def generation_rows(g: "GenerationSummary") -> list[tuple[str, str]]:
    """The section's figures as (name, value) lines, the same in the text report and the HTML page."""
    rows = []
    if g.cache_at_end is not None:
        rows.append(("kv_cache at the end of the last call", size(g.cache_at_end)))
    if g.growth_per_token is not None:
        rows.append(("kv_cache per token", f"+{size(g.growth_per_token)}"))
    if g.temporaries is not None:
        first, last = g.temporaries
        rows.append(("temporaries at the decode peaks", f"{size(first)} (first) to {size(last)} (last)"))
    return rows


def oom_lines(t: "Trace", levers: "Sequence[str]" = ()) -> list[str]:
    """What was live at the out-of-memory error, by category and module, and the largest ``levers``."""
    oom = t.oom
    assert oom is not None
    lines = [f"OUT OF MEMORY: {_prose(oom.message)[:200]}"]
    facts = []
    if oom.requested is not None:
        facts.append(f"requested {format_bytes(oom.requested)}")
    if oom.device_free is not None:
        facts.append(f"device free {format_bytes(oom.device_free)}")
    if oom.device_total is not None:
        facts.append(f"of {format_bytes(oom.device_total)}")
    if facts:
        lines.append("  " + ", ".join(facts))
    if oom.snapshot:
        lines.append(f"  memory_viz snapshot: {one_line(oom.snapshot)}")
    lines.extend(_live_lines(t, "What was live at the OOM", top=5))
    if levers:
        lines.append("Largest levers:")
        lines.extend(f"  - {_prose(s)}" for s in levers[:4])
    return lines


def _live_lines(t: "Trace", title: str, *, top: int) -> list[str]:
    """What was live when the run ended in an error, by category and by the ``top`` creating modules."""
    live = t.live_at_error
    if live is None:
        lines = [f"{title}: {NOT_MEASURED} (see the notes)"]
    else:
        lines = [f"{title}: {size(live.total)}"] + breakdown_lines(live)
    if t.live_modules_at_error:
        lines.append("  created by module (activations + temporaries still live):")
        for path, n in t.live_modules_at_error[:top]:
            lines.append(f"    {_clipped(path, 37):<38}{format_bytes(n):>12}")
    return lines


#: Most characters of a note or an error message the report prints (a tensor printed into an exception
#: can make megabytes); the rest is counted, and is in the trace.
MAX_PROSE = 1000


def _prose(text: str) -> str:
    """Prose from a trace (a note, an error message) on one line of the report: its lines joined by
    blanks (a traceback's lines read on), where a name's newline is shown as an escape; at most
    :data:`MAX_PROSE` characters of it."""
    if len(text) > MAX_PROSE:
        text = f"{text[:MAX_PROSE]}… ({len(text) - MAX_PROSE:,} more characters)"
    return " ".join(text.splitlines())


def _phase_lines(t: "Trace") -> tuple[list[str], int]:
    """The phase table of the steps kept in full, bounded (the first steps, the peak's and the last),
    and how many steps it shows."""
    steps = list(t.steps)
    if sum(len(s.phases) for s in steps) > MAX_PHASE_ROWS:
        wanted = {steps[0].index, steps[-1].index, t.peak_step}
        wanted |= {s.index for s in steps[:2]}
        steps = [s for s in steps if s.index in wanted]
    kept = ", ".join(str(s.index) for s in t.steps) if len(t.steps) <= 12 else f"{len(t.steps)} steps"
    rows: list[str] = []
    shown: list[int] = []  # the steps whose rows fit
    truncated = False
    for s in steps:
        for rec in s.phases:
            if len(rows) == MAX_PHASE_ROWS:
                truncated = True
                break
            if not shown or shown[-1] != s.index:
                shown.append(s.index)
            label = rec.phase.value + (f" #{rec.occurrence}" if rec.occurrence else "")
            rows.append(
                f"  {rec.step:>4}  {label:<12}{size(rec.start.total):>14}"
                f"{size(rec.peak.total):>14}{size(rec.end.total):>14}   {largest(rec.peak)}"
            )
        if truncated:
            break
    title = "Phases (bytes at the peak of each phase)"
    if t.num_steps > len(shown):
        title = f"Phases of steps {', '.join(map(str, shown))} of {t.num_steps} (bytes at each phase's peak)"
    if truncated:
        rows.append(f"  ... more phases in report.phases() (steps kept in full: {kept})")
    header = f"  {'step':>4}  {'phase':<12}{'start':>14}{'peak':>14}{'end':>14}   largest at peak"
    return [title, header] + rows, len(shown)


def _stat_lines(t: "Trace") -> list[str]:
    """Every step, per phase: how many, and the total at the phase's peak (min, median, max)."""
    recorded = sum(b - a + 1 for a, b in t.recorded_steps) if t.schedule is not None else t.num_steps
    lines = [f"All {recorded} {'recorded ' if t.schedule is not None else ''}steps per phase (total at each "
             "phase's peak)",
             f"  {'phase':<16}{'count':>8}{'min':>14}{'median':>14}{'max':>14}"]
    for ps in t.phase_stats[:MAX_STAT_ROWS]:
        label = ps.phase.value + (f" #{ps.occurrence}" if ps.occurrence else "")
        st = ps.at("peak", "total")
        lo, mid, hi = (size(v) for v in (st if st is not None else (None, None, None)))
        lines.append(f"  {label:<16}{ps.count:>8}{lo:>14}{mid:>14}{hi:>14}")
    if len(t.phase_stats) > MAX_STAT_ROWS:
        lines.append(f"  ... {len(t.phase_stats) - MAX_STAT_ROWS} more in report.phase_stats()")
    return lines


def breakdown_lines(bd: Breakdown) -> list[str]:
    """One line per category (bytes and share of the total), then the total."""
    lines = []
    for cat in Category:
        v = bd[cat]
        if v is None and cat not in TENSOR_CATEGORIES:
            # Device-only rows on a device that has none: say so once, below.
            continue
        if quiet(cat, v):
            continue
        share = f"{100 * v / bd.total:5.1f}%" if (v is not None and bd.total) else "      "
        lines.append(f"  {cat.value:<20}{size(v):>14}  {share}")
    if all(bd[c] is None for c in (Category.ALLOCATOR_OVERHEAD, Category.OUTSIDE_TORCH)):
        lines.append(f"  {'allocator_overhead':<20}{NOT_MEASURED:>14}  (no accelerator allocator)")
        lines.append(f"  {'outside_torch':<20}{NOT_MEASURED:>14}  (no accelerator driver)")
    lines.append(f"  {'total':<20}{size(bd.total):>14}")
    return lines


def layer_lines(rec: "Reconciliation") -> list[str]:
    """The MoE and Mamba layers, each against its own formula, with the causes of its gap."""
    checks = getattr(rec, "layers", ())
    if not checks:
        return []
    lines = ["", "MoE and Mamba layers (saved for backward, formula vs measured)"]
    for c in checks:
        lines.append(f"  {c.path:<40}{c.kind:<13}{format_bytes(c.formula.bytes):>11}{size(c.measured):>12}"
                     f"{signed(c.gap):>12}")
        for name, amount, sentence in c.causes:
            sign = "+" if amount >= 0 else "-"
            lines.append(f"    {sign}{format_bytes(abs(amount))} {name}: {sentence}")
        if c.unexplained:
            lines.append(f"    {signed(c.unexplained)} unexplained")
    return lines


def mixed_layer_lines(g: "MixedLayerGap | None") -> list[str]:
    """One layer under torch.autocast: its saved bytes beside the textbook's per-layer figure, and each named
    cause of the difference."""
    if g is None:
        return []
    shape = ", ".join(f"{k}={v}" for k, v in g.shape)
    lines = ["", f"Activations of one layer ({g.path}; {shape})",
             f"  {'textbook ' + TEXTBOOK_FORM:<62}{format_bytes(g.textbook):>12}",
             f"  {'this layer':<62}{size(g.measured):>12}"]
    for name, amount, _ in g.causes:
        lines.append(f"    {name:<60}{signed(amount):>12}")
    if g.unexplained:
        lines.append(f"    {'unexplained':<60}{signed(g.unexplained):>12}")
    return lines


def reconciliation_text(rec: "Reconciliation") -> str:
    lines = [f"memprof reconciliation at the {rec.where} ({rec.precision}"
             + (f", {rec.optimizer}" if rec.optimizer else "") + ")"]
    # The estimate column only when an estimate was given.
    estimated = any(r.estimate is not None for r in rec.rows)

    def est(v: "int | None") -> str:
        return f"{size(v, NO_ESTIMATE):>14}" if estimated else ""

    lines.append(f"  {'category':<20}{'formula':>14}" + (f"{'estimate':>14}" if estimated else "")
                 + f"{'measured':>14}{'gap':>13}{'gap %':>9}")
    for r in rec.rows:
        if r.formula is None and r.measured is None and r.estimate is None or \
                quiet(r.category, r.formula, r.measured, r.estimate):
            continue
        pct = f"{r.gap_pct:+8.1f}%" if r.gap_pct is not None else f"{'':>9}"
        lines.append(f"  {r.category.value:<20}{size(r.formula, NO_FORMULA):>14}{est(r.estimate)}"
                     f"{size(r.measured):>14}{signed(r.gap):>13}{pct}")
    t = rec.total
    pct = f"{t.gap_pct:+8.1f}%" if t.gap_pct is not None else ""
    lines.append(f"  {'total':<20}{size(t.formula, NO_FORMULA):>14}{est(t.estimate)}"
                 f"{size(t.measured):>14}{signed(t.gap):>13}{pct}")
    lines.extend(textbook_lines(rec.textbook))
    expl = rec.explanations
    if expl:
        lines.append("")
        lines.append("Why the measurement differs")
        # Causes under 0.5 % of the measured total are folded into one line: rec.causes lists them all.
        floor = (t.measured or 0) // 200
        small = [c for c in expl if abs(c.bytes) < floor and c.name != "unexplained"]
        for c in expl:
            if c in small:
                continue
            sign = "+" if c.bytes >= 0 else "-"
            lines.append(f"  {c.category.value:<17}{sign}{format_bytes(abs(c.bytes)):>11}  {c.name}: {c.sentence}")
        if small:
            net = sum(c.bytes for c in small)
            sign = "+" if net >= 0 else "-"
            lines.append(f"  {'(smaller)':<17}{sign}{format_bytes(abs(net)):>11}  {len(small)} cause(s) under 0.5% "
                         "of the total each: " + ", ".join(sorted({c.name for c in small})) + " (rec.causes)")
    lines.extend(layer_lines(rec))
    lines.extend(mixed_layer_lines(getattr(rec, "mixed_layer", None)))
    lines.extend(rank_table_lines(getattr(rec, "per_rank", None)))
    if rec.notes:
        lines.append("")
        for n in rec.notes:
            lines.append(f"  - {n}")
    advice = rec.advice()
    if advice:
        lines.append("")
        lines.append("Advice")
        for a in advice:
            lines.append(f"  - {a}")
    return _text([line.rstrip() for line in lines])


def textbook_lines(tb: "Textbook") -> list[str]:
    """The literature's model states under a formula column: one line where the run's regime is the
    textbook's; else both figures in exact bytes and each cause of their difference (formula − textbook)."""
    if not tb.differs:
        return [] if tb.bytes_per_param is None else [f"  (textbook model states: {tb.bytes_per_param:g} bytes/param)"]
    lines = []
    for label, bpp, regime, words, states in (
            ("textbook", tb.per_param, tb.regime, tb.regime_words, tb.model_states),
            ("formula", tb.formula_per_param, tb.formula_regime, tb.formula_regime_words, tb.formula_model_states)):
        per = ("" if bpp is None else f": {bpp.total:g} bytes/param = {bpp.weights:g} weights + {bpp.gradients:g} "
               f"gradients + {bpp.optimizer_states:g} optimizer states")
        lines.append(f"  {label} model states{per} ({regime}: {words})"
                     + (f", {states:,} B" if states is not None else ""))
    for c in tb.causes:
        lines.append(f"    {c.category.value:<17}{c.bytes:+,} B ({format_bytes(abs(c.bytes))})  {c.name}: {c.sentence}")
    return lines


def diff_text(diff: "Diff", *, max_phases: int = 20) -> str:
    la, lb = (one_line(label) for label in diff.labels)  # escaped first: the widths count what is shown
    wa = max(14, len(la) + 2)
    wb = max(14, len(lb) + 2)
    lines = [f"memprof diff: {la} -> {lb} (breakdown at the {diff.at})"]
    lines.append(f"  {'category':<20}{la:>{wa}}{lb:>{wb}}{'delta':>14}{'%':>9}")
    for c in (*diff.categories, diff.total):
        if c.category is None:
            lines.append("  " + "-" * (20 + wa + wb + 14 + 9))
        if c.a is None and c.b is None:
            lines.append(f"  {c.name:<20}{NOT_MEASURED:>{wa}}{NOT_MEASURED:>{wb}}")
            continue
        lines.append(
            f"  {c.name:<20}{size(c.a):>{wa}}{size(c.b):>{wb}}{signed(c.delta):>14}"
            f"{_pct(c.delta_pct, c.delta):>9}  {_word(c.delta)}".rstrip()
        )
    if diff.phases:
        lines.append("")
        lines.append("Phases (peak total of each phase, matched by step, phase and occurrence)")
        lines.append(f"  {'step':>4}  {'phase':<12}{la:>{wa}}{lb:>{wb}}{'delta':>14}{'%':>9}")
        shown = diff.phases if len(diff.phases) <= max_phases else diff.phases[:max_phases]
        for p in shown:
            label = p.phase.value + (f" #{p.occurrence}" if p.occurrence else "")
            lines.append(
                f"  {p.step:>4}  {label:<12}{size(p.a):>{wa}}{size(p.b):>{wb}}{signed(p.delta):>14}"
                f"{_pct(p.delta_pct, p.delta):>9}  {_word(p.delta)}".rstrip()
            )
        if len(diff.phases) > len(shown):
            lines.append(f"  … {len(diff.phases) - len(shown)} more (diff.phases_frame() has all)")
    for label, keys in ((la, diff.only_in_a), (lb, diff.only_in_b)):
        if keys:
            names = ", ".join(f"step {s} {ph.value}" + (f" #{o}" if o else "") for s, ph, o in keys[:12])
            more = f" and {len(keys) - 12} more" if len(keys) > 12 else ""
            lines.append(f"Only in {label}: {names}{more}")
    if diff.notes:
        lines.append("")
        lines.append("Notes")
        lines.extend(f"  - {n}" for n in diff.notes)
    return _text(lines)


def _word(delta: "int | None") -> str:
    if delta is None:
        return ""
    return "grew" if delta > 0 else "shrank" if delta < 0 else "same"


def _pct(p: "float | None", delta: "int | None") -> str:
    if p is None:
        return "new" if delta else ""
    return "0.0%" if p == 0 else f"{p:+.1f}%"


def estimate_text(est: "Estimate", formula: Breakdown, textbook: "Textbook",
                  mixed_layer: "MixedLayerGap | None" = None) -> str:
    """An estimate's peak beside the formula breakdown at it (``formula``), the literature's figure
    (``textbook``) and a layer under autocast against the textbook's (``mixed_layer``): what
    :class:`memprof.Estimate` prints."""
    lines = [f"memprof estimate ({est.precision}, simulated for {est.device}): peak {size(est.peak_bytes)}",
             f"  {'category':<20}{'formula':>14}{'estimate':>14}"]
    estimated = est.peak
    ranks = est.trace.distributed
    if ranks is not None:
        lines.insert(1, f"  {rank_line(ranks)}")
    on_device = getattr(est, "device_memory", None)
    if on_device is not None:  # a CUDA target: the device-level peak and, given a GPU, the fit
        lines.insert(1, f"  {device_verdict(on_device)}")
    for cat in Category:
        f, s = formula[cat], estimated[cat]
        # A rank's collective buffers are shown also when the layout's are not estimated ("no estimate").
        shown = ranks is not None and cat is Category.COMMUNICATION
        if not shown and (f is None and s is None or quiet(cat, f, s)):
            continue
        lines.append(f"  {cat.value:<20}{size(f, NO_FORMULA):>14}{size(s, NO_ESTIMATE):>14}")
    lines.append(f"  {'total':<20}{size(formula.total, NO_FORMULA):>14}{size(estimated.total, NO_ESTIMATE):>14}")
    lines.extend(textbook_lines(textbook))
    lines.extend(mixed_layer_lines(mixed_layer))
    for note in est.notes:
        lines.append(f"  - {note}")
    return _text(lines)


def plan_text(plan: "BatchSizePlan") -> str:
    """A batch-size plan: the answer and the limit it was judged against (with a GPU its name, and a memory
    fraction's cap and the memory outside torch that make the limit), the judged peak near the answer as a line, the
    batches simulated (those that did not fit marked), and the notes."""
    limit = plan.limit if plan.limit is not None else plan.budget
    if plan.device_level:
        what = f" of {plan.gpu}" if plan.gpu else ""
        why = "the device-level peak"
        if plan.allocator_limit is not None:
            why += (f"; per_process_memory_fraction {plan.fraction} caps the allocator at "
                    f"{format_bytes(plan.allocator_limit)}, and {format_bytes(plan.outside_bytes or 0)} lie outside "
                    "torch")
    else:
        what, why = "", "the tensors' peak; no GPU given"
    lines = [f"largest batch size within {format_bytes(limit)}{what} ({why}): {plan.batch_size} "
             f"(multiple of {plan.multiple_of})"]
    if plan.per_sample_bytes:
        lines.append(f"  near the answer: peak(b) = {format_bytes(plan.fixed_bytes)} + "
                     f"{format_bytes(int(round(plan.per_sample_bytes)))} x b")
    oom = set(plan.out_of_memory)

    def point(b: int, peak: int) -> str:
        mark = " (out of memory)" if b in oom else " (over)" if peak > limit else ""
        return f"b={b}: {format_bytes(peak)}{mark}"

    lines.append("  simulated: " + ", ".join(point(b, p) for b, p in plan.points))
    if not plan.verified:
        lines.append("  not confirmed by simulation at the answer (see points)")
    lines.extend(f"  - {note}" for note in plan.notes)
    return _text(lines)


def merged_text(merged: "Merged") -> str:
    """The ranks of one run in a table: each rank's peak (where), the largest categories there, the spread.
    ``merged.ranks`` may hold Traces or Reports."""
    measured = all(r.peak.total is not None for r in merged.ranks.values())
    worst = f"worst rank {merged.worst}" if measured else "peaks not measured on every rank"
    kind = "simulated " if getattr(merged, "simulated", False) else ""
    lines = [f"memprof merge: {len(merged.ranks)} of {merged.world_size} {kind}rank(s); {worst}"]
    spread = merged.spread
    if spread is not None:
        lines.append(f"  spread of the peaks: {size(spread[0])} (max - min), max/mean {spread[1]:.3f}")
    lines.append(f"  {'rank':>4}  {'peak':>12}  {'where':<22}{'largest at the peak'}")
    for rank, held in merged.ranks.items():
        t = as_trace(held)
        where = f"step {t.peak_step} {t.peak_phase.value}" if t.peak_phase is not None else ""
        top = largest(t.peak)
        mark = " *" if measured and rank == merged.worst else ""
        lines.append(f"  {rank:>4}  {size(t.peak.total):>12}  {where:<22}{top}{mark}")
    classes = getattr(merged, "classes", ())
    if classes:
        lines.append("  rank classes (ranks that hold the same memory; * the worst):")
        lines.extend("  " + line for line in class_lines(classes, merged.worst))
    for note in merged.notes:
        lines.append(f"  - {note}")
    return _text(lines)


def device_verdict(dm: DeviceMemory) -> str:
    """One line of a :class:`~memprof.record.device_memory.DeviceMemory`: the device-level peak, and against
    the GPU's capacity whether it fits."""
    head = (f"device peak {format_bytes(dm.device_peak)} = reserved {format_bytes(dm.peak_reserved)} "
            f"+ outside torch {format_bytes(dm.outside_bytes)}")
    if dm.capacity is None:
        return head + " (no GPU given: no fit verdict; pass gpu=)"
    name = dm.gpu.name if dm.gpu is not None else "the device"
    if dm.fits:
        return f"{head}: fits {name} ({format_bytes(dm.capacity)}), headroom {format_bytes(dm.headroom)}"
    why = f"; {dm.oom}" if dm.oom else ""
    # A negative headroom: short by bytes; else it fits in bytes, not in segments.
    short = format_bytes(-dm.headroom) if dm.headroom is not None and dm.headroom < 0 else "a block"
    return f"{head}: does NOT fit {name} ({format_bytes(dm.capacity)}), short by {short}{why}"


def device_measured_lines(dm: DeviceMemory) -> list[str]:
    """A measured CUDA run's replay: the model's reserved bytes beside the allocator's measured ones, and the
    split of NVML's outside-torch figure (nothing for a CPU run)."""
    out = []
    if dm.measured_reserved is not None:
        gap = dm.measured_reserved - dm.peak_reserved
        out.append(f"reserved: model {dm.peak_reserved} B (peak), measured {dm.measured_reserved} B (at the "
                   f"end), measured - model {gap:+d} B")
    split = dm.outside_split()
    if split is not None:
        out.append(f"outside torch measured {dm.measured_outside} B = "
                   + " + ".join(f"{name} {n} B" for name, n in split))
    return out


def device_memory_text(dm: DeviceMemory) -> str:
    """What a :class:`~memprof.record.device_memory.DeviceMemory` prints: the verdict, the measured comparison and
    every term with its source."""
    return "\n".join([device_verdict(dm)] + device_measured_lines(dm) + [f"  - {n}" for n in dm.notes()])
