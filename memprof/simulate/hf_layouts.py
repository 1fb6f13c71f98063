"""Tensor-parallel layouts of a transformers model for the plan: its own TP plan applied with torch's styles.

A transformers model names how it splits across tensor-parallel ranks in ``model.tp_plan`` (the class's
``_tp_plan``, e.g. ``{"lm_head": "colwise_gather_output"}``, with the config's ``base_model_tp_plan`` under the
base model's prefix and ``embed_tokens`` sharded by vocabulary: ``transformers/distributed/mixin.py``,
``init_parallel_plans``). ``from_pretrained(tp_plan="auto")`` applies it with transformers' own style classes,
registered in ``transformers/distributed/tensor_parallel.py`` with the layouts of torch's styles:
``"colwise"`` is ``ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))``, ``"rowwise"``
``RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())``, ``"colwise_gather_output"`` a column
split whose output is replicated, ``"embedding_rowwise"`` the embedding's rows (the vocabulary) split with a
replicated output. :func:`tp_parallelize` applies the same plan with torch's ``parallelize_module`` and those
styles of ``torch.distributed.tensor.parallel`` (Megatron's split: Shoeybi et al. 2019, "Megatron-LM", §3), so
memprof's simulation runs torch's DTensor code on its fake process group; ``fsdp`` shards every decoder layer
and the root over the mesh's ``dp`` dimension with ``fully_shard`` on top (2-D: FSDP x TP).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Callable

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["tp_plan", "tp_parallelize", "apply_tp_plan", "tp_degrees", "STYLES"]

#: transformers' style names this module maps onto torch's styles (the rest make a model's TP layouts unavailable).
STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep",
          "embedding_rowwise")


def _style(name: str) -> ParallelStyle:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "colwise":
        return ColwiseParallel()  # input Replicate, output Shard(-1), as transformers registers it
    if name == "rowwise":
        return RowwiseParallel()  # input Shard(-1), output Replicate
    if name in ("colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(output_layouts=Replicate())
    if name in ("rowwise_split_input", "rowwise_rep", "embedding_rowwise"):
        # An embedding split by rows (vocabulary) takes replicated ids and sums the partial lookups.
        return RowwiseParallel(input_layouts=Replicate())
    raise InvalidArgumentError(f"the TP style {name!r} has no torch equivalent in memprof's plan; use one of "
                               + ", ".join(STYLES))


def tp_plan(model: nn.Module) -> "dict[str, str] | None":
    """The model's tensor-parallel plan (module pattern -> style name), or None when it has none or names a
    style memprof does not map."""
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return None
    if any(style not in STYLES for style in plan.values()):
        return None
    return dict(plan)


def tp_degrees(model: nn.Module, world_size: int) -> list[int]:
    """The tensor-parallel degrees above 1 that divide ``world_size`` and the model: its attention heads and
    key/value heads (a column split of q, k, v gives each rank whole heads), its MLP width and vocabulary."""
    config = getattr(model, "config", None)
    if tp_plan(model) is None or config is None:
        return []
    sizes = [getattr(config, n, None) for n in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                                                "vocab_size")]
    sizes = [s if s is not None else sizes[0] for s in sizes]  # no key/value heads named: as many as the heads
    known = [s for s in sizes if isinstance(s, int)]
    if len(known) < len(sizes):
        return []
    return [t for t in range(2, world_size + 1) if world_size % t == 0 and all(s % t == 0 for s in known)]


def _modules_for(model: nn.Module, pattern: str) -> list[str]:
    """The module names ``pattern`` (a ``*`` standing for one dotted component) names in ``model``."""
    regex = re.compile("^" + r"[^.]+".join(re.escape(part) for part in pattern.split("*")) + "$")
    return [name for name, _ in model.named_modules() if name and regex.match(name)]


def apply_tp_plan(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """``model``'s own TP plan (its ``tp_plan``) applied over ``tp_mesh`` with torch's styles."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan(model)
    if plan is None:
        raise InvalidArgumentError(f"{type(model).__name__} has no tensor-parallel plan memprof can apply")
    styles = {name: _style(style) for pattern, style in plan.items() for name in _modules_for(model, pattern)}
    if not styles:  # splitting nothing would simulate every rank holding the whole model, silently
        raise InvalidArgumentError(f"the tensor-parallel plan of {type(model).__name__} names no module of it "
                                   f"({', '.join(plan)}); plan it with the data-parallel layouts")
    parallelize_module(model, tp_mesh, styles)


def tp_parallelize(fsdp: bool = False, mixed: bool = False) -> "Callable[[nn.Module, DeviceMesh], nn.Module]":
    """A ``parallelize(model, mesh)`` function for :func:`memprof.estimate`: the model's own TP plan over the
    mesh's ``tp`` dimension (the whole mesh when it has one dimension), then with ``fsdp`` ``fully_shard`` of each
    decoder layer and of the root over its ``dp`` dimension, with ``mixed`` under FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
    (:func:`memprof.simulate.plan_precision.fsdp_parallelize`)."""
    from .plan_precision import fsdp_parallelize

    shard = fsdp_parallelize(mixed, "dp") if fsdp else None

    def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        names = getattr(mesh, "mesh_dim_names", None) or ()
        apply_tp_plan(model, mesh["tp"] if "tp" in names else mesh)
        if shard is not None:
            shard(model, mesh)
        return model

    return parallelize
