"""Advice: the levers that shrink the largest categories, with predicted savings.

Savings are computed from the run's own figures and the formulas in
:mod:`memprof.anatomy`; each sentence says what it assumes. Alignment
warnings follow NVIDIA's tensor-core guidance (NVIDIA Deep Learning Performance
documentation, "Matrix Multiplication Background User's Guide", Table 1):
dimensions that are multiples of 8 for fp16/bf16 and of 4 for tf32 (the table
has no bf16 row; bf16 is treated like fp16). See
``docs/anatomy.md#tensor-core-alignment``.
"""

from __future__ import annotations

from fractions import Fraction

from ...vocabulary import Category
from ...record.trace import Breakdown, ModuleRecord, Trace, parent_path
from ...units import format_bytes
from .formula import predictions
from .sharding import rank_shares, zero_stage

__all__ = ["advice", "levers"]

# bitsandbytes 8-bit Adam keeps two uint8 states: 2 B/param (HF docs, "Model training anatomy";
# bitsandbytes optim/optimizer.py Optimizer2State; docs/anatomy.md#bitsandbytes-8-bit-optimizers).
_ADAM_8BIT_BYTES_PER_PARAM = 2
# A world size for the ZeRO what-if when the user gives none.
_DEFAULT_WORLD = 8


def levers(trace: Trace, measured: Breakdown, precision: str, optimizer: "str | None",
           world_size: int = _DEFAULT_WORLD) -> list[tuple[int, str]]:
    """(predicted saving in bytes, sentence) for each applicable lever, largest saving first."""
    facts = trace.facts
    opts = predictions(trace)[1]
    out: list[tuple[int, str]] = []
    states = measured[Category.OPTIMIZER_STATES] or 0
    share = rank_share(trace)  # a sharded rank holds part of the state the formulas predict for the model
    steady_states = int(opts.state_bytes * share) if opts.state_bytes else states
    acts = measured[Category.ACTIVATIONS] or 0
    weights = measured[Category.WEIGHTS] or 0
    grads = measured[Category.GRADIENTS] or 0

    if optimizer in ("adam", "adamw") and steady_states:
        eight_bit = int(_ADAM_8BIT_BYTES_PER_PARAM * facts.num_trainable * share)
        saving = max(0, steady_states - eight_bit)
        if saving:
            per = float(steady_states / max(Fraction(1), facts.num_trainable * share))
            out.append((saving, f"8-bit AdamW (bitsandbytes) keeps 2 B/param of optimizer state instead of "
                                f"{per:.1f}: saves about {format_bytes(saving)}"))
    stage = zero_stage(trace.distributed) or 0  # what the run already shards
    if share < 1:
        stage = 3  # its parameters are sharded already: ZeRO's levers are not this rank's to pull
    if trace.distributed is not None and trace.distributed.world_size > 1:
        world_size = trace.distributed.world_size
    if steady_states and stage < 1:
        saving = steady_states - steady_states // world_size
        out.append((saving, f"ZeRO stage 1 over {world_size} ranks shards optimizer state: saves "
                            f"{format_bytes(saving)} per rank"))
    if grads and stage < 2:
        saving = grads - grads // world_size
        out.append((saving, f"ZeRO stage 2 over {world_size} ranks also shards gradients: a further "
                            f"{format_bytes(saving)} per rank"))
    if precision in ("fp32", "amp") and weights:
        # bf16 parameters: 2 B/param instead of 4 for weights, gradients and (torch) optimizer state.
        saving = weights // 2 + grads // 2 + steady_states // 2
        out.append((saving, f"bf16 parameters (weights, gradients and torch optimizer state at 2 B/element): "
                            f"saves about {format_bytes(saving)}"))
    ckpt = _checkpoint_saving(trace)
    if ckpt is not None and acts:
        saving, blocks = ckpt
        if saving > 0:
            out.append((saving, f"activation checkpointing of {blocks} keeps only their inputs (recomputing one "
                                f"block at a time in backward): saves about {format_bytes(saving)}"))
    if grads and measured is trace.peak and _grads_kept_into(trace):
        out.append((grads, f"zero_grad(set_to_none=True) frees the gradients between steps: up to "
                           f"{format_bytes(grads)} of this peak are gradients kept from the previous step"))
    impl = trace.optimizer_implementation
    if impl in ("foreach", "for-loop") and opts.transient_bytes:
        saving = int(opts.transient_bytes * share)
        out.append((saving, f"fused=True in the optimizer removes the {impl} step's temporaries "
                            f"({format_bytes(saving)} predicted)"))
    out.sort(key=lambda x: -x[0])
    return out


def rank_share(trace: Trace) -> Fraction:
    """The part of the model's optimizer state one rank holds (1 outside a sharded layout)."""
    return rank_shares(trace.distributed, trace.facts).get(Category.OPTIMIZER_STATES, Fraction(1))


def _grads_kept_into(trace: Trace) -> bool:
    """Did the peak step's forward start with gradients already allocated (set_to_none=False)?"""
    if trace.peak_step is None or trace.peak_phase is None or trace.peak_phase.value not in ("forward", "backward"):
        return False
    for p in trace.phases:
        if p.step == trace.peak_step and p.phase.value == "forward":
            return bool(p.start[Category.GRADIENTS])
    return False


def _checkpoint_saving(trace: Trace) -> "tuple[int, str] | None":
    """Saving from checkpointing the model's repeated blocks (siblings of one type, two or more)."""
    by_parent: dict[tuple[str, str], list[ModuleRecord]] = {}
    for m in trace.modules:
        if m.path == "<model>" or "." not in m.path and not m.path:
            continue
        parent = parent_path(m.path) or "<model>"
        by_parent.setdefault((parent, m.type), []).append(m)
    best = None
    for (parent, typ), mods in by_parent.items():
        if len(mods) < 2 or any(m.activations is None or m.input_bytes is None for m in mods):
            continue
        saved = sum(m.activations or 0 for m in mods)  # none is None: checked above
        kept = sum(m.input_bytes or 0 for m in mods)
        recompute = max(m.activations or 0 for m in mods)
        saving = saved - kept - recompute
        if best is None or saving > best[0]:
            best = (saving, f"the {len(mods)} {typ} blocks under {parent}")
    return best


def advice(trace: Trace, measured: Breakdown, precision: str, optimizer: "str | None") -> list[str]:
    """Sentences: the largest category and its levers, then alignment warnings."""
    out: list[str] = []
    measured_cats = [(c, v) for c, v in measured.measured().items()
                     if v and c not in (Category.ALLOCATOR_OVERHEAD, Category.OUTSIDE_TORCH)]
    if measured_cats:
        cat, value = max(measured_cats, key=lambda cv: cv[1])
        share = f" ({100 * value / measured.total:.0f}% of the total)" if measured.total else ""
        out.append(f"largest category: {cat.value}, {format_bytes(value)}{share}")
    for _saving, sentence in levers(trace, measured, precision, optimizer)[:4]:
        out.append(sentence)
    out.extend(alignment(trace, precision))
    return out


def alignment(trace: Trace, precision: str) -> list[str]:
    """Dimensions and batch size that are not multiples of 8 (16-bit) or 4 (tf32), for runs on (or
    simulated for) a GPU; a CPU has no tensor cores, so CPU runs get none."""
    if trace.device.type != "cuda" and trace.device.rounding <= 1:
        return []
    sixteen = precision in ("bf16", "fp16", "amp", "mixed")
    multiple = 8 if sixteen else 4
    kind = "fp16/bf16 tensor cores want multiples of 8" if sixteen else "tf32 tensor cores want multiples of 4"
    bad = [(path, attr, v) for path, attr, v in trace.facts.dims if v % multiple]
    out = []
    if bad:
        shown = ", ".join(f"{p}.{a}={v}" for p, a, v in bad[:6]) + (" ..." if len(bad) > 6 else "")
        out.append(f"{len(bad)} dimension(s) not divisible by {multiple} ({kind}; on GPUs): {shown}")
    b = trace.facts.batch_size
    if b is not None and b % multiple:
        out.append(f"batch size {b} is not a multiple of {multiple} ({kind})")
    return out
