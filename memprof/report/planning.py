"""Planning from a model's config: :func:`estimate_hf` (a training step), :func:`estimate_hf_generation` (a
generation), :func:`plan` (a DataFrame) and :func:`plan_grid` (the :class:`Plan`, a
:class:`~memprof.record.plans.PlanGrid` record, whose text and page are the views :mod:`.views` registers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..record.estimate import Estimate
from ..record.plans import PlanGrid
from ..simulate import hf
from ..simulate import plan as planning
from .wrap import same_as, Forwarded

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Plan", "estimate_hf", "estimate_hf_generation", "plan", "plan_grid"]


#: The plan's record (:class:`memprof.record.plans.PlanGrid`), by the name the facade has always given it.
Plan = PlanGrid


@same_as(hf.estimate_hf)
def estimate_hf(config: Forwarded, **options: Forwarded) -> Estimate:
    return hf.estimate_hf(config, **options)


@same_as(hf.estimate_hf_generation)
def estimate_hf_generation(config: Forwarded, **options: Forwarded) -> Estimate:
    return hf.estimate_hf_generation(config, **options)


@same_as(planning.plan_hf)
def plan_grid(config: Forwarded, **options: Forwarded) -> Plan:
    return planning.plan_hf(config, **options)


def plan(config: Forwarded, *, seq_len: int, gpu: Forwarded, world_size: int = 1,
         layouts: "Sequence[planning.Layout | str] | str | None" = None,
         precisions: Sequence[str] = planning.PRECISIONS,
         checkpointing: Sequence[bool] = (False, True), optimizer: Forwarded = None, alloc_conf: Forwarded = None,
         attention: str = "auto", processes: "int | None" = None) -> "pd.DataFrame":
    """The largest batch per rank that fits ``gpu`` for each layout of ``world_size`` ranks (DDP, FSDP, ZeRO 1-3 by
    default; ``layouts="all"`` adds the tensor-parallel ones the model's own TP plan allows: ``tp8``, ``fsdp4-tp2``,
    and the pipeline ones its pipeline plan allows: ``pp2-fsdp4``, whose batch is the micro-batch's size),
    precision (bf16, and mixed: FSDP2's ``MixedPrecisionPolicy``, ``bf16-params``, on a layout with FSDP2,
    bf16 autocast over fp32 parameters, ``autocast``, on the others: :mod:`memprof.simulate.plan_precision`) and
    activation checkpointing (off, on), for the model a transformers config
    describes (a ``PretrainedConfig``, a folder holding ``config.json``, the file, or a cached hub id) with
    ``seq_len`` tokens per sequence: a DataFrame, a row per configuration, with the peak at that batch and the
    category that dominates it. ``processes``: how many processes search the rows (default one per group of rows
    that share no simulation, at most twice the cores; the answers are the same). :func:`plan_grid` takes the same
    arguments and returns the :class:`Plan` (its text, HTML page and notes)."""
    return plan_grid(config, seq_len=seq_len, gpu=gpu, world_size=world_size, layouts=layouts,
                     precisions=precisions, checkpointing=checkpointing, optimizer=optimizer, alloc_conf=alloc_conf,
                     attention=attention, processes=processes).to_frame()
