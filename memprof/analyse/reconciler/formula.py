"""The formula side of a reconciliation: the textbook breakdown of a recorded run at one moment.

Weights and gradients are bytes/param (HF's model anatomy; ZeRO §3) times the
recorded parameter counts; optimizer state and the optimizer step's
temporaries come from the optimizer formulas applied to the recorded
optimizers; activations from Korthikanti et al.'s per-layer form when a
transformer configuration is given, else from the per-module rules applied to
the recorded first forward (:mod:`memprof.anatomy.predict`).
"""

from __future__ import annotations

from typing import Mapping

from ...anatomy.activations import transformer_layer_activations
from ...anatomy.shapes import LayerShape, Parallelism
from ...record.aliases import UserObject
from ...anatomy.params import BytesPerParam, bytes_per_param_breakdown, infer_precision
from ...anatomy.predict import ActivationPrediction, OptimizerPrediction, predict_activations, predict_optimizers
from ...vocabulary import PHASE_MOMENTS, RECONCILE_MOMENTS, Category, Phase, parse_moment
from .cache_formula import cache_formula
from .sharding import shard_formula
from ...errors import InvalidArgumentError, NotMeasuredError, UnknownNameError, is_interrupt
from ...record.trace import Breakdown, PhaseRecord, Trace

__all__ = ["optimizer_name", "formula_breakdown", "formula_at", "moment_of", "predictions"]


def optimizer_name(trace: Trace) -> "str | None":
    """The bytes/param table's name for the run's optimizer class (``None``: not in the table)."""
    if trace.optimizer is None:
        return None
    cls = trace.optimizer.rsplit(".", 1)[-1].lower()
    names = {"adamw": "adamw", "adam": "adam", "sgd": "sgd", "adagrad": "adagrad", "rmsprop": "rmsprop",
             "adafactor": "adafactor", "lion": "lion", "adamw8bit": "adamw_8bit", "pagedadamw8bit": "adamw_8bit"}
    return names.get(cls)


_PREDICTIONS: "dict[int, tuple[Trace, ActivationPrediction, OptimizerPrediction]]" = {}


def predictions(trace: Trace) -> tuple[ActivationPrediction, OptimizerPrediction]:
    """The per-module and optimizer formulas of a trace (computed once per trace object)."""
    cached = _PREDICTIONS.get(id(trace))
    if cached is not None and cached[0] is trace:
        return cached[1], cached[2]
    if len(_PREDICTIONS) > 64:
        _PREDICTIONS.clear()
    result = (trace, predict_activations(trace), predict_optimizers(trace))
    _PREDICTIONS[id(trace)] = result
    return result[1], result[2]


def formula_breakdown(trace: Trace, *, precision: "str | None" = None, optimizer: "str | None" = None,
                      moment: "PhaseRecord | None" = None, transformer: "Mapping[str, UserObject] | None" = None,
                      at_peak: bool = True) -> Breakdown:
    """The textbook breakdown for the run's model and optimizer.

    Weights and gradients are bytes/param (HF, ZeRO; see
    :func:`memprof.anatomy.bytes_per_param`) times the parameter counts.
    Optimizer state is predicted from the recorded optimizer when memprof has a
    formula for it (exact, ``step`` counters included), else from
    ``optimizer``'s bytes/param. Activations are Korthikanti et al.'s
    per-layer form when ``transformer`` gives the configuration
    (``seq_len, batch, hidden, heads, layers`` and any keyword of
    :func:`~memprof.anatomy.transformer_layer_activations`), else the sum of
    the per-module saved-bytes rules over the first forward. Temporaries have
    a formula only inside the optimizer step (its step temporaries).
    """
    facts = trace.facts
    acts, opts = predictions(trace)
    precision = precision or infer_precision(trace)
    opt_name = optimizer if optimizer is not None else optimizer_name(trace)
    try:
        bpp = bytes_per_param_breakdown(precision, opt_name if opt_name is not None else None)
    except UnknownNameError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        bpp = bytes_per_param_breakdown(precision, None)
    values: dict[Category, "int | None"] = {c: None for c in Category}
    values[Category.WEIGHTS] = int(round(bpp.weights * facts.num_params))
    values[Category.BUFFERS] = facts.buffer_bytes
    if trace.steps and any(p.phase is Phase.BACKWARD for p in trace.phases):
        values[Category.GRADIENTS] = int(round(bpp.gradients * facts.num_trainable))
    elif trace.steps:
        values[Category.GRADIENTS] = 0  # evaluation only: no backward, no gradients
    if opts.state_bytes is not None and optimizer is None:
        values[Category.OPTIMIZER_STATES] = opts.state_bytes
    elif opt_name is not None:
        values[Category.OPTIMIZER_STATES] = int(round(bpp.optimizer_states * facts.num_trainable))
    elif trace.optimizer is None:
        values[Category.OPTIMIZER_STATES] = 0
    if transformer is not None:
        cfg = dict(transformer)
        try:
            layers = int(cfg.pop("layers"))
            # The flat keywords of transformer=: the layer's shape, its parallel degrees, then the variant's.
            shape = LayerShape(cfg.pop("seq_len"), cfg.pop("batch"), cfg.pop("hidden"), cfg.pop("heads"),
                               ffn_hidden=cfg.pop("ffn_hidden", None), kv_heads=cfg.pop("kv_heads", None))
            parallel = Parallelism(tp=cfg.pop("tensor_parallel", 1),
                                   sequence_parallel=cfg.pop("sequence_parallel", False))
            per_layer = transformer_layer_activations(shape, parallel=parallel, **cfg)
        except (KeyError, TypeError) as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            raise InvalidArgumentError(
                f"transformer= needs seq_len, batch, hidden, heads and layers (and keywords of "
                f"transformer_layer_activations); {exc}") from None
        values[Category.ACTIVATIONS] = layers * per_layer
    else:
        values[Category.ACTIVATIONS] = acts.saved_bytes
    if moment is not None and moment.phase in (Phase.OPTIMIZER, Phase.OTHER):
        values[Category.ACTIVATIONS] = 0  # no graph is alive outside forward and backward
    dist = trace.distributed
    if dist is not None and dist.layout == "ddp" and moment is not None and moment.phase in (
            Phase.BACKWARD, Phase.OPTIMIZER, Phase.OTHER) and values[Category.GRADIENTS] is not None:
        # DDP's buckets hold a copy of every gradient for the allreduce (Li et al. 2020, "PyTorch Distributed",
        # section 3.2.3), unless gradient_as_bucket_view makes the gradients views of them
        # (torch/nn/parallel/distributed.py). Before the first backward they are not used, so not seen.
        values[Category.COMMUNICATION] = 0 if dist.bucket_view else int(round(bpp.gradients * facts.num_trainable))
    if trace.generation is not None and moment is not None and _decoding(trace, moment):
        _inference(values, trace, moment, precision, bpp_inference=bytes_per_param_breakdown(precision, None,
                                                                                             training=False),
                   which="peak" if at_peak else "end")
    if moment is not None and moment.phase is Phase.OPTIMIZER and at_peak and opts.transient_bytes is not None:
        values[Category.TEMPORARIES] = opts.transient_bytes
    if dist is not None:
        shard_formula(values, dist, facts)  # the rank's share (nothing for DDP)
    return Breakdown.from_mapping(values)


def _inference(values: dict[Category, int | None], trace: Trace, moment: PhaseRecord, precision: str,
               bpp_inference: BytesPerParam, which: str = "end") -> None:
    """A run that decoded with a KV cache: inference bytes/param (HF: mixed 6, fp32 4, bf16 2), nothing for
    gradients, optimizer or saved activations (no graph is built), and the cache's formula at ``which``
    moment of the phase (:mod:`.cache_formula`: per layer, as the implementation keeps it)."""
    gen = trace.generation
    assert gen is not None
    values[Category.WEIGHTS] = int(round(bpp_inference.weights * trace.facts.num_params))
    values[Category.GRADIENTS] = 0
    values[Category.OPTIMIZER_STATES] = 0 if trace.optimizer is None else values[Category.OPTIMIZER_STATES]
    values[Category.ACTIVATIONS] = 0
    values[Category.KV_CACHE] = cache_formula(trace, moment, which)


def _decoding(trace: Trace, moment: PhaseRecord) -> bool:
    """A moment of a generation: a prefill or decode phase, or the loop's work between them in a run that
    never trains (a training run's own moments keep the training formula)."""
    if moment.phase in (Phase.PREFILL, Phase.DECODE):
        return True
    return moment.phase is Phase.OTHER and not any(p.phase in (Phase.BACKWARD, Phase.OPTIMIZER) for p in trace.phases)


#: A moment of one phase: (step, phase, "start" | "peak" | "end", occurrence).
PhaseMoment = tuple[int, Phase, str, int]


def parse_at(at: object) -> "str | PhaseMoment":
    """``"peak"``, ``"steady"``, or a phase's moment ``(step, phase, "start"|"peak"|"end"[, occurrence])``,
    the vocabulary of :meth:`memprof.Report.breakdown` (a negative step counts from the end)."""
    if isinstance(at, tuple):
        if len(at) not in (3, 4):
            raise InvalidArgumentError(
                f"at=(step, phase, moment[, occurrence]) takes 3 or 4 values, got {len(at)}; for example "
                "at=(1, 'forward', 'end')")
        step, phase, moment = at[0], Phase.parse(at[1]), parse_moment(at[2], PHASE_MOMENTS, "the moment in at")
        occurrence = at[3] if len(at) == 4 else 0
        for name, value in (("step", step), ("occurrence", occurrence)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(f"the {name} in at=(step, phase, moment) must be an int, got {value!r}")
        if occurrence < 0:
            raise InvalidArgumentError(f"the occurrence in at=(...) counts from 0, got {occurrence}")
        return (step, phase, moment, occurrence)
    if isinstance(at, str) and at.strip().lower() in RECONCILE_MOMENTS:
        return at.strip().lower()
    raise InvalidArgumentError(
        f"at must be 'peak', 'steady' or a phase's moment (step, phase, 'start'|'peak'|'end'[, occurrence]), "
        f"for example at=(1, 'forward', 'end'); got {at!r}")


def formula_at(trace: Trace, at: object = "peak", *, precision: "str | None" = None, optimizer: "str | None" = None,
               transformer: "Mapping[str, UserObject] | None" = None) -> Breakdown:
    """The textbook breakdown for the moment ``at`` of a run (``"peak"``, ``"steady"`` or a phase's
    moment, see :func:`parse_at`): the one formula every view of that moment shows (a
    reconciliation, an estimate's table, the CLI's estimate).

    The regime is the run's own (:func:`infer_precision`) unless ``precision`` names another: a
    view leaves it out, or passes what the user asked for, and never picks one of its own, so that
    one run shows one formula. Under torch.autocast over fp32 parameters that is ``"amp"``; the
    figure the literature quotes for such a run is :func:`memprof.analyse.reconciler.textbook_at`'s.

    The moment matters: outside forward and backward no graph is alive, so the formula for
    activations there is 0, and inside the optimizer step temporaries have a formula.
    """
    at = parse_at(at)
    _measured, rec, _where, _tags = moment_of(trace, at)
    at_peak = at == "peak" or (isinstance(at, tuple) and at[2] == "peak")
    formula = formula_breakdown(trace, precision=precision, optimizer=optimizer, moment=rec,
                                transformer=transformer, at_peak=at_peak)
    if isinstance(at, tuple) and at[1] is Phase.FORWARD and at[2] == "start" and formula[Category.ACTIVATIONS]:
        # Nothing is saved yet when a forward begins: the textbook's activations are 0 there.
        formula = Breakdown.from_mapping({**{c: formula[c] for c in Category}, Category.ACTIVATIONS: 0})
    if isinstance(at, tuple) and at[2] == "start" and rec is not None and trace.generation is not None \
            and _decoding(trace, rec):
        # A call begins with what the call before it left in the cache.
        formula = Breakdown.from_mapping({**{c: formula[c] for c in Category},
                                          Category.KV_CACHE: cache_formula(trace, rec, "start")})
    return formula


def moment_of(trace: Trace, at: "str | PhaseMoment") -> tuple[Breakdown, "PhaseRecord | None", str, dict[str, int]]:
    """The measured breakdown at a reconciliation moment, the phase record it belongs to, the moment
    in words and the tags' live bytes then.

    ``"peak"`` is the global peak; ``"steady"`` the end of the last optimizer phase (every model
    state exists), else of the last backward or forward; a tuple, that moment of that phase.
    """
    rec: PhaseRecord | None
    if isinstance(at, tuple):
        step, phase, moment, occurrence = at
        total = trace.num_steps
        if not -total <= step < total:
            raise InvalidArgumentError(f"step {step} is out of range: this run had {total} step(s)")
        index = step + total if step < 0 else step
        record = next((s for s in trace.steps if s.index == index), None)
        if record is None:
            kept = ", ".join(str(s.index) for s in trace.steps[:8])
            raise NotMeasuredError(f"step {step} is not among the steps kept in full (kept: {kept}); reconcile "
                                   "one of those, or at='peak' / 'steady'")
        matches = [p for p in record.phases if p.phase is phase]
        if occurrence >= len(matches):
            raise NotMeasuredError(f"step {index} has {len(matches)} {phase.value} phase(s); occurrence "
                                   f"{occurrence} does not exist")
        rec = matches[occurrence]
        tags = dict(rec.tags_peak) if moment == "peak" else dict(rec.tags_end) if moment == "end" else {}
        label = phase.value + (f" #{occurrence}" if occurrence else "")
        return getattr(rec, moment), rec, f"{moment} of {label} (step {index})", tags
    if at == "peak":
        rec = None
        for p in trace.phases:
            if trace.peak_step == p.step and trace.peak_phase is p.phase and (
                    rec is None or (p.peak.total or 0) > (rec.peak.total or 0)):
                rec = p
        where = "peak" + (f" (step {trace.peak_step}, {trace.peak_phase.value})" if trace.peak_phase else "")
        return trace.peak, rec, where, dict(trace.peak_tags)
    for phase in (Phase.OPTIMIZER, Phase.BACKWARD, Phase.FORWARD):
        recs = [p for p in trace.phases if p.phase is phase]
        if recs:
            rec = recs[-1]
            return rec.end, rec, f"end of {phase.value} (step {rec.step})", dict(rec.tags_end)
    raise NotMeasuredError("no step was recorded; nothing to reconcile")
