"""The layouts a plan compares: named ways of placing a model on ranks, each the options it gives
:func:`memprof.estimate`: the data-parallel layouts (:data:`memprof.simulate.ranks.PARALLEL`) and the
tensor-parallel ones a transformers model's own TP plan allows (:mod:`memprof.simulate.hf_layouts`) and the
pipeline-parallel ones its own pipeline plan allows (:mod:`memprof.simulate.hf_pipeline`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from ..errors import InvalidArgumentError
from .hf_experts import ep_degrees, ep_fsdp, ep_support
from .hf_layouts import tp_degrees, tp_parallelize
from .hf_pipeline import DEGREES, MICROBATCHES_PER_STAGE, PipelineSimulation, pp_degrees, pp_support
from .plan_precision import POLICY, fsdp_parallelize

if TYPE_CHECKING:
    from torch import nn

    from ..record.estimate import Estimate
    from .aliases import HfModule, Option

__all__ = ["Layout", "data_parallel_layouts", "tp_layouts", "pp_layouts", "ep_layouts", "choose_layouts", "GROUPS"]


@dataclass(frozen=True)
class Layout:
    """One way to place the model on the ranks: its name in the plan and the options it gives
    :func:`memprof.estimate` (``world_size=``, ``parallel=``, ``mesh=`` and ``parallelize=`` ...).

    ``family`` groups layouts whose ranks hold the same activations per sample (every data-parallel layout holds
    a whole sample's): the plan measures how each moment grows with the batch once per family, precision and
    checkpointing, and the others of the family start from it. A layout that splits activations (tensor or
    pipeline parallelism) is a family of its own, the default.

    ``simulate``, when given, is how the layout simulates a batch instead:
    ``simulate(estimate, model, optimizer, make_batch, b, precision=..., loss_fn=..., gpu=..., ...)`` (a
    pipeline's: its micro-batches, its loss, every stage's rank). ``microbatches`` is the number of micro-batches
    a row's batch is the size of (a pipeline's; None: the batch is the rank's whole batch). ``precisions`` are
    the precisions the layout can be planned in (None: every one). ``policy`` is what a ``bf16-params`` row of a
    layout with FSDP2 runs (:mod:`memprof.simulate.plan_precision`): the options that give its ``fully_shard``
    calls FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, in place of ``options`` (a layout
    with ``simulate`` is handed the row's precision and applies the policy itself); None where the layout has no
    FSDP2 to carry it, whose ``mixed`` rows are then autocast."""

    name: str
    options: "Mapping[str, Option]" = field(default_factory=dict)
    family: str = ""
    simulate: "Callable[..., Estimate] | None" = field(default=None, compare=False)
    microbatches: "int | None" = None
    precisions: "tuple[str, ...] | None" = None
    policy: "Mapping[str, Option] | None" = None


def data_parallel_layouts(world_size: int) -> list[Layout]:
    """The data-parallel layouts of ``world_size`` ranks (:data:`memprof.simulate.ranks.PARALLEL`), or one
    device alone for a world size of 1. ``fsdp``'s ``bf16-params`` rows run torch's own ``fully_shard`` with FSDP2's
    policy on the same units (:func:`~memprof.simulate.plan_precision.fsdp_parallelize`): the policy's bf16 gathers
    are FSDP2's code, not a model of it."""
    from .ranks import PARALLEL, check_parallel

    if world_size == 1:
        return [Layout("single", family="data-parallel")]
    check_parallel(world_size, "ddp")
    return [Layout(name, {"world_size": world_size, "parallel": name}, "data-parallel",
                   policy={"world_size": world_size, "parallelize": fsdp_parallelize()} if name == "fsdp" else None)
            for name in PARALLEL]


#: The groups ``layouts=`` (and ``memprof plan --layouts``) takes besides layout names.
GROUPS = ("dp", "tp", "pp", "ep", "all")


def tp_layouts(model: nn.Module, world_size: int) -> list[Layout]:
    """The tensor-parallel layouts of ``world_size`` ranks the model allows (:func:`tp_degrees`): ``tp{W}`` over
    every rank, and ``fsdp{D}-tp{T}`` (FSDP over ``D`` groups of ``T`` TP ranks, ``D x T = W``)."""
    out = []
    for t in tp_degrees(model, world_size):
        d = world_size // t
        if d == 1:
            out.append(Layout(f"tp{t}", {"world_size": world_size, "mesh": {"tp": t},
                                         "parallelize": tp_parallelize()}))
        else:
            mesh = {"dp": d, "tp": t}
            out.append(Layout(f"fsdp{d}-tp{t}", {"world_size": world_size, "mesh": mesh,
                                                 "parallelize": tp_parallelize(fsdp=True)},
                              policy={"world_size": world_size, "mesh": mesh,
                                      "parallelize": tp_parallelize(fsdp=True, mixed=True)}))
    return out


def ep_layouts(model: nn.Module, world_size: int) -> list[Layout]:
    """The expert-parallel layouts of ``world_size`` ranks a mixture-of-experts model's own EP plan allows
    (:func:`~memprof.simulate.hf_experts.ep_degrees`): ``fsdp-ep{E}``, its experts split ``E`` ways by expert and
    FSDP2 over the ``W / E`` ranks holding the same experts, every other parameter FSDP2 over all ``W`` ranks
    (:func:`~memprof.simulate.hf_experts.ep_fsdp`, torchtitan's layout); every rank its own batch, the routing
    memprof's ``balanced`` assumption."""
    out = []
    for e in ep_degrees(model, world_size):
        mesh = {"dp": world_size // e, "ep": e, "tp": 1}
        out.append(Layout(f"fsdp-ep{e}", {"world_size": world_size, "mesh": mesh, "parallelize": ep_fsdp()},
                          policy={"world_size": world_size, "mesh": mesh, "parallelize": ep_fsdp(mixed=True)}))
    return out


def pp_layouts(model: nn.Module, world_size: int) -> list[Layout]:
    """The pipeline-parallel layouts of ``world_size`` ranks the model allows (:func:`pp_degrees`): ``pp{P}-fsdp{D}``
    (``P`` stages, FSDP2 over ``D`` ranks inside each, ``P x D = W``), or ``pp{W}`` alone; then, where the model's
    TP plan allows a degree ``T`` of the ``W / P`` ranks (:func:`tp_degrees`), ``pp{P}-fsdp{D}-tp{T}`` and
    ``pp{P}-tp{T}`` (``P x D x T = W``). 1F1B over :data:`~memprof.simulate.hf_pipeline.MICROBATCHES_PER_STAGE` x
    ``P`` micro-batches, a row's batch the micro-batch's size. A layout without FSDP is planned in bf16, fp16 and
    fp32 only: a plan's mixed precision under a pipeline is FSDP2's ``MixedPrecisionPolicy`` (``bf16-params``),
    which needs FSDP (the schedule runs no autocast)."""
    out: list[Layout] = []
    with_tp: list[Layout] = []
    for p in pp_degrees(model, world_size):
        micro = MICROBATCHES_PER_STAGE * p
        # Tensor parallelism inside the stages where the model's TP plan allows it, after the layouts without.
        for t in [1, *tp_degrees(model, world_size // p)]:
            d = world_size // (p * t)
            name = f"pp{p}" + (f"-fsdp{d}" if d > 1 else "") + (f"-tp{t}" if t > 1 else "")
            mesh = {"pp": p, **({"dp": d} if d > 1 else {}), **({"tp": t} if t > 1 else {})}
            options = {"world_size": world_size, "mesh": mesh, "schedule": "1f1b"}
            (out if t == 1 else with_tp).append(Layout(
                name, options, simulate=PipelineSimulation(world_size, p, micro, tp=t), microbatches=micro,
                precisions=("bf16", "fp16", "fp32") if d == 1 else ("bf16", "fp16", "fp32", POLICY),
                policy=options if d > 1 else None))
    return out + with_tp


def choose_layouts(model: nn.Module, world_size: int, wanted: "str | Iterable[str | Layout]") -> list[Layout]:
    """The layouts ``wanted`` names: a comma-separated string or a list of layout names (``ddp``, ``fsdp``,
    ``fsdp1`` (named only: not in the ``dp`` group), ``zero1``-``zero3``, ``tp8``, ``fsdp4-tp2``, ``pp2-fsdp4``
    ...) and groups (``dp``: the data-parallel ones,
    ``tp``: every tensor-parallel one the model allows, ``pp``: every pipeline-parallel one, ``all``), or Layouts
    as they are."""
    items = [w.strip() for w in wanted.split(",")] if isinstance(wanted, str) else list(wanted)
    dp = data_parallel_layouts(world_size)
    tp = tp_layouts(model, world_size) if world_size > 1 else []
    pp = pp_layouts(model, world_size) if world_size > 1 else []
    ep = ep_layouts(model, world_size) if world_size > 1 else []
    # FSDP1, planned when named (FSDP1's own code on the fake process group: memprof.simulate.fsdp1).
    fsdp1 = ([Layout("fsdp1", {"world_size": world_size, "parallel": "fsdp1"}, "data-parallel")]
             if world_size > 1 else [])
    known = {lay.name: lay for lay in dp + fsdp1 + tp + ep + pp}
    groups = {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "all": dp + tp + ep + pp}
    out: list[Layout] = []
    for item in items:
        if isinstance(item, Layout):
            chosen = [item]
        elif isinstance(item, str) and item.lower() in groups:
            chosen = groups[item.lower()]
        elif isinstance(item, str) and item.lower() in known:
            chosen = [known[item.lower()]]
        elif isinstance(item, str) and not item:
            continue
        else:
            why = _missing(model, item, tp, pp, world_size)
            usable = [g for g in GROUPS if groups[g]]  # an empty group is no way out
            raise InvalidArgumentError(f"unknown layout {item!r} for {world_size} rank(s){why}; use "
                                       + ", ".join([*known, *usable]))
        if isinstance(item, str) and item.lower() in ("pp", "ep") and not groups[item.lower()]:
            what = "pipeline" if item.lower() == "pp" else "expert"
            raise InvalidArgumentError(f"no {what}-parallel layout for {world_size} rank(s)"
                                       f"{_missing(model, item, tp, pp, world_size)}; plan without --layouts "
                                       f"{item.lower()}")
        out.extend(lay for lay in chosen if lay.name not in {o.name for o in out})
    if not out:
        raise InvalidArgumentError("a plan needs at least one layout")
    return out


def _missing(model: HfModule, item: object, tp: list[Layout], pp: list[Layout], world_size: int) -> str:
    """Why the layouts ``item`` asks for are not there, in parentheses (empty when that says nothing)."""
    name = str(item).lower()
    if name == "ep" or name.startswith("fsdp-ep"):
        return _missing_ep(model, name, world_size)
    if name.startswith("pp"):
        ok, why = pp_support(model)
        if not ok:
            return f" (no pipeline-parallel layout: {why})"
        layers = len(model.base_model.layers)
        degrees = " or ".join(map(str, DEGREES))
        degree = re.match(r"pp(\d+)", name)
        if degree is not None and int(degree.group(1)) > 1:
            p = int(degree.group(1))
            if world_size % p or layers % p or p not in DEGREES:
                return (f" (pipeline layouts cut the model into {degrees} stages that divide both the world size and "
                        f"the model's {layers} decoder layers: {p} stages "
                        + ("is not one of them" if p not in DEGREES else
                           f"do not divide {world_size} rank(s)" if world_size % p else
                           f"do not divide {layers} layers") + ")")
        if not pp and world_size > 1:
            return (f" (no pipeline-parallel layout: no pipeline degree of {degrees} divides both the world size and "
                    f"the model's {layers} decoder layers)")
        return ""
    degree = re.search(r"tp(\d+)", name)
    if degree is not None and int(degree.group(1)) > 1 and world_size % int(degree.group(1)):
        return (f" (a tensor-parallel layout splits each layer over its degree of ranks, which must divide the world "
                f"size: {degree.group(1)} does not divide {world_size} rank(s))")
    if tp or world_size == 1:
        return ""
    return (" (no tensor-parallel layout: the model's heads, MLP width or vocabulary are not divisible, or it has no "
            "TP plan)")


def _missing_ep(model: nn.Module, name: str, world_size: int) -> str:
    """Why the expert-parallel layouts ``name`` asks for are not there, in parentheses."""
    ok, why = ep_support(model)
    if not ok:
        return f" (no expert-parallel layout: {why})"
    if world_size == 1:
        return " (expert parallelism needs two ranks or more)"
    return (f" (expert-parallel layouts fsdp-ep{{E}} split every MoE layer's experts E ways: E must be above 1 and "
            f"divide both the world size and the experts of each layer; {world_size} rank(s) allow "
            f"{', '.join(map(str, ep_degrees(model, world_size))) or 'none'})")
