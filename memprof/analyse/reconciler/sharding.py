"""The formula side of a sharded rank, and the causes of its gaps.

ZeRO (Rajbhandari et al. 2020, §5.1, Table I) gives each data-parallel rank ``1/N`` of what it shards:
stage 1 the optimizer states, stage 2 also the gradients, stage 3 also the parameters. FSDP (``fully_shard``
and FSDP1's FULL_SHARD) is stage 3: Zhao et al. 2023, "PyTorch FSDP", §3.2. The formula is Table I's at the
rank's real world size over the model's parameter count; what a real rank holds beyond it is named:

- the padding FSDP adds so that every parameter's dim 0 divides by the world size (each rank stores
  ``ceil(rows / N)`` rows of every parameter: ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``);
- the full parameters it gathers for the module(s) running (forward, and backward's recomputation of them);
- the gradients autograd produced for them before their reduce-scatter;
- per-parameter scalars an optimizer keeps whole on every rank (Adam's ``step``).
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

from ...vocabulary import Category, Phase
from ...units import round_half_away
from ...anatomy.zero import STAGES

if TYPE_CHECKING:
    from ...record.parts import ModelFacts, RankInfo
    from .context import Context

__all__ = ["zero_stage", "rank_shares", "shard_formula", "sharding_gaps"]

W, G, O, T = Category.WEIGHTS, Category.GRADIENTS, Category.OPTIMIZER_STATES, Category.TEMPORARIES



def zero_stage(dist: "RankInfo | None") -> "int | None":
    """What the rank shards, as a ZeRO stage (0: nothing, DDP); None where memprof cannot tell."""
    if dist is None or dist.layout is None:
        return None
    return STAGES.get(dist.layout)


def rank_shares(dist: "RankInfo | None", facts: "ModelFacts | None" = None) -> "dict[Category, Fraction]":
    """The part of each model state a rank holds, for the categories its layout shards (the optimizer step's
    temporaries go with the state they work on); empty when it shards nothing.

    Every parameter cut into the same number of shards (FSDP: the world size; HSDP: its shard dimension):
    Table I at that count. Otherwise, a measured run whose parameters are DTensors says how much of each this
    rank holds (``dist.params_per_rank``: tensor parallelism, parameters left whole): that share. Otherwise
    ZeRO's Table I at the world size.
    """
    if dist is None:
        return {}
    if dist.shards is not None and dist.shards > 1:
        return dict.fromkeys((W, G, O, T), Fraction(1, dist.shards))
    if dist.params_per_rank is not None and facts is not None and facts.num_params:
        out = {W: Fraction(dist.params_per_rank, facts.num_params)}
        if facts.num_trainable:
            out.update(dict.fromkeys((G, O, T), Fraction(dist.trainable_per_rank or 0, facts.num_trainable)))
        return out
    stage = zero_stage(dist)
    if not stage:
        return {}
    sharded = (O, T) if stage == 1 else (G, O, T) if stage == 2 else (W, G, O, T)
    return dict.fromkeys(sharded, Fraction(1, dist.world_size))


def shard_formula(values: dict[Category, int | None], dist: "RankInfo", facts: "ModelFacts | None" = None) -> None:
    """The rank's part (:func:`rank_shares`) of what its layout shards, in place."""
    for cat, share in rank_shares(dist, facts).items():
        value = values.get(cat)
        if value is not None:
            values[cat] = round_half_away(value * share)


def sharding_gaps(ctx: "Context", k: "Fraction | None") -> "list[tuple[Category, str, int, str]]":
    """The named parts of a sharded rank's gaps, as (category, name, bytes, sentence); ``k``: the optimizer's
    state bytes per parameter (None: no optimizer cause)."""
    trace = ctx.trace
    dist = trace.distributed
    if dist is None or len(trace.param_dtypes) != 1 or (dist.params_per_rank is None and not zero_stage(dist)):
        return []
    itemsize = _ITEMSIZE.get(trace.param_dtypes[0])
    w, g, o = ctx.pair(W), ctx.pair(G), ctx.pair(O)
    if itemsize is None or w is None:
        return []
    mw = w[0]
    # The optimizer state where both sides hold some (a formula or measurement of 0 names no cause).
    state = o if o is not None and o[1] and o[0] else None
    out: list[tuple[Category, str, int, str]] = []
    if dist.sharded_bytes is None:  # sharded by placements (tensor parallelism) or a ZeRO stage: no padding
        return out + _step_counters(ctx, state[0] - state[1] if state is not None else 0)
    # FSDP stores every parameter padded to a multiple of the shard count: what it holds beyond an even split.
    pad = max(0, dist.sharded_bytes - (dist.even_bytes if dist.even_bytes is not None else dist.sharded_bytes))
    at_rest = trace.facts.weight_bytes  # every parameter as the rank keeps it between steps
    if pad and mw >= at_rest:
        out.append((W, "padding to the world size", pad,
                    "FSDP1 pads each unit's flat parameter to a multiple of the number of shards; every rank stores "
                    "ceil(elements / shards) of each" if dist.layout == "fsdp1" else
                    "FSDP pads each parameter's first dimension to a multiple of the number of shards; every rank "
                    "stores ceil(rows / shards) rows of each"))
    gathered = mw - at_rest
    if gathered > 0:
        out.append((W, "unsharded parameters", gathered,
                    "full parameters all-gathered for the module(s) running at this moment; FSDP frees them "
                    "after the module's forward (reshard_after_forward) and gathers them again in backward"))
    if g is not None and g[0] > g[1]:
        mg, fg = g
        gpad = min(mg - fg, pad)  # the reduce-scatter's padded shards, at most the parameters' padding
        if ctx.phase in (Phase.OPTIMIZER, Phase.OTHER) and gpad:
            out.append((G, "padding to the world size", gpad,
                        "the reduce-scatter gives every rank a padded shard of each gradient"))
        elif ctx.phase is Phase.BACKWARD and mg - fg - gpad > 0:
            out.append((G, "unsharded gradients", mg - fg - gpad,
                        "gradients of the gathered parameters, held until FSDP reduce-scatters them"))
    if state is not None and k is not None and dist.even_bytes is not None:
        # Optimizer state is made like its parameter's local shard (zeros_like): real rows, no padding. With
        # rows that do not divide, lower ranks hold one row more of a parameter than higher ones. FSDP1's
        # parameter is the flat shard itself, padding included: its state is too.
        flat = dist.layout == "fsdp1"
        own = dist.sharded_bytes - (0 if flat else (dist.padding_bytes or 0))
        uneven = round_half_away(Fraction(own - dist.even_bytes, itemsize) * k)
        if uneven:
            out.append((O, "uneven shards", uneven,
                        "FSDP1 makes the state like the rank's flat shard, padding included: every rank holds "
                        "ceil(elements / shards) of each unit" if flat else
                        "this rank's real rows differ from an even share: the first ranks hold ceil(rows / shards) "
                        "rows of a parameter, the last ones fewer"))
        out += _step_counters(ctx, state[0] - state[1] - uneven)
    return out


def _step_counters(ctx: "Context", rest: int) -> "list[tuple[Category, str, int, str]]":
    # Per-parameter scalars (Adam's 4-byte step, one per parameter tensor) are whole on every rank: the formula
    # shared them out. Named only within that bound (8 bytes a tensor); anything else stays unexplained.
    if 0 < rest <= 8 * ctx.trace.facts.trainable_tensors:
        return [(O, "unsharded step counters", rest,
                 "scalars the optimizer keeps per parameter tensor (Adam's step) exist whole on every rank; the "
                 "formula divided them among the ranks too")]
    return []


_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
