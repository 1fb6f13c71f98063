"""The plan: for each layout, precision and activation-checkpointing setting, the largest batch that fits a GPU.

Each configuration of the grid is judged at the device level (tensors, the caching allocator's segments, the
memory outside torch) against the GPU's capacity, and its answer is always confirmed by simulation: the batch
fits and the batch above it does not, both simulated (:func:`memprof.simulate.plan_search.largest_batch`). The
batches tried come from each phase moment's tensor bytes as a line in the batch (the optimizer step's moment is
flat, the forward's and backward's steep; the peak is the largest of them), measured once per precision,
checkpointing and *family* of layouts (the data-parallel layouts hold the same activations per sample and differ
in model states, which are flat), and for a checkpointed row from its own row without checkpointing: most rows
cost the two confirming simulations, or one when not even one sample fits.

The layouts are a list of named entries (:class:`Layout`), each the options it hands to
:func:`memprof.estimate`: the data-parallel layouts, tensor-parallel ones built from a transformers model's
own TP plan (:mod:`memprof.simulate.hf_layouts`) and pipeline-parallel ones cut by its own pipeline plan
(:mod:`memprof.simulate.hf_pipeline`: a pipeline row's batch is the micro-batch's size, the micro-batch count
fixed, and its figures the fullest stage's rank); any other way of placing a model on ranks is one more entry.
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

from ..errors import InvalidArgumentError, SimulationError, is_interrupt
from ..record.plans import PlanGrid, PlanRow
from .hf_pipeline import MICROBATCHES_PER_STAGE, PipelineSimulation, StageSearch
from .layouts import Layout, data_parallel_layouts
from .plan_precision import AUTOCAST, POLICY, check_precisions, estimate_precision, precision_note, row_precision
from .plan_processes import searched

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..anatomy.alloc_config import AllocatorConfig
    from ..anatomy.gpus import GpuSpec
    from .aliases import HfModule, Option, UserValue
    from .estimated import Estimate
    from .hf import ConfigSource
    from .plan_search import Moment, Probe
    from .progress import Progress
    from .run import OptimizerArg

__all__ = ["Layout", "PlanRow", "PlanGrid", "data_parallel_layouts", "plan_grid", "plan_hf", "Trained", "Labels",
           "configurations", "PRECISIONS"]

#: The precisions a plan compares by default: bf16 weights and optimizer state, and mixed precision as the
#: layout's users run it: FSDP2's MixedPrecisionPolicy (``bf16-params``) on a layout with FSDP2, fp32 master
#: weights with the forward under bf16 autocast (``autocast``) on the others (:mod:`.plan_precision`).
PRECISIONS = ("bf16", "mixed")


class Trained(NamedTuple):
    """What every row of a plan trains: ``model_for(checkpointing)`` returns the model (built on the meta device)
    with activation checkpointing on or off, ``make_batch(b)`` its inputs for ``b`` samples (a dict, a tuple or a
    tensor as :func:`memprof.estimate` takes them), the optimizer and ``loss_fn`` as there, and ``loop`` the
    training loop simulated (:mod:`memprof.simulate.loops`; memprof's own when None) in every layout but a
    pipeline's, whose step torch's schedule runs."""

    model_for: "Callable[[bool], nn.Module]"
    make_batch: "Callable[[int], UserValue]"
    optimizer: "OptimizerArg"
    loss_fn: "Callable[..., torch.Tensor] | None" = None
    loop: "str | None" = None


class Labels(NamedTuple):
    """What a plan says of its model: its name, the sequence length, and notes on how it was built."""

    model_name: str = "model"
    seq_len: "int | None" = None
    notes: Sequence[str] = ()


_SEARCH_NOTE = ("search: every row's answer was simulated, and so was the batch above it unless the search stopped at"
                " its ceiling (verified: it fits, the next does not); the batches tried were predicted from each "
                "phase moment's tensor bytes as a line in the batch (two simulated batches per precision, "
                "checkpointing and family of layouts) plus the device bytes above the tensors the nearest simulated "
                "batch that fitted showed, and once a row had two simulated batches whose allocation streams have one"
                " shape, by replaying the stream interpolated between them through the allocator model; a prediction "
                "is never an answer. The answer is the edge below which every batch fits: where memory is pressed "
                "(the allocator frees its cache and retries) a batch can fail while a larger one fits, so the replays"
                " below the answer were read down to a batch that fits without pressing memory")


def plan_grid(trained: Trained, *, gpu: "str | GpuSpec | None", layouts: Sequence[Layout],
              precisions: Sequence[str] = PRECISIONS, checkpointing: Sequence[bool] = (False, True),
              alloc_conf: "str | AllocatorConfig | None" = None, attention: str = "auto", max_batch: int = 4096,
              labels: "Labels | None" = None, processes: "int | None" = None) -> PlanGrid:
    """The grid of ``layouts`` x ``precisions`` x ``checkpointing`` of what ``trained`` says: each row the largest
    batch judged at the device level against ``gpu``'s capacity, found and confirmed by simulation.

    ``processes``: how many processes search the rows (:mod:`.plan_processes`); None, one per group of rows that
    share no simulation, at most twice the cores this process may run on; 1 searches every row here."""
    from .device_memory import check_target
    from .progress import Progress

    spec, _ = check_target(gpu, None, alloc_conf)
    if spec is None:
        raise InvalidArgumentError("a plan needs gpu= (a GPU name such as 'h100-80gb' or a GpuSpec): its rows are the "
                                   "largest batches that fit that device")
    if not layouts:
        raise InvalidArgumentError("a plan needs at least one layout")
    start = time.perf_counter()
    configs, skipped = configurations(layouts, precisions, checkpointing)
    labels = labels if labels is not None else Labels()

    def search(rows: "Sequence[tuple[bool, str, Layout]]") -> list[PlanRow]:
        grid = _Grid(trained, spec, alloc_conf, attention, max_batch)
        with Progress(None, "plan") as bar:
            for ckpt, precision, layout in rows:
                grid.row(ckpt, precision, layout, bar)
        return grid.rows

    rows, forked = searched(configs, search, processes)
    if all(r.failed for r in rows):
        raise SimulationError(f"no configuration of the plan could be simulated; {rows[0].layout} "
                              f"{rows[0].precision}: {rows[0].failed}")
    return PlanGrid(rows=tuple(rows), model=labels.model_name, gpu=spec.name, capacity=spec.allocatable_bytes,
                    world_size=max((int(lay.options.get("world_size", 1)) for lay in layouts), default=1),
                    seq_len=labels.seq_len, seconds=time.perf_counter() - start,
                    notes=(*labels.notes, precision_note([r.precision for r in rows]), _SEARCH_NOTE, *skipped,
                           *_pipeline_notes(layouts), *_expert_notes(layouts), *_process_notes(forked)))


def configurations(layouts: Sequence[Layout], precisions: Sequence[str],
                    checkpointing: Sequence[bool]) -> "tuple[list[tuple[bool, str, Layout]], list[str]]":
    """The grid's rows, (checkpointing, the row's precision, layout), each once, and a note for every layout a
    precision asked for is not planned in, saying why. ``mixed`` is resolved per layout
    (:func:`~memprof.simulate.plan_precision.row_precision`); an unknown precision is refused."""
    precisions = check_precisions(precisions)
    configs: list[tuple[bool, str, Layout]] = []
    missing: dict[str, list[str]] = {}
    for c in checkpointing:
        for p in precisions:
            for lay in layouts:
                row = row_precision(p, lay.policy is not None, lay.precisions)
                if row is None:
                    if p not in missing.setdefault(lay.name, []):
                        missing[lay.name].append(p)
                elif (c, row, lay) not in configs:
                    configs.append((c, row, lay))
    if not configs:
        raise InvalidArgumentError(f"no layout asked for is planned in {', '.join(precisions)}: "
                                   + "; ".join(_why_not(lay, missing.get(lay.name, [])) for lay in layouts))
    return configs, [_why_not(lay, missing[lay.name]) for lay in layouts if missing.get(lay.name)]


def _why_not(lay: Layout, precisions: Sequence[str]) -> str:
    """Why ``lay`` is not planned in ``precisions``."""
    if lay.microbatches:
        return (f"{lay.name} is planned in {', '.join(lay.precisions or ())} only, not in {', '.join(precisions)}: "
                "a pipeline's schedule runs no autocast, and its mixed precision is FSDP2's MixedPrecisionPolicy "
                f"({POLICY}), which needs FSDP inside the stages")
    why = [f"{POLICY} is FSDP2's MixedPrecisionPolicy, which needs fully_shard in the layout (its mixed row is "
           f"{AUTOCAST})"] if POLICY in precisions else []
    if any(p != POLICY for p in precisions):  # a layout of the user's that limits its precisions
        why.append(f"it is planned in {', '.join(lay.precisions or ())} only")
    return f"{lay.name} is not planned in {', '.join(precisions)}: " + "; ".join(why)


class _Grid:
    """A plan's rows as they are searched: the models by checkpointing, each (checkpointing, precision, family)'s
    moments per sample and the layout that measured them, each row's probe."""

    def __init__(self, trained: Trained, spec: "GpuSpec", alloc_conf: "str | AllocatorConfig | None", attention: str,
                 max_batch: int) -> None:
        self.trained, self.spec, self.alloc_conf, self.attention, self.max_batch = (trained, spec, alloc_conf,
                                                                                    attention, max_batch)
        self.rows: list[PlanRow] = []
        self.models: "dict[bool, nn.Module]" = {}
        self.slopes: "dict[tuple[bool, str, str], tuple[dict[Moment, float], str]]" = {}
        self.probes: "dict[tuple[str, str, bool], Probe]" = {}

    def row(self, ckpt: bool, precision: str, layout: Layout, bar: "Progress") -> None:
        """Search the row of ``layout`` in ``precision`` with checkpointing ``ckpt``, and keep it; a configuration
        whose simulation fails (the model's code or an op on shape-only tensors, a pipeline stage that cannot run
        its cut) is kept as a failed row saying why, and the plan goes on with the others."""
        try:
            self._search(ckpt, precision, layout, bar)
        except (SimulationError, InvalidArgumentError) as exc:
            if is_interrupt(exc):
                raise
            text = str(exc).strip()
            why = text.splitlines()[0] if text else type(exc).__name__
            self.rows.append(PlanRow(layout=layout.name, precision=precision, checkpointing=ckpt, max_batch_size=0,
                                     batch=0, peak_bytes=0, device_peak=None, headroom=None, dominant="",
                                     dominant_bytes=0, peak_step=None, peak_phase=None, breakdown={}, simulations=0,
                                     verified=False, microbatches=layout.microbatches, failed=why))

    def _search(self, ckpt: bool, precision: str, layout: Layout, bar: "Progress") -> None:
        from .estimate import estimate
        from .plan_search import Probe, largest_batch

        t = self.trained
        if ckpt not in self.models:
            self.models[ckpt] = t.model_for(ckpt)
        model = self.models[ckpt]
        label = f"{layout.name} {precision}{' ckpt' if ckpt else ''}"
        common = dict(precision=precision, loss_fn=t.loss_fn, gpu=self.spec, alloc_conf=self.alloc_conf,
                      attention=self.attention)
        # A layout that simulates a batch its own way (a pipeline's micro-batches) is handed the row's precision;
        # estimate() gets its own word for it, and a bf16-params row the layout's fully_shard with FSDP2's policy.
        if layout.simulate is not None:
            over = ({"over": StageSearch(self.spec.allocatable_bytes)}  # a batch's stages until one does not fit
                    if isinstance(layout.simulate, PipelineSimulation) else {})
            run = partial(layout.simulate, estimate, model, t.optimizer, t.make_batch, **common, **over)
        else:
            common["precision"] = estimate_precision(precision)
            options = layout.policy if precision == POLICY and layout.policy is not None else layout.options
            run = partial(_simulate, estimate, model, t.optimizer, t.make_batch, **_looped(common, t.loop),
                          **dict(options))
        one = Probe(run, self.spec.allocatable_bytes, self.max_batch,
                    lambda b: bar.step(f"{label} batch {b}"))
        family = (ckpt, precision, layout.family or layout.name)
        shared, reference = self.slopes.get(family, (None, ""))
        predicted, overhead, at_batch = _sibling_start(self.probes, layout.name, reference, precision, ckpt)
        # Where the family's first row fitted a few samples at most, this one starts at batch 1 (a row that
        # does not fit one sample costs one simulation); else at 2, whose stream pairs with those above it.
        measured_by = next((r for r in self.rows
                            if (r.layout, r.precision, r.checkpointing) == (reference, precision, ckpt)), None)
        base = 2 if measured_by is not None and measured_by.max_batch_size >= 3 else 1
        best, verified, measured = largest_batch(one, shared, predicted, overhead, at_batch, base)
        if measured is not None and family not in self.slopes:
            self.slopes[family] = (measured, layout.name)
        self.probes[(layout.name, precision, ckpt)] = one
        at = best if best else 1
        if at not in one.runs:  # nothing fits, and batch 1 was not simulated: it is, for the row's figures
            one.judged(at)
        self.rows.append(_row(layout.name, precision, ckpt, best, at, one.runs[at], len(one.runs), verified,
                              layout.microbatches))


def _looped(common: "dict[str, Option]", loop: "str | None") -> "dict[str, Option]":
    """``common`` with the named ``loop``; the HF Trainer's computes its own loss (``Trainer.compute_loss``), so a
    ``loss_fn`` meant for memprof's loop is left out for it."""
    if loop in (None, "plain"):
        return common
    return {**common, "loop": loop, **({"loss_fn": None} if loop == "hf-trainer" else {})}


def _simulate(estimate: "Callable[..., Estimate]", model: "nn.Module", optimizer: "OptimizerArg",
              make_batch: "Callable[[int], UserValue]", b: int, **options: "Option") -> "Estimate":
    """``estimate`` of ``model`` on the batch of ``b`` samples, with ``options`` (the layout's and the plan's)."""
    return estimate(model, optimizer, inputs=make_batch(b), **options)


def _sibling_start(probes: "dict[tuple[str, str, bool], Probe]", layout: str, reference: str, precision: str,
                   ckpt: bool) -> "tuple[dict[Moment, int] | None, int, int]":
    """A prediction of ``layout``'s moments at a small batch with checkpointing ``ckpt``, from simulations already
    run: its own at that batch with checkpointing the other way, plus what switching it changed in ``reference``
    (the layout that measured the slopes) at that batch, moment by moment. Checkpointing changes the activations
    and recomputation, which every layout of a family shares, and not the model states, which is where the layouts
    differ. The batch is the smallest of 1 and 2 that ``layout``'s own row simulated (2 where rows start, or 1),
    the reference's moments there as simulated or on its lines (it simulated batch 1 and the batches its search
    took next: :meth:`~memprof.simulate.plan_search.Probe.moments_at`). None (and 0, 1) when there is none."""
    own = probes.get((layout, precision, not ckpt))
    ref_here, ref_there = probes.get((reference, precision, ckpt)), probes.get((reference, precision, not ckpt))
    if own is None or ref_here is None or ref_there is None or layout == reference:
        return None, 0, 1
    at = next((b for b in (1, 2) if b in own.moments), None)
    if at is None:
        return None, 0, 1
    a, b, c = own.moments[at], ref_here.moments_at(at), ref_there.moments_at(at)
    if b is None or c is None or not a.keys() == b.keys() == c.keys():
        return None, 0, 1
    # The reference's device bytes above its tensors at the largest batch it fitted: at small batches a flat
    # moment (the optimizer step's) can hold the device peak and inflate them; near the answer the batch's own do.
    fitted = [b_ for b_ in ref_here.runs if ref_here.fits(b_)]
    overhead = ref_here.overhead(max(fitted)) if fitted else 0
    return {m: a[m] + b[m] - c[m] for m in a}, overhead, at


def optimizer_words(optimizer: "OptimizerArg") -> str:
    """The optimizer a plan's rows step, in words: None is torch's AdamW with its defaults; a class, or a partial of
    one (``--optimizer sgd``), by its name and the arguments given; another factory by its own name."""
    if optimizer is None:
        return "torch.optim.AdamW with its defaults"
    func, given = (optimizer.func, optimizer.keywords) if isinstance(optimizer, partial) else (optimizer, {})
    name = getattr(func, "__qualname__", None) or type(func).__name__
    if isinstance(func, type):
        module = getattr(func, "__module__", "") or ""
        where = "torch.optim" if module.startswith("torch.optim") else module
        args = ", ".join(f"{k}={v!r}" for k, v in given.items())
        return f"{where}.{name}" + (f" with {args}" if args else " with its defaults")
    return f"as given ({name})"


def _process_notes(processes: int) -> list[str]:
    """How the rows were searched, said where more than one process did."""
    if processes <= 1:
        return []
    return [f"search: the rows were searched by {processes} processes forked from this one, each group of rows that "
            "share no simulation (a precision and family of layouts) by one; the answers are those one process "
            "gives (processes=1, --processes 1)"]


def _pipeline_notes(layouts: Sequence[Layout]) -> list[str]:
    """What a pipeline row's batch is, said once when the plan has one."""
    if not any(lay.microbatches for lay in layouts):
        return []
    return ["pipeline layouts (pp{P}, pp{P}-fsdp{D}, with -tp{T} the model's TP plan inside the stages): the "
            f"batch is one micro-batch's sequences, the micro-batches per step fixed at {MICROBATCHES_PER_STAGE} x P "
            "(the row's microbatches; a pipeline rank's step takes batch x microbatches sequences), run by torch's "
            "1F1B schedule, under which the first stage holds P micro-batches' activations at once whatever their "
            "count (Narayanan et al. 2021, §2.2); every stage's rank simulated, the figures the worst one's "
            "(worst_stage: the largest device-level peak); FSDP2 inside the stages with reshard_after_forward=False "
            "(torchtitan's default under pipeline parallelism), mixed precision its "
            "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)"]


def _expert_notes(layouts: Sequence[Layout]) -> list[str]:
    """What an expert-parallel row assumes, said once when the plan has one."""
    if not any("ep" in (lay.options.get("mesh") or {}) for lay in layouts):
        return []
    return ["expert-parallel layouts (fsdp-ep{E}: the model's own expert-parallel plan, base_model_ep_plan, applied by "
            "transformers' apply_expert_parallelism over E ranks; fully_shard of each MoE layer's experts over the "
            "W / E ranks holding the same experts, of every decoder layer and the root over all W ranks, as "
            "torchtitan lays out EP borrowed from FSDP): every rank takes its own batch; which experts the tokens "
            "go to is data that shape-only tensors do not have, so the routing is memprof's balanced assumption "
            "(each router call's top-k spread evenly over the experts, every EP rank routing alike, so each rank's "
            "experts receive as many token rows as it sends); a skewed router holds more on its busiest rank "
            "(memprof estimate --routing worst bounds it)"]


def _row(layout: str, precision: str, ckpt: bool, best: int, at: int, est: "Estimate", simulations: int,
         verified: bool, microbatches: "int | None" = None) -> PlanRow:
    from .rank_classes import worst_stage

    peak = est.trace.peak
    values = {c.value: peak[c] for c in peak}
    dominant = max((c for c in values if values[c] is not None), key=lambda c: values[c] or 0)
    return PlanRow(layout=layout, precision=precision, checkpointing=ckpt, max_batch_size=best, batch=at,
                   peak_bytes=est.peak_bytes, device_peak=est.device_peak, headroom=est.headroom,
                   dominant=dominant, dominant_bytes=values[dominant] or 0, peak_step=est.trace.peak_step,
                   peak_phase=est.trace.peak_phase_label(), breakdown=values, simulations=simulations,
                   verified=verified, microbatches=microbatches, worst_stage=worst_stage(est),
                   stages=len(est.ranks) or None)


def plan_hf(config: "ConfigSource", *, seq_len: int, gpu: "str | GpuSpec | None", world_size: int = 1,
            layouts: "Sequence[Layout | str] | str | None" = None, precisions: Sequence[str] = PRECISIONS,
            checkpointing: Sequence[bool] = (False, True), optimizer: "OptimizerArg" = None,
            alloc_conf: "str | AllocatorConfig | None" = None, attention: str = "auto",
            loop: "str | None" = "hf-trainer", processes: "int | None" = None) -> PlanGrid:
    """:func:`plan_grid` for the model a transformers config describes (:func:`memprof.simulate.hf.load_config`),
    built on the meta device, ``seq_len`` tokens per sequence, AdamW unless ``optimizer`` (a factory of
    parameters) says otherwise; ``layouts`` defaults to the data-parallel layouts of ``world_size`` ranks, and
    takes Layouts, layout names and groups (``"dp"``, ``"tp"``, ``"pp"``, ``"all"``:
    :func:`~memprof.simulate.layouts.choose_layouts`), e.g. ``"fsdp,tp8,fsdp4-tp2,pp2-fsdp4"``. ``loop`` is the
    training loop simulated (:mod:`memprof.simulate.loops`): the HF Trainer's step by default, ``"plain"`` for
    memprof's own; a pipeline layout's rows run torch's schedule instead. ``processes``: as :func:`plan_grid`
    takes it (the rows' groups in forked processes, one each by default, at most twice the cores)."""
    from . import hf
    from .loops import transformers_version_note
    from .layouts import choose_layouts

    cfg = hf.load_config(config)
    first = hf.build_model(cfg)
    token_batch = hf.token_batch

    def model_for(ckpt: bool) -> "HfModule":
        return first.model if not ckpt else hf.build_model(cfg, checkpointing=True).model

    token_batch(first, 1, seq_len)  # a bad seq_len fails before anything is simulated
    said = [f"{first.architecture} built from its config on the meta device ({first.kind}), {seq_len} tokens per "
            "sequence; the batch is one rank's",
            "optimizer: " + optimizer_words(None if optimizer is hf.adamw else optimizer),
            *hf.loop_versions(loop), *transformers_version_note(cfg)]
    if any(bool(c) for c in checkpointing):  # only when a row has it
        said.append("checkpointing: transformers' activation checkpointing on every layer (non-reentrant)")
    trained = Trained(model_for, lambda b: token_batch(first, b, seq_len), optimizer or hf.adamw, hf.hf_loss, loop)
    return plan_grid(trained, gpu=gpu,
                     layouts=choose_layouts(first.model, world_size, "dp" if layouts is None else layouts),
                     precisions=precisions, checkpointing=checkpointing, alloc_conf=alloc_conf, attention=attention,
                     labels=Labels(first.architecture, seq_len, said + list(first.notes)), processes=processes)
