"""One rank's formula, term by term, saying which parallel degree divides which term, held against what the rank
measured (or what a simulated rank holds) at one moment: ZeRO's Table I per rank, extended to the mesh.

The degrees and what they cut are read from the run (:class:`memprof.record.layout.MeshLayout`: the DTensor
placements of the parameters, FSDP2's units and policy), never typed by the user. Sources:

- Model states: Rajbhandari et al. 2020, "ZeRO", §5.1, Table I: a data-parallel rank of ``N_d`` holds ``1/N_d`` of
  what its stage shards; FSDP's ``fully_shard`` is stage 3 (Zhao et al. 2023, "PyTorch FSDP", §3.2), and it gathers
  one unit's full parameters at a time, in the ``MixedPrecisionPolicy``'s ``param_dtype``
  (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, ``foreach_all_gather``), whose gradients exist
  unsharded until their reduce-scatter. Tensor parallelism divides the states of the layers it splits by ``t``
  (Shoeybi et al. 2019, "Megatron-LM", §3): here by the product of the mesh dimensions whose placement cuts each
  parameter. A pipeline stage holds only its own layers (Narayanan et al. 2021, §2.2): the trace's parameters are
  the stage's.
- Activations: Korthikanti et al. 2022, §4, eq. 2 and 3 (:func:`memprof.anatomy.parallelism.rank_terms`), when
  the transformer's shape is given.

A term memprof has no formula for says so (``value`` None), never 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Mapping

from ...errors import is_interrupt
from ...units import format_bytes, round_half_away
from ...vocabulary import Category, Phase

if TYPE_CHECKING:
    from ...record.aliases import UserObject
    from ...record.layout import MeshLayout
    from ...record.trace import Breakdown, PhaseRecord, Trace
    from .context import Cause

__all__ = ["RankRow", "RankTable", "rank_table"]

W, G, O, A, C = (Category.WEIGHTS, Category.GRADIENTS, Category.OPTIMIZER_STATES, Category.ACTIVATIONS,
                 Category.COMMUNICATION)


@dataclass(frozen=True)
class RankRow:
    """One category of one rank: the per-rank ``formula`` (which degree divides which term), its bytes
    (``value``; None where memprof has no per-rank formula, and ``formula`` says so), the run's bytes
    (``actual``: measured, or simulated for an estimate) and the named parts of the gap, each (name, bytes,
    sentence); :attr:`unexplained` is what they leave."""

    category: Category
    formula: str
    value: "int | None"
    actual: "int | None"
    parts: "tuple[tuple[str, int, str], ...]" = ()

    @property
    def gap(self) -> "int | None":
        return None if self.value is None or self.actual is None else self.actual - self.value

    @property
    def unexplained(self) -> "int | None":
        gap = self.gap
        return None if gap is None else gap - sum(b for _, b, _ in self.parts)


@dataclass(frozen=True)
class RankTable:
    """A rank's per-degree formula at one moment: ``degrees`` the mesh read from the run ((name, size) in mesh
    order), ``rows`` one per category the formula or the run has, ``notes`` what the table assumes."""

    rank: int
    world_size: int
    degrees: tuple[tuple[str, int], ...]
    rows: tuple[RankRow, ...]
    notes: tuple[str, ...] = ()
    #: The run is a simulated rank (an estimate's): its figures are simulated, not measured.
    simulated: bool = False

    def row(self, category: "Category | str") -> RankRow:
        cat = Category.parse(category)
        return next(r for r in self.rows if r.category is cat)


def rank_table(trace: "Trace", measured: "Breakdown", rec: "PhaseRecord | None", moment: str,
               formula: "Breakdown", causes: "tuple[Cause, ...]",
               transformer: "Mapping[str, UserObject] | None" = None, simulated: bool = False) -> "RankTable | None":
    """The per-rank table of a distributed run whose parameters are DTensors (or a DDP rank); None otherwise.
    ``moment`` is ``"peak"``, ``"start"`` or ``"end"`` of ``rec``'s phase; ``formula`` and ``causes`` are the
    reconciliation's (the optimizer's bytes per element and the optimizer's named parts come from there);
    ``simulated``: the trace is an estimate's."""
    dist = trace.distributed
    if dist is None:
        return None
    lay = dist.layout_detail
    if lay is None and dist.layout != "ddp":
        return None
    phase = rec.phase if rec is not None else None
    gathered = lay is not None and lay.largest_unit_bytes is not None and moment == "peak" and phase in (
        Phase.FORWARD, Phase.BACKWARD)
    rows = [_weights(trace, lay, measured, gathered), _gradients(trace, lay, measured, phase, gathered),
            _optimizer(trace, lay, measured, formula, causes), _activations(trace, lay, measured, transformer)]
    rows.append(_communication(trace, measured, phase))
    for cat in (Category.INPUTS, Category.BUFFERS, Category.TEMPORARIES, Category.KV_CACHE):
        if measured[cat]:
            rows.append(RankRow(cat, "not modelled per rank: the run's own figure", None, measured[cat]))
    degrees = lay.mesh if lay is not None else (("dp_replicate", dist.world_size),)
    return RankTable(dist.rank, dist.world_size, degrees, tuple(rows), tuple(_notes(lay, dist.backend)),
                     simulated)


def _divisor(lay: "MeshLayout", dims: "tuple[str, ...]") -> int:
    n = 1
    for d in dims:
        n *= lay.degree(d)
    return n


def _terms(lay: "MeshLayout | None", trace: "Trace", trainable: bool) -> "tuple[Fraction, str]":
    """Σ bytes_g / Π(degrees cutting g) over the parameter groups (the trainable elements only with
    ``trainable``), and the sum written out with its degrees."""
    if lay is None:  # DDP: every parameter whole on every rank
        nbytes = trace.facts.weight_bytes if not trainable else _trainable_bytes(trace)
        return Fraction(nbytes), f"{nbytes:,} B (whole: DDP replicates every parameter)"
    total = Fraction(0)
    text = []
    for g in lay.groups:
        n = Fraction(g.bytes * g.trainable, g.elements) if trainable and g.elements else Fraction(g.bytes)
        if not n:
            continue
        by = _divisor(lay, g.sharded_by)
        total += n / by
        text.append(f"{round_half_away(n):,} B" + (f" / ({'·'.join(g.sharded_by)} = {by})" if g.sharded_by else
                                                     " (whole)"))
    return total, " + ".join(text) or "0 B"


def _trainable_bytes(trace: "Trace") -> int:
    f = trace.facts
    return round_half_away(Fraction(f.weight_bytes * f.num_trainable, f.num_params)) if f.num_params else 0


def _weights(trace: "Trace", lay: "MeshLayout | None", m: "Breakdown", gathered: bool) -> RankRow:
    rest, text = _terms(lay, trace, trainable=False)
    value = round_half_away(rest)
    formula = f"parameters at rest: {text}"
    parts: list[tuple[str, int, str]] = []
    stored = trace.facts.weight_bytes  # what the rank keeps between steps: its local shards, padding included
    if lay is not None and m[W] is not None and stored - value:
        parts.append(("padding and uneven rows", stored - value,
                      "the rank's local shards differ from an even split: FSDP pads dim 0 to a multiple of its shard "
                      "count, and uneven dimensions give the first ranks ceil(rows / shards) rows"))
    held = (m[W] or 0) - stored  # full parameters gathered at this moment
    if gathered and lay is not None and lay.largest_unit_bytes is not None:
        unit = lay.largest_unit_bytes
        value += unit
        formula += (f" + the largest FSDP unit gathered, {unit:,} B (its padded parameters × dp shard, in "
                    f"{lay.param_dtype or 'their own dtype'})")
        if m[W] is not None and held != unit:
            parts.append(_gathered_part(held - unit, lay.degree("pp") > 1))
    elif held > 0 and m[W] is not None:
        parts.append(("units still gathered", held, "full parameters gathered at this moment (FSDP2 keeps the root "
                      "unit's from forward until backward, and reshard_after_forward=False keeps every unit's)"))
    if lay is not None and lay.offload:
        formula += " (under CPUOffloadPolicy the shards live on the host; a device holds the gathered units)"
    return RankRow(W, formula, value, m[W], tuple(parts))


def _gathered_part(extra: int, pipelined: bool) -> "tuple[str, int, str]":
    if extra < 0:
        return ("a smaller unit gathered", extra, "the unit gathered at this moment is smaller than the largest one")
    if pipelined:
        return ("units the pipeline keeps gathered", extra, "torch's pipeline stage keeps every unit gathered across "
                "micro-batches and reshards after the last one (torch/distributed/pipelining/stage.py, "
                "backward_maybe_with_nosync: set_reshard_after_backward(False))")
    return ("units gathered beside the largest", extra, "FSDP2 keeps the root unit gathered from forward into "
            "backward and prefetches the next unit; at this moment these units are gathered, not the largest alone")


def _gradients(trace: "Trace", lay: "MeshLayout | None", m: "Breakdown", phase: "Phase | None",
               gathered: bool) -> RankRow:
    rest, text = _terms(lay, trace, trainable=True)
    g = m[G]
    if phase is Phase.FORWARD:
        return RankRow(G, "none before backward (zero_grad(set_to_none=True) freed them)", 0, g,
                       (("kept from the previous step", g, "gradients not set to None after the last step "
                         "(zero_grad(set_to_none=False), or gradient accumulation)"),) if g else ())
    value = round_half_away(rest)
    formula = f"sharded gradients (the parameters' dtype): {text}"
    if phase is Phase.BACKWARD and gathered and lay is not None and lay.largest_unit_bytes is not None:
        unit = lay.largest_unit_bytes
        value += unit
        formula += f" + the largest unit's unsharded gradients before its reduce-scatter, {unit:,} B"
    parts: tuple[tuple[str, int, str], ...] = ()
    if phase is Phase.BACKWARD and g is not None and g < value:
        parts = (("backward in progress", g - value, "at this moment backward had produced and reduce-scattered "
                  "the gradients of only some units: the formula is every unit's sharded gradients"),)
    elif phase is Phase.OTHER and g == 0 and value:
        parts = (("freed by zero_grad", -value, "zero_grad(set_to_none=True) had let every gradient go"),)
    return RankRow(G, formula, value, g, parts)


def _optimizer(trace: "Trace", lay: "MeshLayout | None", m: "Breakdown", f: "Breakdown",
               causes: "tuple[Cause, ...]") -> RankRow:
    if trace.optimizer is None:
        return RankRow(O, "no optimizer", None, m[O])
    state = f[O]
    if state is None:
        return RankRow(O, f"no formula for {trace.optimizer}: its state is the run's own figure", None, m[O])
    rest, text = _terms(lay, trace, trainable=True)
    k = Fraction(state) / rest if rest else Fraction(0)
    per = f"{float(k):.3g}"
    parts = tuple((c.name, c.bytes, c.sentence) for c in causes if c.category is O)
    return RankRow(O, f"K × ({text}), K = {per} bytes of state per byte of trainable parameter "
                      f"({trace.optimizer})", state, m[O], parts)


def _activations(trace: "Trace", lay: "MeshLayout | None", m: "Breakdown",
                 transformer: "Mapping[str, UserObject] | None") -> RankRow:
    if not transformer:
        return RankRow(A, "not modelled per rank without the transformer's shape: give reconcile(transformer="
                          "{seq_len, batch, hidden, heads, layers}) for Korthikanti et al.'s per-layer terms", None,
                       m[A])
    from ...anatomy.parallelism import LayerShape, Parallelism, rank_terms

    t = lay.degree("tp") if lay is not None else 1
    sp = lay is not None and any("tp" in g.replicated_over for g in lay.groups)
    p = lay.degree("pp") if lay is not None else 1  # a stage holds L/p of the layers given
    try:
        shape = LayerShape(int(transformer["seq_len"]), int(transformer["batch"]), int(transformer["hidden"]),
                           int(transformer["heads"]))
        terms = rank_terms(max(trace.facts.num_params, 0), Parallelism(tp=t, pp=p, sequence_parallel=sp), shape=shape,
                           layers=int(transformer["layers"]), in_flight=1)
    except (KeyError, TypeError, ValueError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return RankRow(A, "not modelled: transformer= needs seq_len, batch, hidden, heads and layers", None, m[A])
    act = next(x for x in terms if x.category == "activations")
    how = " (sequence parallelism: norms replicated over tp)" if sp else ""
    return RankRow(A, f"{act.formula} with t = {t}{how}, in 16-bit", act.bytes, m[A])


def _communication(trace: "Trace", m: "Breakdown", phase: "Phase | None") -> RankRow:
    dist = trace.distributed
    if dist is not None and dist.layout == "ddp" and phase in (Phase.BACKWARD, Phase.OPTIMIZER, Phase.OTHER):
        if dist.bucket_view:
            return RankRow(C, "DDP's buckets are the gradients (gradient_as_bucket_view): nothing more", 0, m[C])
        nbytes = _trainable_bytes(trace)
        return RankRow(C, f"DDP's buckets, one copy of the gradients: {nbytes:,} B (Li et al. 2020, §3.2.3)",
                       nbytes, m[C])
    return RankRow(C, "not modelled per rank: all-gather, reduce-scatter and DTensor collective buffers are the "
                      "run's own figure", None, m[C])


def _notes(lay: "MeshLayout | None", backend: "str | None") -> list[str]:
    if lay is None:
        return ["DDP: every model state whole on every rank (ZeRO stage 0)"]
    source = ("the parameters' DTensor placements" if backend is not None else
              "the layout the estimate played (parallel=...), every parameter cut over the data-parallel ranks")
    out = [f"degrees and what they cut read from {source}: " + "; ".join(
        f"{g.elements:,} elements cut by {'·'.join(g.sharded_by) or 'nothing'}"
        + (f", whole over {'·'.join(g.replicated_over)}" if g.replicated_over else "") for g in lay.groups)]
    if lay.degree("pp") > 1:
        out.append(f"pipeline: this rank's parameters are its stage's; pp = {lay.degree('pp')} divides the model by "
                   "construction")
    if lay.units:
        out.append(f"{lay.units} FSDP unit(s), largest gathered {format_bytes(lay.largest_unit_bytes or 0)}, "
                   f"parameters gathered in {lay.param_dtype or 'their own dtype'}, gradients reduced in "
                   f"{lay.reduce_dtype or 'their own dtype'}" + (", CPU offload" if lay.offload else ""))
    return out
