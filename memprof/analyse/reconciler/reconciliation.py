"""Reconciliation: formula vs estimate vs measured, every gap split into named causes.

For each category the table holds what the literature predicts (the
*formula*, from :mod:`memprof.anatomy` applied to the run's recorded model and
optimizer), what an estimate of the same step shows (the *estimate*, the
simulated run of :func:`memprof.estimate`, when one is given) and what was
*measured*. The gap (measured − formula) is split into causes (:mod:`.causes`),
each with its bytes and one sentence; whatever no cause accounts for is shown
as "unexplained". Nothing here reads hooks: a reconciliation is a pure function
of a Trace, and plain data: its text, HTML, table and waterfall are
:mod:`memprof.render`'s, registered as its views by the facade (:mod:`memprof.record.views`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from ...anatomy.params import bytes_per_param_breakdown
from ...vocabulary import Category
from ...errors import InvalidArgumentError, NotMeasuredError
from ...record.estimate import Estimate
from ...record.aliases import Drawing, UserObject
from ...record.trace import Breakdown, HoldsTrace, Trace, as_trace
from ...record.views import show
from .causes import causes
from .context import Cause, Context
from .sharding import zero_stage
from ...anatomy.params import infer_precision
from .formula import formula_at, moment_of, optimizer_name, parse_at, predictions
from .textbook import Textbook, textbook_at
from .layers import LayerCheck, layer_checks
from .mixed_layers import MixedLayerGap, mixed_layer_gap
from .per_rank import RankTable, rank_table

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Row", "Total", "Reconciliation", "reconcile"]


@dataclass(frozen=True)
class Row:
    """One category: the formula's, the estimate's and the measurement's bytes (``None``: none)."""

    category: Category
    formula: "int | None"
    estimate: "int | None"
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


@dataclass(frozen=True)
class Total:
    """The total row: formula total, measured total (the report's total at this moment) and their gap,
    which the named causes and the unexplained remainders add up to."""

    formula: "int | None"
    estimate: "int | None"
    measured: "int | None"

    @property
    def gap(self) -> "int | None":
        return None if self.formula is None or self.measured is None else self.measured - self.formula

    @property
    def gap_pct(self) -> "float | None":
        gap = self.gap
        return 100.0 * gap / self.formula if gap is not None and self.formula else None


@dataclass(frozen=True)
class Reconciliation:
    """Formula vs estimate vs measured, per category, with the causes of every gap.

    ``rows`` hold the figures; ``causes`` the named parts of the gaps;
    :attr:`explanations` adds one "unexplained" entry per category for what the
    causes leave; ``textbook`` the literature's figure for this run beside the
    formula column, with the causes of their difference. ``at`` is the moment compared (``"peak"``,
    ``"steady"``, or a phase's moment in words), ``where`` that moment in the run's words. It prints as a
    table and gives ``to_frame()``: views registered by the facade (:mod:`memprof.report.reconciliation`).
    """

    at: str
    where: str
    precision: str
    optimizer: "str | None"
    rows: tuple[Row, ...]
    causes: tuple[Cause, ...]
    textbook: Textbook
    notes: tuple[str, ...] = ()
    #: The MoE routers, MoE experts and Mamba mixers of the forward, each against its own formula
    #: (:mod:`.layers`).
    layers: "tuple[LayerCheck, ...]" = ()
    _advice: tuple[str, ...] = field(default=(), repr=False)
    #: A dense layer under torch.autocast against Korthikanti et al.'s 34sbh + 5as²b, the gap named
    #: (:mod:`.mixed_layers`); None where the run has no such layer.
    mixed_layer: "MixedLayerGap | None" = None
    #: One rank of a distributed run (measured or simulated): each category's per-rank formula, saying which
    #: degree of the mesh divides which term, read from the run (:mod:`.per_rank`); None outside one.
    per_rank: "RankTable | None" = None

    def row(self, category: "Category | str") -> Row:
        cat = Category.parse(category)
        return next(r for r in self.rows if r.category is cat)

    @property
    def total(self) -> Total:
        formula = [r.formula for r in self.rows if r.formula is not None]
        estimate = [r.estimate for r in self.rows if r.estimate is not None]
        measured = [r.measured for r in self.rows if r.measured is not None]
        return Total(sum(formula) if formula else None, sum(estimate) if estimate else None,
                     sum(measured) if formula else None)

    @property
    def explanations(self) -> list[Cause]:
        """Every named cause, then per category the unexplained remainder of its gap (if any).

        Together they add up to the total row's gap: measured total minus formula total.
        """
        out = list(self.causes)
        for r in self.rows:
            rest = self.unexplained(r.category)
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

    def advice(self) -> list[str]:
        """Levers that shrink the largest categories, with predicted savings, and alignment warnings."""
        return list(self._advice)

    def to_frame(self) -> "pd.DataFrame":
        """DataFrame indexed by category value (plus ``total``): formula, estimate, measured, gap, gap_pct."""
        return show(self, "to_frame")

    def to_text(self) -> str:
        """The table, the causes of its gaps, the notes and the advice: what ``print(rec)`` shows."""
        text: str = show(self, "to_text")
        return text

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        html: str = show(self, "_repr_html_")
        return html

    def plot(self, ax: "Drawing | None" = None) -> Drawing:
        """A waterfall from the formula total to the measured total through the named causes (matplotlib)."""
        return show(self, "plot", ax=ax)


def reconcile(
    trace: "Trace | HoldsTrace",
    *,
    precision: "str | None" = None,
    optimizer: "str | None" = None,
    at: object = "peak",
    estimate: "Estimate | None" = None,
    transformer: "Mapping[str, UserObject] | None" = None,
) -> Reconciliation:
    """Reconcile a measured run (a Trace or Report) with the formulas and, optionally, an estimate.

    ``at="peak"`` compares the composition at the global peak (what decides an
    OOM); ``at="steady"`` the end of the last optimizer step, when every model
    state exists; ``at=(step, phase, moment)`` (``moment`` ``"start"``,
    ``"peak"`` or ``"end"``, an optional fourth value the occurrence, a negative
    step counting from the end) that moment of one phase, as
    :meth:`memprof.Report.breakdown` names it: ``at=(-1, "forward", "end")`` holds
    the activations against the closed form when the run peaks elsewhere.
    ``precision`` (``fp32``, ``mixed``, ``amp``, ``bf16``, ``fp16``, ``zero``)
    and ``optimizer`` (a name as in
    :func:`memprof.anatomy.bytes_per_param`) override what is inferred from
    the run: giving ``optimizer`` switches optimizer state to the textbook
    bytes/param instead of the prediction from the recorded optimizer.
    """
    simulated = isinstance(trace, Estimate)  # a simulated rank's per-rank table says "simulated"
    trace = as_trace(trace)
    at = parse_at(at)
    if optimizer is not None:
        # A name given by the user must exist (a misspelling would silently give a formula of 0 bytes).
        bytes_per_param_breakdown(precision or "fp32", optimizer)
    if estimate is not None and not isinstance(estimate, Estimate):
        raise InvalidArgumentError(
            f"estimate must be what memprof.estimate(...) returns, got {type(estimate).__name__}; "
            "estimate the same step with memprof.estimate(model, optimizer, inputs=..., ...)")
    if transformer is not None and not isinstance(transformer, Mapping):
        raise InvalidArgumentError(
            f"transformer must be a dict of seq_len, batch, hidden, heads and layers, got {type(transformer).__name__}")
    if not trace.steps:
        raise NotMeasuredError("no step was recorded; nothing to reconcile")
    precision_used = precision or infer_precision(trace)
    measured, rec, where, tags = moment_of(trace, at)
    formula = formula_at(trace, at, precision=precision_used, optimizer=optimizer, transformer=transformer)
    estimated: "Breakdown | None" = None
    if estimate is not None:
        estimated, _, _, _ = moment_of(estimate.trace, at)
    rows = tuple(Row(c, formula[c], estimated[c] if estimated is not None else None, measured[c]) for c in Category)
    opt_name = optimizer if optimizer is not None else optimizer_name(trace)
    acts, opts = predictions(trace)
    notes: list[str] = []
    dist = trace.distributed
    stage = zero_stage(dist)
    if dist is not None and dist.params_per_rank is not None:
        notes.append(f"one rank of {dist.world_size} ({dist.layout}): the formula's model states are this rank's "
                     f"share of each parameter, {dist.params_per_rank:,} of {trace.facts.num_params:,} elements, as "
                     "the parameters' placements shard them")
    elif stage and dist is not None:
        sharded = {1: "optimizer states", 2: "gradients and optimizer states",
                   3: "weights, gradients and optimizer states"}[stage]
        notes.append(f"one rank of {dist.world_size} ({dist.layout}, ZeRO stage {stage}): the "
                     f"formula's {sharded} are 1/{dist.world_size} of the model's (ZeRO, Table I)")
    if trace.optimizer is not None and opts.state_bytes is None and optimizer is None:
        notes.append(f"no formula for {trace.optimizer}: its state is measured, not predicted")
    if acts.modules_without_rule and transformer is None:
        notes.append("no saved-bytes rule for module types " + ", ".join(acts.modules_without_rule)
                     + ": their activations are not in the formula")
    for failure in acts.failed_rules + opts.failed:
        notes.append(f"a formula raised and is left out: {failure}")
    if trace.mode == "light" and trace.device.type != "cuda":
        notes.append("light mode on CPU: temporaries and totals were not measured")
    ctx = Context(trace, measured, rec, tags, formula, precision_used, opt_name, transformer, acts)
    textbook = textbook_at(trace, at, precision=precision_used, optimizer=optimizer, transformer=transformer)
    from .advice import advice

    named = tuple(causes(ctx))
    moment = at[2] if isinstance(at, tuple) else "end" if at == "steady" else "peak"
    return Reconciliation(at if isinstance(at, str) else where, where, precision_used, opt_name, rows, named,
                          textbook, tuple(notes), layer_checks(trace),
                          tuple(advice(trace, measured, precision_used, opt_name)), mixed_layer_gap(trace),
                          rank_table(trace, measured, rec, moment, formula, named, transformer, simulated))
