"""The layouts a plan compares: named ways of placing a model on ranks, each the options it gives
:func:`memprof.estimate`: the data-parallel layouts (:data:`memprof.simulate.ranks.PARALLEL`) and the
tensor-parallel ones a transformers model's own TP plan allows (:mod:`memprof.simulate.hf_layouts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import InvalidArgumentError
from .hf_layouts import tp_degrees, tp_parallelize

__all__ = ["Layout", "data_parallel_layouts", "tp_layouts", "choose_layouts", "GROUPS"]


@dataclass(frozen=True)
class Layout:
    """One way to place the model on the ranks: its name in the plan and the options it gives
    :func:`memprof.estimate` (``world_size=``, ``parallel=``, ``mesh=`` and ``parallelize=`` ...).

    ``family`` groups layouts whose ranks hold the same activations per sample (every data-parallel layout holds
    a whole sample's): the plan measures how each moment grows with the batch once per family, precision and
    checkpointing, and the others of the family start from it. A layout that splits activations (tensor or
    pipeline parallelism) is a family of its own, the default."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    family: str = ""


def data_parallel_layouts(world_size: int) -> list[Layout]:
    """The data-parallel layouts of ``world_size`` ranks (:data:`memprof.simulate.ranks.PARALLEL`), or one
    device alone for a world size of 1."""
    from .ranks import PARALLEL, check_parallel

    if world_size == 1:
        return [Layout("single", family="data-parallel")]
    check_parallel(world_size, "ddp")
    return [Layout(name, {"world_size": world_size, "parallel": name}, "data-parallel") for name in PARALLEL]


#: The groups ``layouts=`` (and ``memprof plan --layouts``) takes besides layout names.
GROUPS = ("dp", "tp", "all")


def tp_layouts(model: Any, world_size: int) -> list[Any]:
    """The tensor-parallel layouts of ``world_size`` ranks the model allows (:func:`tp_degrees`): ``tp{W}`` over
    every rank, and ``fsdp{D}-tp{T}`` (FSDP over ``D`` groups of ``T`` TP ranks, ``D x T = W``)."""
    out = []
    for t in tp_degrees(model, world_size):
        d = world_size // t
        if d == 1:
            out.append(Layout(f"tp{t}", {"world_size": world_size, "mesh": {"tp": t},
                                         "parallelize": tp_parallelize()}))
        else:
            out.append(Layout(f"fsdp{d}-tp{t}", {"world_size": world_size, "mesh": {"dp": d, "tp": t},
                                                 "parallelize": tp_parallelize(fsdp=True)}))
    return out


def choose_layouts(model: Any, world_size: int, wanted: "str | Any") -> list[Any]:
    """The layouts ``wanted`` names: a comma-separated string or a list of layout names (``ddp``, ``fsdp``,
    ``zero1``-``zero3``, ``tp8``, ``fsdp4-tp2`` ...) and groups (``dp``: the data-parallel ones, ``tp``: every
    tensor-parallel one the model allows, ``all``), or Layouts as they are."""
    items = [w.strip() for w in wanted.split(",")] if isinstance(wanted, str) else list(wanted)
    dp = data_parallel_layouts(world_size)
    tp = tp_layouts(model, world_size) if world_size > 1 else []
    known = {lay.name: lay for lay in dp + tp}
    groups = {"dp": dp, "tp": tp, "all": dp + tp}
    out: list[Any] = []
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
            why = "" if tp or world_size == 1 else (" (no tensor-parallel layout: the model's heads, MLP width or "
                                                    "vocabulary are not divisible, or it has no TP plan)")
            raise InvalidArgumentError(f"unknown layout {item!r} for {world_size} rank(s){why}; use "
                                       + ", ".join([*known, *GROUPS]))
        out.extend(lay for lay in chosen if lay.name not in {o.name for o in out})
    if not out:
        raise InvalidArgumentError("a plan needs at least one layout")
    return out
