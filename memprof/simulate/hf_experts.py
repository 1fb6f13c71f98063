"""Expert-parallel layouts of a transformers mixture-of-experts model for the plan: its own EP plan under FSDP2.

A transformers MoE names how its experts split over expert-parallel ranks in its config's
``base_model_ep_plan`` (Qwen3-MoE, Mixtral, ...: ``{"layers.*.mlp.experts.gate_up_proj": "grouped_gemm", ...,
"layers.*.mlp.experts": "ep_dispatch_experts"}``), applied by ``transformers.distributed.expert_parallel``'s
``apply_expert_parallelism``: the stacked expert weights ``Shard(0)`` over the EP ranks (``E / EP`` whole experts
each), and the experts module's forward dispatching its tokens to their experts' ranks with all-to-alls whose
split sizes are per-expert counts exchanged first (GShard, Lepikhin et al. 2020, §2.2). :func:`ep_fsdp` applies
that plan, then FSDP2 as torchtitan lays it out when EP borrows ranks from FSDP
(``torchtitan/models/llama4/infra/parallelize.py``, ``apply_fsdp``): ``fully_shard`` of each MoE layer's experts
over the ``dp`` ranks that hold the same experts (``W / EP``), then of every decoder layer and the root over all
``W`` ranks, so the router, attention and embeddings are sharded ``W`` ways and the experts ``W`` ways as well
(``EP`` by expert, ``W / EP`` by FSDP). Every rank takes its own batch.

What a rank's experts receive is data: shape-only tensors cannot route, so the plan's EP rows run memprof's routing
assumption (``balanced``: every router call's top-k spread evenly over the experts, every EP rank routing alike;
:mod:`memprof.simulate.routing` and :mod:`memprof.simulate.experts`), and their notes say so.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Callable, TypedDict

from ..errors import InvalidArgumentError, is_interrupt

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from .aliases import HfModule

    class _Sharding(TypedDict, total=False):
        """The keyword arguments of ``fully_shard`` given to every unit."""

        mp_policy: MixedPrecisionPolicy

__all__ = ["ep_plan", "ep_support", "ep_degrees", "ep_fsdp"]


def ep_support(model: nn.Module) -> "tuple[bool, str]":
    """Whether the plan can split ``model``'s experts, and why not."""
    name = type(model).__name__
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None)
    if not isinstance(plan, dict) or not plan:
        return False, f"{name} has no expert-parallel plan (its config's base_model_ep_plan)"
    try:
        from transformers.distributed.expert_parallel import apply_expert_parallelism  # noqa: F401
    except ImportError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return False, "this transformers has no transformers.distributed.expert_parallel (upgrade transformers)"
    if not _experts_modules(model):
        return False, f"the expert-parallel plan of {name} names no experts module of it ({', '.join(plan)})"
    return True, ""


def ep_plan(model: HfModule) -> "dict[str, str]":
    """``model``'s expert-parallel plan with its wildcards expanded, in the model's own names (the base model's
    prefix added): a parameter or module name -> its style."""
    plan = getattr(model.config, "base_model_ep_plan", None) or {}
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters()]
    out = {}
    for pattern, style in plan.items():
        regex = re.compile("^" + r"[^.]+".join(re.escape(part) for part in (prefix + pattern).split("*")) + "$")
        out.update({n: style for n in names if regex.match(n)})
    return out


def _experts_modules(model: nn.Module) -> list[str]:
    """The experts modules the plan dispatches to (style ``ep_dispatch_experts``)."""
    return [n for n, style in ep_plan(model).items() if style == "ep_dispatch_experts"]


def ep_degrees(model: nn.Module, world_size: int) -> list[int]:
    """The expert-parallel degrees above 1 that divide ``world_size`` and every MoE layer's experts (whole
    experts on each rank)."""
    if not ep_support(model)[0]:
        return []
    found = {_experts_count(model.get_submodule(n)) for n in _experts_modules(model)}
    counts = {c for c in found if c is not None}
    if len(counts) < len(found) or not counts:  # a layer whose experts cannot be counted, or none
        return []
    return [e for e in range(2, world_size + 1) if world_size % e == 0 and all(c % e == 0 for c in counts)]


def _experts_count(module: nn.Module) -> "int | None":
    count = getattr(module, "num_experts", None)
    if isinstance(count, int):
        return count
    first = next(iter(module.parameters(recurse=False)), None)
    return int(first.shape[0]) if first is not None and first.dim() >= 1 else None


def ep_fsdp(mixed: bool = False) -> "Callable[[nn.Module, DeviceMesh], nn.Module]":
    """A ``parallelize(model, mesh)`` function for :func:`memprof.estimate` on a mesh ``{"dp": D, "ep": EP,
    "tp": 1}``: the model's own expert-parallel plan over ``ep`` (the size-1 ``tp`` is transformers' group of
    ranks holding the same batch: none here), then ``fully_shard`` of each experts module over ``dp`` and of every
    decoder layer and the root over all the ranks (the module's docstring), with ``mixed`` under FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``."""

    def parallelize(model: HfModule, mesh: DeviceMesh) -> HfModule:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        from .depth import find_stack
        from .plan_precision import policy

        plan = ep_plan(model)
        if not plan:
            raise InvalidArgumentError(f"{type(model).__name__} has no expert-parallel plan memprof can apply")
        apply_expert_parallelism(model, mesh["ep"], mesh["tp"], plan)
        options: _Sharding = {"mp_policy": policy()} if mixed else {}
        # Every rank, one dimension: the dense parameters' FSDP group (torchtitan flattens its mesh's dims for it).
        every = DeviceMesh(mesh.device_type, mesh.mesh.flatten(), mesh_dim_names=("fsdp",))
        for name in _experts_modules(model):
            fully_shard(model.get_submodule(name), mesh=mesh["dp"], **options)
        found = find_stack(model)
        if found is not None:
            for layer in model.get_submodule(found[0]):
                fully_shard(layer, mesh=every, **options)
        fully_shard(model, mesh=every, **options)
        return model

    return parallelize
