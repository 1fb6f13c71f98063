"""Reconciliation: formula vs simulated vs measured, every gap split into named causes.

For each category the table holds what the literature predicts (the
*formula*, from :mod:`memprof.anatomy` applied to the run's model and
optimizer), what a meta-tensor run of the same step shows (*simulated*, when
an :class:`~memprof.estimate.Estimate` is given) and what was *measured*.
The gap (measured − formula) is split into causes, each with its bytes and
one sentence; whatever no cause accounts for is shown as "unexplained".
Nothing here reads hooks: a reconciliation is a pure function of a Trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from .anatomy.activations import transformer_layer_activations
from .anatomy.allocator import CUDA_CONTEXT_RANGE
from .anatomy.params import bytes_per_param_breakdown
from .categories import TENSOR_CATEGORIES, Category, Phase
from .errors import InvalidArgumentError, NotMeasuredError, UnknownNameError
from .trace import Breakdown, PhaseRecord, Trace
from .units import format_bytes, printable

if TYPE_CHECKING:
    import pandas as pd

    from .simulation import Estimate

__all__ = ["Cause", "Reconciliation", "reconcile", "formula_at", "formula_breakdown", "infer_precision"]

_MOMENTS = ("peak", "steady")


@dataclass(frozen=True)
class Cause:
    """One named reason for part of a gap: bytes (signed, as they add to measured − formula) and a sentence."""

    category: Category
    name: str
    bytes: int
    sentence: str

    def __str__(self) -> str:
        sign = "+" if self.bytes >= 0 else "-"
        return f"{self.category.value}: {self.name} {sign}{format_bytes(abs(self.bytes))}: {self.sentence}"


@dataclass(frozen=True)
class Row:
    category: Category
    formula: "int | None"
    simulated: "int | None"
    measured: "int | None"

    @property
    def gap(self) -> "int | None":
        if self.formula is None or self.measured is None:
            return None
        return self.measured - self.formula

    @property
    def gap_pct(self) -> "float | None":
        gap = self.gap
        if gap is None or not self.formula:
            return None
        return 100.0 * gap / self.formula


def infer_precision(trace: Trace) -> str:
    """The precision regime a run used: ``fp32``, ``amp`` (fp32 parameters under 16-bit autocast), ``bf16``, ``fp16``."""
    dtypes = set(trace.param_dtypes)
    if dtypes <= {"float32"} and trace.autocast_dtype in ("bfloat16", "float16"):
        return "amp"
    if dtypes == {"bfloat16"}:
        return "bf16"
    if dtypes == {"float16"}:
        return "fp16"
    return "fp32"


def _optimizer_name(trace: Trace) -> "str | None":
    if trace.optimizer is None:
        return None
    cls = trace.optimizer.rsplit(".", 1)[-1].lower()
    names = {"adamw": "adamw", "adam": "adam", "sgd": "sgd", "adagrad": "adagrad", "rmsprop": "rmsprop",
             "adafactor": "adafactor", "lion": "lion", "adamw8bit": "adamw_8bit", "pagedadamw8bit": "adamw_8bit"}
    return names.get(cls)


def formula_breakdown(trace: Trace, *, precision: "str | None" = None, optimizer: "str | None" = None,
                      moment: "PhaseRecord | None" = None, transformer: "Mapping[str, Any] | None" = None,
                      at_peak: bool = True) -> Breakdown:
    """The textbook breakdown for the run's model and optimizer.

    Weights and gradients are bytes/param (HF, ZeRO; see
    :func:`memprof.anatomy.bytes_per_param`) times the parameter counts.
    Optimizer state is predicted from the optimizer object when the run had
    one memprof has a formula for (exact, ``step`` counters included), else
    from ``optimizer``'s bytes/param. Activations are Korthikanti et al.'s
    per-layer form when ``transformer`` gives the configuration
    (``seq_len, batch, hidden, heads, layers`` and any keyword of
    :func:`~memprof.anatomy.transformer_layer_activations`), else the sum of
    the per-module saved-bytes rules over the first forward. Temporaries have
    a formula only inside the optimizer step (its step temporaries).
    """
    facts = trace.facts
    precision = precision or infer_precision(trace)
    opt_name = optimizer if optimizer is not None else _optimizer_name(trace)
    try:
        bpp = bytes_per_param_breakdown(precision, opt_name if opt_name is not None else None)
    except UnknownNameError:
        bpp = bytes_per_param_breakdown(precision, None)
    values: dict[Category, "int | None"] = {c: None for c in Category}
    values[Category.WEIGHTS] = int(round(bpp.weights * facts.num_params))
    values[Category.BUFFERS] = facts.buffer_bytes
    if trace.steps and any(p.phase is Phase.BACKWARD for p in trace.phases):
        values[Category.GRADIENTS] = int(round(bpp.gradients * facts.num_trainable))
    elif trace.steps:
        values[Category.GRADIENTS] = 0  # evaluation only: no backward, no gradients
    if facts.optimizer_state_formula is not None and optimizer is None:
        values[Category.OPTIMIZER_STATES] = facts.optimizer_state_formula
    elif opt_name is not None:
        values[Category.OPTIMIZER_STATES] = int(round(bpp.optimizer_states * facts.num_trainable))
    elif trace.optimizer is None:
        values[Category.OPTIMIZER_STATES] = 0
    if transformer is not None:
        cfg = dict(transformer)
        try:
            layers = int(cfg.pop("layers"))
            per_layer = transformer_layer_activations(
                cfg.pop("seq_len"), cfg.pop("batch"), cfg.pop("hidden"), cfg.pop("heads"), **cfg)
        except (KeyError, TypeError) as exc:
            raise InvalidArgumentError(
                f"transformer= needs seq_len, batch, hidden, heads and layers (and keywords of "
                f"transformer_layer_activations); {exc}") from None
        values[Category.ACTIVATIONS] = layers * per_layer
    else:
        values[Category.ACTIVATIONS] = facts.activation_formula
    if moment is not None and moment.phase in (Phase.OPTIMIZER, Phase.OTHER):
        values[Category.ACTIVATIONS] = 0  # no graph is alive outside forward and backward
    if (moment is not None and moment.phase is Phase.OPTIMIZER and at_peak
            and facts.optimizer_transient_formula is not None):
        values[Category.TEMPORARIES] = facts.optimizer_transient_formula
    return Breakdown.from_mapping(values)


def formula_at(trace: Trace, at: str = "peak", *, precision: "str | None" = None, optimizer: "str | None" = None,
               transformer: "Mapping[str, Any] | None" = None) -> Breakdown:
    """The textbook breakdown for the moment ``at`` (``"peak"`` or ``"steady"``) of a run: the one
    formula every view of that moment shows (a reconciliation, an estimate's table).

    The moment matters: outside forward and backward no graph is alive, so the formula for
    activations there is 0, and inside the optimizer step temporaries have a formula.
    """
    if at not in _MOMENTS:
        raise InvalidArgumentError(f"at must be 'peak' or 'steady', got {at!r}")
    _measured, rec, _where, _tags = _moment(trace, at)
    return formula_breakdown(trace, precision=precision, optimizer=optimizer, moment=rec,
                             transformer=transformer, at_peak=at == "peak")


@dataclass(frozen=True)
class Reconciliation:
    """Formula vs simulated vs measured, per category, with the causes of every gap.

    ``rows`` hold the figures; ``causes`` the named parts of the gaps;
    :attr:`explanations` adds one "unexplained" entry per category for what the
    causes leave. Print it for a table, ``to_frame()`` for pandas.
    """

    moment: str
    where: str
    precision: str
    optimizer: "str | None"
    rows: tuple[Row, ...]
    causes: tuple[Cause, ...]
    textbook_bytes_per_param: "float | None"
    notes: tuple[str, ...] = ()
    _advice: tuple[str, ...] = field(default=(), repr=False)

    def row(self, category: "Category | str") -> Row:
        cat = Category.parse(category)
        return next(r for r in self.rows if r.category is cat)

    @property
    def explanations(self) -> list[Cause]:
        """Every named cause, then per category the unexplained remainder of its gap (if any).

        Together they add up to the total row's gap: measured total minus formula total.
        """
        out = list(self.causes)
        for r in self.rows:
            gap = r.gap
            if gap is None:
                continue
            explained = sum(c.bytes for c in self.causes if c.category is r.category)
            rest = gap - explained
            if rest:
                out.append(Cause(r.category, "unexplained", rest,
                                 "no named cause accounts for this part of the gap"))
        return out

    def unexplained(self, category: "Category | str") -> "int | None":
        """Bytes of a category's gap that no named cause accounts for (``None`` without a formula)."""
        r = self.row(category)
        if r.gap is None:
            return None
        return r.gap - sum(c.bytes for c in self.causes if c.category is r.category)

    def to_frame(self) -> "pd.DataFrame":
        """DataFrame indexed by category value (plus ``total``): formula, simulated, measured, gap, gap_pct."""
        import pandas as pd

        records = []
        for r in self.rows:
            records.append({"category": r.category.value, "formula": r.formula, "simulated": r.simulated,
                            "measured": r.measured, "gap": r.gap, "gap_pct": r.gap_pct})
        records.append(self._total_row())
        frame = pd.DataFrame(records).set_index("category")
        for col in ("formula", "simulated", "measured", "gap"):
            frame[col] = frame[col].astype("Int64")
        frame["gap_pct"] = frame["gap_pct"].astype("Float64")
        return frame

    def _compared_totals(self) -> tuple[int, int]:
        """The formula total and the measured total (every measured category: the report's total at
        this moment). A category without a formula adds its measured bytes to the gap, under a cause."""
        formula = sum(r.formula for r in self.rows if r.formula is not None)
        measured = sum(r.measured for r in self.rows if r.measured is not None)
        return formula, measured

    def _total_row(self) -> dict[str, Any]:
        simulated = [r.simulated for r in self.rows if r.simulated is not None]
        f = m = None
        if any(r.formula is not None for r in self.rows):
            f, m = self._compared_totals()
        gap = None if f is None or m is None else m - f
        return {"category": "total", "formula": f, "simulated": sum(simulated) if simulated else None,
                "measured": m, "gap": gap, "gap_pct": (100.0 * gap / f) if gap is not None and f else None}

    def advice(self) -> list[str]:
        """Levers that shrink the largest categories, with predicted savings, and alignment warnings."""
        return list(self._advice)

    def plot(self, ax: Any = None) -> Any:
        """A waterfall from the formula total to the measured total through the named causes (matplotlib)."""
        from .plot import plot_waterfall

        formula_total, measured_total = self._compared_totals()
        steps: list[tuple[str, int]] = [("formula", formula_total)]
        for c in self.explanations:
            steps.append((f"{c.category.value}: {c.name}", c.bytes))
        steps.append(("measured", measured_total))
        return plot_waterfall(steps, ax=ax)

    def to_text(self) -> str:
        lines = [f"memprof reconciliation at the {self.where} ({self.precision}"
                 + (f", {self.optimizer}" if self.optimizer else "") + ")"]
        lines.append(f"  {'category':<20}{'formula':>13}{'simulated':>13}{'measured':>13}{'gap':>13}{'gap %':>9}")
        for r in self.rows:
            if r.formula is None and r.measured is None and r.simulated is None:
                continue
            pct = f"{r.gap_pct:+8.1f}%" if r.gap_pct is not None else f"{'':>9}"
            lines.append(f"  {r.category.value:<20}{_fmt(r.formula):>13}{_fmt(r.simulated):>13}"
                         f"{_fmt(r.measured):>13}{_fmt_gap(r.gap):>13}{pct}")
        t = self._total_row()
        pct = f"{t['gap_pct']:+8.1f}%" if t["gap_pct"] is not None else ""
        lines.append(f"  {'total':<20}{_fmt(t['formula']):>13}{_fmt(t['simulated']):>13}{_fmt(t['measured']):>13}"
                     f"{_fmt_gap(t['gap']):>13}{pct}")
        if self.textbook_bytes_per_param is not None:
            lines.append(f"  (textbook model states: {self.textbook_bytes_per_param:g} bytes/param)")
        expl = self.explanations
        if expl:
            lines.append("")
            lines.append("Why the measurement differs")
            # Causes under 0.5 % of the measured total are folded into one line: rec.causes lists them all.
            floor = self._compared_totals()[1] // 200
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
        if self.notes:
            lines.append("")
            for n in self.notes:
                lines.append(f"  - {n}")
        if self._advice:
            lines.append("")
            lines.append("Advice")
            for a in self._advice:
                lines.append(f"  - {a}")
        return printable("\n".join(line.rstrip() for line in lines))

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        from html import escape

        rows = []
        for r in self.rows:
            if r.formula is None and r.measured is None and r.simulated is None:
                continue
            gap = r.gap
            color = "" if not gap else ("color:#b00020" if gap > 0 else "color:#1b7f3b")
            cells = "".join(f"<td style='text-align:right'>{escape(_fmt(v))}</td>"
                            for v in (r.formula, r.simulated, r.measured))
            rows.append(f"<tr><td>{escape(r.category.value)}</td>{cells}"
                        f"<td style='text-align:right;{color}'>{escape(_fmt_gap(gap))}</td></tr>")
        expl = "".join(f"<li>{escape(str(c))}</li>" for c in self.explanations)
        return ("<div><b>memprof reconciliation</b> at the " + escape(self.where)
                + "<table><tr><th>category</th><th>formula</th><th>simulated</th><th>measured</th><th>gap</th></tr>"
                + "".join(rows) + "</table><ul>" + expl + "</ul></div>")


def _fmt(v: "int | None") -> str:
    return "n/a" if v is None else format_bytes(v)


def _fmt_gap(v: "int | None") -> str:
    if v is None:
        return ""
    return ("+" if v > 0 else "") + format_bytes(v)


# ---------------------------------------------------------------------- building


def _moment(trace: Trace, moment: str) -> tuple[Breakdown, "PhaseRecord | None", str, dict[str, int]]:
    if moment == "peak":
        rec = None
        for p in trace.phases:
            if trace.peak_step == p.step and trace.peak_phase is p.phase and (
                    rec is None or (p.peak.total or 0) > (rec.peak.total or 0)):
                rec = p
        where = "peak" + (f" (step {trace.peak_step}, {trace.peak_phase.value})" if trace.peak_phase else "")
        return trace.peak, rec, where, dict(trace.peak_tags)
    # Steady: the end of the last optimizer phase (model states all present), else of the last backward.
    for phase in (Phase.OPTIMIZER, Phase.BACKWARD, Phase.FORWARD):
        recs = [p for p in trace.phases if p.phase is phase]
        if recs:
            rec = recs[-1]
            return rec.end, rec, f"end of {phase.value} (step {rec.step})", dict(rec.tags_end)
    raise NotMeasuredError("no step was recorded; nothing to reconcile")


def reconcile(
    trace: "Trace | Any",
    *,
    precision: "str | None" = None,
    optimizer: "str | None" = None,
    at: str = "peak",
    estimate: "Estimate | None" = None,
    transformer: "Mapping[str, Any] | None" = None,
) -> Reconciliation:
    """Reconcile a measured run (a Trace or Report) with the formulas and, optionally, a simulation.

    ``at="peak"`` compares the composition at the global peak (what decides an
    OOM); ``at="steady"`` the end of the last optimizer step, when every model
    state exists. ``precision`` (``fp32``, ``mixed``, ``amp``, ``bf16``,
    ``fp16``, ``zero``) and ``optimizer`` (a name as in
    :func:`memprof.anatomy.bytes_per_param`) override what is inferred from
    the run: giving ``optimizer`` switches optimizer state to the textbook
    bytes/param instead of the prediction from the optimizer object.
    """
    trace = getattr(trace, "trace", trace)
    if not isinstance(trace, Trace):
        raise InvalidArgumentError(f"reconcile() needs a memprof Trace or Report, got {type(trace).__name__}")
    if at not in _MOMENTS:
        raise InvalidArgumentError(f"at must be 'peak' or 'steady', got {at!r}")
    if not trace.steps:
        raise NotMeasuredError("no step was recorded; nothing to reconcile")
    precision_used = precision or infer_precision(trace)
    measured, rec, where, tags = _moment(trace, at)
    formula = formula_at(trace, at, precision=precision_used, optimizer=optimizer, transformer=transformer)
    simulated: "Breakdown | None" = None
    if estimate is not None:
        simulated, _, _, _ = _moment(estimate.trace, at)
    rows = tuple(Row(c, formula[c], simulated[c] if simulated is not None else None, measured[c]) for c in Category)
    opt_name = optimizer if optimizer is not None else _optimizer_name(trace)
    notes: list[str] = []
    if trace.optimizer is not None and trace.facts.optimizer_state_formula is None and optimizer is None:
        notes.append(f"no formula for {trace.optimizer}: its state is measured, not predicted")
    if trace.facts.modules_without_rule and transformer is None:
        notes.append("no saved-bytes rule for module types " + ", ".join(trace.facts.modules_without_rule)
                     + ": their activations are not in the formula")
    if trace.mode == "light" and trace.device.type != "cuda":
        notes.append("light mode on CPU: temporaries and totals were not measured")
    ctx = _Context(trace, measured, rec, tags, formula, precision_used, opt_name, transformer)
    causes = tuple(c for c in _causes(ctx) if c.bytes)
    textbook = None
    try:
        textbook = bytes_per_param_breakdown(precision_used, opt_name).total
    except UnknownNameError:
        textbook = None
    advice = tuple(_advice(ctx))
    return Reconciliation(at, where, precision_used, opt_name, rows, causes, textbook, tuple(notes), advice)


@dataclass
class _Context:
    trace: Trace
    measured: Breakdown
    rec: "PhaseRecord | None"
    tags: dict[str, int]
    formula: Breakdown
    precision: str
    optimizer: "str | None"
    transformer: "Mapping[str, Any] | None"


# Where the rules of the modules that saved a storage count more or less than the storage:
# (tag, sign of the gap measured - formula, cause, sentence).
_RULE_VIEW_CAUSES = (
    ("saved_by_two_modules", -1, "saved by two modules",
     "one storage saved by two neighbouring modules (ReLU's output is the next Linear's input): the "
     "per-module formula counts it once for each"),
    ("saved_as_expanded_view", -1, "saved expanded views",
     "a module saved an expanded view (x[:, None].expand(...)): its rule counts the expanded size, "
     "autograd keeps only the storage under it"),
    ("saved_as_view_of_larger", 1, "saved views of larger storages",
     "modules saved views of larger tensors (x[:, 0] of a sequence): their rules count the view, memprof "
     "the storage under it, which autograd keeps whole"),
)


def _causes(ctx: _Context) -> list[Cause]:
    out: list[Cause] = []
    m, f, facts, trace = ctx.measured, ctx.formula, ctx.trace.facts, ctx.trace
    phase = ctx.rec.phase if ctx.rec is not None else None
    W, G, O, A, T = (Category.WEIGHTS, Category.GRADIENTS, Category.OPTIMIZER_STATES, Category.ACTIVATIONS,
                     Category.TEMPORARIES)

    # Weights: HF's "mixed precision" keeps a 16-bit copy of every weight; torch.autocast does not.
    if ctx.precision == "mixed" and m[W] is not None and f[W] is not None and m[W] < f[W]:
        out.append(Cause(W, "no persistent 16-bit copy", -min(f[W] - m[W], 2 * facts.num_params),
                         "HF's mixed precision counts a 16-bit copy of each weight (2 B/param); torch.autocast "
                         "casts per use instead, and the casts saved for backward appear among activations"))

    # Gradients not (yet) present at this moment.
    if m[G] is not None and f[G] is not None and m[G] < f[G]:
        if m[G] == 0 and phase in (Phase.FORWARD, Phase.OTHER):
            out.append(Cause(G, "gradients not allocated", -f[G],
                             "zero_grad(set_to_none=True) freed the gradients and backward had not produced them "
                             "yet at this moment"))
        elif phase is Phase.BACKWARD:
            what = "none of the gradients" if m[G] == 0 else "only part of the gradients"
            out.append(Cause(G, "backward in progress", m[G] - f[G],
                             f"backward had produced {what} when the peak occurred (zero_grad(set_to_none=True) "
                             "frees them every step)"))

    # Optimizer state is created lazily by the first step.
    if m[O] is not None and f[O] is not None and m[O] < f[O]:
        first_opt = next((p for p in trace.phases if p.phase is Phase.OPTIMIZER), None)
        before_first = first_opt is None or (ctx.rec is not None and (ctx.rec.step, _order(ctx.rec)) <
                                             (first_opt.step, _order(first_opt)))
        if m[O] == 0 and before_first:
            out.append(Cause(O, "state created lazily", -f[O],
                             "torch optimizers create their state inside the first step(); this moment came before it"))
        elif ctx.rec is not None and ctx.rec.phase is Phase.OPTIMIZER and ctx.rec.step == (first_opt.step if first_opt else -1):
            out.append(Cause(O, "state created lazily", m[O] - f[O],
                             "the first step() was still creating the state at this moment"))

    # Activations. In backward, "released by backward" counts from the end of the forward that
    # backward follows, so what the tags name is read there too: a tensor backward already
    # released is that cause's, not theirs.
    fwd = _forward_before(trace, ctx.rec) if phase is Phase.BACKWARD and ctx.rec is not None else None
    tags = dict(fwd.tags_end) if fwd is not None else ctx.tags
    if m[A] is not None and f[A] is not None and fwd is not None and m[A] < fwd.end[A]:
        out.append(Cause(A, "released by backward", m[A] - fwd.end[A],
                         "backward frees each saved tensor once its node has run; at this moment it had "
                         "released this much of what the forward saved"))
    if m[A] is not None and f[A] is not None:
        def tag(name: str) -> int:
            return tags.get(name, 0)

        wcopy = tag("autocast_weight_copy")
        if wcopy:
            out.append(Cause(A, "autocast weight copies", wcopy,
                             "torch.autocast's 16-bit casts of the weights are saved for backward by the matmuls "
                             "(2 B per parameter used under autocast)"))
        if ctx.transformer is not None:
            # Korthikanti: 1-byte masks, 16-bit activations, norm statistics ignored.
            stats = tag("norm_statistics")
            if stats:
                out.append(Cause(A, "normalisation statistics", stats,
                                 "mean and rstd kept by layer/RMS/batch norms, which Korthikanti et al. ignore"))
            wide4 = tag("dropout_mask_4byte")
            wide2 = tag("dropout_mask_2byte")
            if wide4 or wide2:
                out.append(Cause(A, "dropout masks in the input dtype", wide4 * 3 // 4 + wide2 // 2,
                                 "this dropout path keeps its mask in the input dtype (CPU: bernoulli_ noise), "
                                 "not as the 1-byte masks CUDA's native_dropout keeps"))
            fp32 = tag("autocast_fp32_output")
            if fp32:
                out.append(Cause(A, "ops autocast runs in fp32", fp32 // 2,
                                 "softmax, layer_norm and log_softmax run in fp32 under autocast, so their saved "
                                 "outputs take 4 bytes per element instead of 2"))
            lse = tag("attention_logsumexp")
            attention = ctx.transformer.get("attention", "eager")
            if lse and attention != "flash":
                out.append(Cause(A, "attention logsumexp", lse,
                                 "fused attention keeps an fp32 logsumexp per head and position"))
        if ctx.transformer is None:
            functional = tag("saved_in_container_code")
            if functional and facts.activation_formula is not None:
                out.append(Cause(A, "functional code in container modules", functional,
                                 "tensors saved by torch functions called directly in a forward() that has "
                                 "submodules (attention math, residual adds): per-module rules do not see them"))
            norule = tag("saved_in_module_without_rule")
            if norule and facts.activation_formula is not None:
                out.append(Cause(A, "modules without a formula", norule,
                                 "saved by module types memprof has no saved-bytes rule for ("
                                 + (", ".join(facts.modules_without_rule) or "see the notes")
                                 + "): measured, not predicted"))
            if facts.activation_formula is not None and phase in (Phase.FORWARD, Phase.BACKWARD):
                for tag_name, sign, name, sentence in _RULE_VIEW_CAUSES:
                    amount = tag(tag_name)
                    if amount:
                        out.append(Cause(A, name, sign * amount, sentence))
                model_inputs = facts.activation_inputs_saved
                if model_inputs:
                    out.append(Cause(A, "model inputs saved by modules", -model_inputs,
                                     "the model's inputs that its modules save for backward (the first layer's "
                                     "input, an embedding's indices): the per-module formula counts them as "
                                     "activations, memprof as inputs"))
            outside = tag("saved_outside_modules")
            if outside:
                out.append(Cause(A, "saved outside the model", outside,
                                 "tensors saved by code outside the model's modules (the loss function: its "
                                 "log-softmax output and targets), which no module formula covers"))
        else:
            layers = _repeated_block_activations(trace)
            fwd_end = _last_forward_end(trace)
            if (phase in (Phase.FORWARD, Phase.BACKWARD) and layers is not None and fwd_end is not None
                    and fwd_end > layers):
                out.append(Cause(A, "outside the transformer layers", fwd_end - layers,
                                 "embeddings, final norm, LM head and loss save tensors too; the per-layer formula "
                                 "covers the layers only (measured at the end of the last forward)"))

    # Temporaries inside the optimizer step.
    if phase is Phase.OPTIMIZER and m[T] is not None and f[T] is not None and m[T] != f[T]:
        impl = trace.optimizer_implementation or "unknown"
        if impl == "for-loop" and m[T] < f[T]:
            out.append(Cause(T, "for-loop step is below its bound", m[T] - f[T],
                             "the for-loop step's formula is an upper bound (a few times the largest parameter); "
                             "this step needed less"))

    # Device-only rows.
    oh = m[Category.ALLOCATOR_OVERHEAD]
    if oh:
        out.append(Cause(Category.ALLOCATOR_OVERHEAD, "caching allocator", oh,
                         "blocks the caching allocator keeps reserved but not allocated: rounding to 512 B, "
                         "segments of 2 or 20 MiB, and fragmentation"))
    ot = m[Category.OUTSIDE_TORCH]
    if ot:
        lo, hi = CUDA_CONTEXT_RANGE
        out.append(Cause(Category.OUTSIDE_TORCH, "CUDA context and libraries", ot,
                         f"the CUDA context, kernels and cuBLAS/cuDNN workspaces, typically "
                         f"{format_bytes(lo)} to {format_bytes(hi)} per process"))

    # Tensor categories without a formula at this moment count in the total's gap as measured.
    for cat in TENSOR_CATEGORIES:
        if f[cat] is None and m[cat]:
            out.append(Cause(cat, "no formula", m[cat], _NO_FORMULA.get(cat, "the textbook has no formula for "
                                                                         "this category: measured, not predicted")))
    return out


_NO_FORMULA = {
    Category.INPUTS: "the batch and targets handed to the model and the loss; the textbook's model-state and "
                     "activation formulas leave them out",
    Category.TEMPORARIES: "op outputs nobody saved for backward and scratch memory live at this moment; the textbook "
                          "has a formula for them only inside the optimizer step",
}


def _forward_before(trace: Trace, rec: PhaseRecord) -> "PhaseRecord | None":
    """The forward that a backward record follows: the last forward of its step before it
    (a forward after it, such as a no_grad evaluation before optimizer.step(), is not it)."""
    phases = trace.phases
    at = next((i for i, p in enumerate(phases) if p is rec), len(phases))
    return next((p for p in reversed(phases[:at]) if p.phase is Phase.FORWARD and p.step == rec.step), None)


def _last_forward_end(trace: Trace) -> "int | None":
    fwd = [p for p in trace.phases if p.phase is Phase.FORWARD]
    return fwd[-1].end[Category.ACTIVATIONS] if fwd else None


def _repeated_block_activations(trace: Trace) -> "int | None":
    """Activations of the largest group of same-type siblings (the transformer layers)."""
    groups: dict[tuple[str, str], int] = {}
    counts: dict[tuple[str, str], int] = {}
    for m in trace.modules:
        if m.path == "<model>" or m.activations is None:
            continue
        parent = m.path.rsplit(".", 1)[0] if "." in m.path else "<model>"
        key = (parent, m.type)
        groups[key] = groups.get(key, 0) + m.activations
        counts[key] = counts.get(key, 0) + 1
    best = [(v, k) for k, v in groups.items() if counts[k] >= 2]
    return max(best)[0] if best else None


def _order(rec: PhaseRecord) -> int:
    return {Phase.OTHER: 0, Phase.FORWARD: 1, Phase.BACKWARD: 2, Phase.OPTIMIZER: 3}[rec.phase] * 100 + rec.occurrence


def _advice(ctx: _Context) -> list[str]:
    from .advice import advice

    return advice(ctx.trace, ctx.measured, ctx.precision, ctx.optimizer)
