"""The textbook's figure beside the formula for the run as configured, every byte of their difference named.

The formula column of every view is :func:`.formula.formula_at` in the run's own regime. A run under
``torch.autocast`` over fp32 parameters is ``"amp"``: 4 B/param of weights, because autocast keeps no
persistent 16-bit weights; it casts per op (``aten/src/ATen/autocast_mode.cpp``), and a cast is an
activation while saved for backward, a temporary while cached for one forward. With AdamW that is
16 B/param of model states. The figure people quote for such a run is HF's mixed precision, 18 B/param
(HF Transformers docs, "Model training anatomy": fp32 weights 4 + a 16-bit copy 2, gradients 4, AdamW 8;
the scheme of Micikevicius et al. 2018, "Mixed Precision Training"). :func:`textbook_at` gives that figure
at the same moment, from the same function, so that a table can show both without ever showing two
formulas for one category.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ...anatomy.params import BytesPerParam, bytes_per_param_breakdown, infer_precision, textbook_regime
from ...vocabulary import Category, Phase
from ...errors import UnknownNameError, is_interrupt
from ...record.aliases import UserObject
from ...record.trace import Breakdown, Trace
from ...units import format_bytes
from .causes import NO_PERSISTENT_COPY
from .context import Cause
from .formula import formula_at, moment_of, optimizer_name, parse_at

__all__ = ["Textbook", "textbook_at", "differences", "REGIME_WORDS"]

_MODEL_STATES = (Category.WEIGHTS, Category.GRADIENTS, Category.OPTIMIZER_STATES)

#: What each regime holds, in words, for the lines that name them.
REGIME_WORDS = {
    "fp32": "fp32 parameters",
    "mixed": "HF's mixed precision, fp32 weights and a 16-bit copy",
    "amp": "torch.autocast over fp32 parameters",
    "bf16": "bf16 parameters",
    "fp16": "fp16 parameters",
    "zero": "ZeRO's mixed precision, 16-bit parameters and gradients and an fp32 master copy in the optimizer",
}

# (the run's regime, the textbook's, category) -> the cause of the textbook's difference there, (name, sentence).
_CAUSES: dict[tuple[str, str, Category], tuple[str, str]] = {
    ("amp", "mixed", Category.WEIGHTS): NO_PERSISTENT_COPY,
}


@dataclass(frozen=True)
class Textbook:
    """The textbook's breakdown at a moment beside the formula's (the run as configured), and the causes
    of their difference: ``causes`` (signed as formula − textbook) add up to it in every category.

    ``per_param`` is the literature's model states per parameter for a run configured so (6 + 4 + 8 = 18
    for AdamW under torch.autocast), ``formula_per_param`` the formula's (4 + 4 + 8 = 16 there); ``None``
    where the bytes/param table has no row for the optimizer. Where the two regimes are one, ``causes``
    is empty and the breakdowns are equal.
    """

    regime: str
    formula_regime: str
    per_param: "BytesPerParam | None"
    formula_per_param: "BytesPerParam | None"
    breakdown: Breakdown
    formula: Breakdown
    causes: tuple[Cause, ...]

    @property
    def bytes_per_param(self) -> "float | None":
        """The textbook's model states per parameter (18 for mixed-precision AdamW)."""
        return self.per_param.total if self.per_param is not None else None

    @property
    def formula_bytes_per_param(self) -> "float | None":
        """The formula's model states per parameter (16 for AdamW under torch.autocast)."""
        return self.formula_per_param.total if self.formula_per_param is not None else None

    @property
    def regime_words(self) -> str:
        """The textbook's regime in words ("HF's mixed precision, fp32 weights and a 16-bit copy")."""
        return REGIME_WORDS.get(self.regime, self.regime)

    @property
    def formula_regime_words(self) -> str:
        """The run's regime in words ("torch.autocast over fp32 parameters")."""
        return REGIME_WORDS.get(self.formula_regime, self.formula_regime)

    @property
    def differs(self) -> bool:
        """Does the literature quote another regime than the run's?"""
        return self.regime != self.formula_regime

    @property
    def model_states(self) -> "int | None":
        """The textbook's weights + gradients + optimizer states at this moment (``None``: one has no formula)."""
        return _model_states(self.breakdown)

    @property
    def formula_model_states(self) -> "int | None":
        """The formula's weights + gradients + optimizer states at this moment (``None``: one has no formula)."""
        return _model_states(self.formula)


def textbook_at(trace: Trace, at: object = "peak", *, precision: "str | None" = None, optimizer: "str | None" = None,
                transformer: "Mapping[str, UserObject] | None" = None) -> Textbook:
    """The textbook beside the formula at the moment ``at`` (as :func:`.formula.formula_at` takes it).

    ``precision`` is the run's regime (inferred from the run when ``None``, as the formula infers it);
    the textbook's is :func:`memprof.anatomy.textbook_regime` of it. Both breakdowns come from
    :func:`.formula.formula_at` with the same moment, optimizer and transformer, so they differ only
    where the regimes do.
    """
    at = parse_at(at)
    regime = precision or infer_precision(trace)
    quoted = textbook_regime(regime)
    formula = formula_at(trace, at, precision=regime, optimizer=optimizer, transformer=transformer)
    book = formula if quoted == regime else formula_at(trace, at, precision=quoted, optimizer=optimizer,
                                                        transformer=transformer)
    casts = moment_of(trace, at)[3].get("autocast_weight_copy", 0)
    opt_name = optimizer if optimizer is not None else optimizer_name(trace)
    return Textbook(quoted, regime, _per_param(trace, quoted, opt_name), _per_param(trace, regime, opt_name), book,
                    formula, differences(formula, book, regime, quoted, casts))


def differences(formula: Breakdown, book: Breakdown, regime: str, quoted: str, casts: int = 0) -> tuple[Cause, ...]:
    """formula − textbook per category, each with its named cause (``"unexplained"`` where the table of
    causes has none for the two regimes); ``casts`` is the bytes of autocast's 16-bit weight casts live
    at the moment, which the sentence of the persistent copy's cause gives."""
    out = []
    for cat in Category:  # every category, so that no difference goes unshown (the regimes differ in weights)
        f, b = formula[cat], book[cat]
        if f is None or b is None or f == b:
            continue
        name, sentence = _CAUSES.get((regime, quoted, cat), ("unexplained", "no named cause accounts for this "
                                                                           "difference between the regimes"))
        if (name, sentence) == NO_PERSISTENT_COPY:
            sentence += (f"; {format_bytes(casts)} of such casts are live at this moment" if casts else
                         "; none of those casts is live at this moment")
        out.append(Cause(cat, name, f - b, sentence))
    return tuple(out)


def _per_param(trace: Trace, regime: str, opt_name: "str | None") -> "BytesPerParam | None":
    # A run that only generated keeps the weights only (HF: 6 B/param for mixed-precision inference).
    decoding = trace.generation is not None and not any(p.phase is Phase.BACKWARD for p in trace.phases)
    if opt_name is None and trace.optimizer is not None and not decoding:
        return None  # an optimizer without a row: its states per parameter are unknown, not 0
    try:
        return bytes_per_param_breakdown(regime, opt_name, training=not decoding)
    except UnknownNameError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return None


def _model_states(bd: Breakdown) -> "int | None":
    values = [bd[c] for c in _MODEL_STATES]
    return None if None in values else sum(values)  # type: ignore[arg-type]
