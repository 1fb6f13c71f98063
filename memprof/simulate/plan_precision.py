"""The precisions a plan's rows are planned in, and FSDP2's mixed-precision policy as a row of its own.

"Mixed precision" names two different runs. One keeps fp32 parameters and runs the forward and the loss under
bf16 ``torch.autocast`` (HF's mixed precision, DDP's and DeepSpeed's usual one). The other is FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32 sharded parameters, gradients and optimizer
states, each unit's parameters all-gathered *in bf16* (the fp32 shard cast before the gather) so the forward and
backward run in bf16 with no autocast, and the gradients reduce-scattered in fp32 into the fp32 shards
(``torch/distributed/fsdp/_fully_shard/_fsdp_api.py``, ``MixedPrecisionPolicy``). That is torchtitan's default
(``mixed_precision_param = "bfloat16"``, ``mixed_precision_reduce = "float32"``), and it holds neither autocast's
casts saved for backward nor fp32 gathered units. A plan names them apart: ``autocast`` and ``bf16-params``;
``mixed`` asks for the one a layout's users run, ``bf16-params`` where the layout has FSDP2 to carry the policy,
``autocast`` elsewhere.

A ``bf16-params`` row runs the layout's own ``fully_shard`` calls with that policy (:func:`fsdp_parallelize`,
and :func:`policy` for the layouts that build their own), on torch's fake process group as
:func:`memprof.estimate` runs every ``parallelize=`` function: FSDP2's code casts, gathers and reduces, nothing
is modelled on the side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, TypedDict, cast

from ..errors import UnknownNameError

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["POLICY", "AUTOCAST", "MEANINGS", "policy", "fsdp_parallelize", "row_precision", "estimate_precision",
           "check_precisions", "precision_note"]

#: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` over fp32 parameters, no autocast.
POLICY = "bf16-params"
#: fp32 parameters, the forward and the loss under bf16 autocast.
AUTOCAST = "autocast"

#: What each precision a plan takes is, in the words its notes use.
MEANINGS = {
    "bf16": "bf16 parameters, gradients and optimizer states",
    "fp16": "fp16 parameters, gradients and optimizer states",
    "fp32": "fp32 parameters, gradients and optimizer states",
    POLICY: "FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 sharded parameters, gradients "
            "and optimizer states, each unit gathered in bf16 and its gradients reduce-scattered in fp32, no autocast "
            "(torchtitan's default); layouts with FSDP2 only",
    AUTOCAST: "fp32 parameters, gradients and optimizer states, the forward and the loss under bf16 torch.autocast",
    "mixed-fp16": "fp32 parameters, the forward and the loss under fp16 torch.autocast, a GradScaler around each step",
}

#: Older spellings: ``mixed`` is resolved per layout (:func:`row_precision`), ``amp`` is autocast.
ALIASES = {"mixed": f"{POLICY} on a layout with FSDP2, {AUTOCAST} on the others", "amp": AUTOCAST}


def check_precisions(precisions: "str | Iterable[str]") -> list[str]:
    """``precisions`` as a list of names a plan takes, refusing an unknown one before anything is simulated."""
    names = [precisions] if isinstance(precisions, str) else list(precisions)
    for name in names:
        if not isinstance(name, str) or name not in MEANINGS and name not in ALIASES:
            raise UnknownNameError(f"unknown precision {name!r} for a plan; use "
                                   + ", ".join([*MEANINGS, *(f"{k} ({v})" for k, v in ALIASES.items())]))
    if not names:
        raise UnknownNameError("a plan needs at least one precision; use " + ", ".join(MEANINGS))
    return names


def row_precision(asked: str, has_policy: bool, planned: "tuple[str, ...] | None") -> "str | None":
    """The precision a layout's row is planned in when ``asked`` is asked for: ``mixed`` is ``bf16-params`` where the
    layout carries FSDP2's policy (``has_policy``) and ``autocast`` elsewhere, ``amp`` is ``autocast``; None where
    the layout cannot be planned in it (``bf16-params`` without FSDP2, or a name outside ``planned``, the layout's
    precisions when it limits them)."""
    name = (POLICY if has_policy else AUTOCAST) if asked == "mixed" else ALIASES.get(asked, asked)
    if name == POLICY and not has_policy:
        return None
    if planned is not None and name not in planned:
        return None
    return name


def estimate_precision(row: str) -> str:
    """The ``precision=`` of :func:`memprof.estimate` for a row: ``bf16-params`` keeps fp32 parameters and runs no
    autocast (the policy casts), ``autocast`` is ``mixed``."""
    return {POLICY: "fp32", AUTOCAST: "mixed"}.get(row, row)


def precision_note(rows: "list[str]") -> str:
    """What each precision of a plan's rows is, said once."""
    seen = list(dict.fromkeys(rows))
    return "precisions: " + "; ".join(f"{name}: {MEANINGS.get(name, name)}" for name in seen)


def policy() -> "MixedPrecisionPolicy":
    """FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, torchtitan's default."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class _ShardOptions(TypedDict, total=False):
    """The keywords :func:`fsdp_parallelize` hands ``fully_shard``."""

    mesh: "DeviceMesh"
    mp_policy: "MixedPrecisionPolicy"


def fsdp_parallelize(mixed: bool = True, dim: "str | None" = None
                     ) -> "Callable[[nn.Module, DeviceMesh], nn.Module]":
    """A ``parallelize(model, mesh)`` function for :func:`memprof.estimate`: ``fully_shard`` of every block of the
    model's repeated stack (:func:`memprof.simulate.depth.find_stack`: a transformer's decoder layers), then of the
    root, over the mesh (its ``dim`` dimension when given), with :func:`policy` when ``mixed``; FSDP2's defaults
    otherwise (``reshard_after_forward=True``; the root keeps its parameters gathered from its forward to its
    backward). The units are those of the plan's ``fsdp`` layout."""

    def parallelize(model: "nn.Module", mesh: "DeviceMesh") -> "nn.Module":
        from torch.distributed.fsdp import fully_shard

        from .depth import find_stack

        options: _ShardOptions = {"mesh": mesh if dim is None else mesh[dim]}
        if mixed:
            options["mp_policy"] = policy()
        found = find_stack(model)
        if found is not None:
            stack = cast("nn.ModuleList | nn.Sequential", model.get_submodule(found[0]))  # find_stack's kinds
            for block in stack:
                fully_shard(block, **options)
        fully_shard(model, **options)
        return model

    return parallelize
