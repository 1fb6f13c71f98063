"""Named causes: each gap between formula and measurement split into reasons with bytes.

A cause is a small function of a :class:`Context` (the trace, the moment,
the measured and formula breakdowns) that returns the causes it names, each
with its bytes (signed, as they add to measured minus formula) and one
sentence. :data:`CAUSES` is the table, in the order the report lists them;
each function can be tested on a hand-built Trace. Whatever no cause names is
shown as "unexplained" by the reconciliation.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Callable

from ...errors import is_interrupt
from ...anatomy.allocator import CUDA_CONTEXT_RANGE
from ...vocabulary import TENSOR_CATEGORIES, Category, Phase
from ...record.trace import PhaseRecord, Trace, parent_path
from ...units import format_bytes
from .context import Cause, Context
from .sharding import sharding_gaps

__all__ = ["Cause", "Context", "CAUSES", "NO_PERSISTENT_COPY", "causes"]

W, G, O, A, T = (Category.WEIGHTS, Category.GRADIENTS, Category.OPTIMIZER_STATES, Category.ACTIVATIONS,
                 Category.TEMPORARIES)


# ---------------------------------------------------------------------- model states


#: The cause that separates HF's mixed precision (a persistent 16-bit copy of every weight) from torch.autocast
#: (none): one name and sentence wherever it is shown (a reconciliation with precision="mixed", the textbook line
#: of every table, :mod:`.textbook`).
NO_PERSISTENT_COPY = ("no persistent 16-bit copy",
                      "HF's mixed precision counts a 16-bit copy of each weight (2 B/param); torch.autocast "
                      "casts per use instead, and the casts saved for backward appear among activations "
                      "(autocast weight copies)")


def no_persistent_16bit_copy(ctx: Context) -> list[Cause]:
    w = ctx.pair(W)
    # HF's "mixed precision" keeps a 16-bit copy of every weight; torch.autocast does not.
    if ctx.precision == "mixed" and w is not None and w[0] < w[1]:
        mw, fw = w
        return [Cause(W, NO_PERSISTENT_COPY[0], -min(fw - mw, 2 * ctx.trace.facts.num_params),
                      NO_PERSISTENT_COPY[1])]
    return []


def sharded_rank(ctx: Context) -> list[Cause]:
    """A rank of FSDP / ZeRO-3: padding, gathered parameters, uneven shards (memprof.analyse.reconciler.sharding)."""
    from ...anatomy.params import bytes_per_param_breakdown
    from .formula import optimizer_name

    k = None
    name = ctx.optimizer if ctx.optimizer is not None else optimizer_name(ctx.trace)
    if name is not None:
        try:
            k = Fraction(bytes_per_param_breakdown(ctx.precision, name).optimizer_states).limit_denominator(1000)
        except Exception as failure:  # an optimizer without a bytes/param row: no cause rather than a wrong one
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            k = None
    return [Cause(*gap) for gap in sharding_gaps(ctx, k)]


def gradients_missing(ctx: Context) -> list[Cause]:
    g = ctx.pair(G)
    if g is None or not g[0] < g[1]:
        return []
    mg, fg = g
    if mg == 0 and ctx.phase in (Phase.FORWARD, Phase.OTHER):
        return [Cause(G, "gradients not allocated", -fg,
                      "zero_grad(set_to_none=True) freed the gradients and backward had not produced them "
                      "yet at this moment")]
    if ctx.phase is Phase.BACKWARD:
        what = "none of the gradients" if mg == 0 else "only part of the gradients"
        return [Cause(G, "backward in progress", mg - fg,
                      f"backward had produced {what} when the peak occurred (zero_grad(set_to_none=True) "
                      "frees them every step)")]
    return []


def lazy_optimizer_state(ctx: Context) -> list[Cause]:
    o = ctx.pair(O)
    if o is None or not o[0] < o[1]:
        return []
    mo, fo = o
    first_opt = next((p for p in ctx.trace.phases if p.phase is Phase.OPTIMIZER), None)
    before_first = first_opt is None or (ctx.rec is not None and (ctx.rec.step, _order(ctx.rec)) <
                                         (first_opt.step, _order(first_opt)))
    if mo == 0 and before_first:
        return [Cause(O, "state created lazily", -fo,
                      "torch optimizers create their state inside the first step(); this moment came before it")]
    if ctx.phase is Phase.OPTIMIZER and ctx.rec is not None and ctx.rec.step == (first_opt.step if first_opt else -1):
        return [Cause(O, "state created lazily", mo - fo,
                      "the first step() was still creating the state at this moment")]
    return []


# ---------------------------------------------------------------------- activations: the moment


def released_by_backward(ctx: Context) -> list[Cause]:
    fwd = ctx.forward
    m = ctx.measured
    # What checkpointed regions saved when backward recomputed them is new, not the forward's: apart.
    now = (m[A] or 0) - ctx.tags.get("recomputed_for_backward", 0)
    saved = fwd.end[A] if fwd is not None else None
    if saved is not None and ctx.both(A) and now < saved:
        return [Cause(A, "released by backward", now - saved,
                      "backward frees each saved tensor once its node has run; at this moment it had "
                      "released this much of what the forward saved")]
    return []


def autocast_weight_copies(ctx: Context) -> list[Cause]:
    wcopy = ctx.activation_tags.get("autocast_weight_copy", 0)
    if wcopy and ctx.both(A):
        return [Cause(A, "autocast weight copies", wcopy,
                      "torch.autocast's 16-bit casts of the weights are saved for backward by the matmuls "
                      "(2 B per parameter used under autocast)")]
    return []


# ---------------------------------------------------------------------- activations: Korthikanti's form


def korthikanti_assumptions(ctx: Context) -> list[Cause]:
    """Korthikanti et al. assume 1-byte masks and 16-bit activations and ignore norm statistics."""
    if ctx.transformer is None or not ctx.both(A):
        return []
    tag = ctx.activation_tags
    out = []
    stats = tag.get("norm_statistics", 0)
    if stats:
        out.append(Cause(A, "normalisation statistics", stats,
                         "mean and rstd kept by layer/RMS/batch norms, which Korthikanti et al. ignore"))
    wide4, wide2 = tag.get("dropout_mask_4byte", 0), tag.get("dropout_mask_2byte", 0)
    if wide4 or wide2:
        out.append(Cause(A, "dropout masks in the input dtype", wide4 * 3 // 4 + wide2 // 2,
                         "this dropout path keeps its mask in the input dtype (CPU: bernoulli_ noise), "
                         "not as the 1-byte masks CUDA's native_dropout keeps"))
    fp32 = tag.get("autocast_fp32_output", 0)
    if fp32:
        out.append(Cause(A, "ops autocast runs in fp32", fp32 // 2,
                         "softmax, layer_norm and log_softmax run in fp32 under autocast, so their saved "
                         "outputs take 4 bytes per element instead of 2"))
    lse = tag.get("attention_logsumexp", 0)
    if lse and ctx.transformer.get("attention", "eager") != "flash":
        out.append(Cause(A, "attention logsumexp", lse,
                         "fused attention keeps an fp32 logsumexp per head and position"))
    return out


def outside_transformer_layers(ctx: Context) -> list[Cause]:
    if ctx.transformer is None or not ctx.both(A) or ctx.phase not in (Phase.FORWARD, Phase.BACKWARD):
        return []
    layers = repeated_block_activations(ctx.trace)
    forwards = [p for p in ctx.trace.phases if p.phase is Phase.FORWARD]
    fwd_end = forwards[-1].end[A] if forwards else None
    if layers is not None and fwd_end is not None and fwd_end > layers:
        return [Cause(A, "outside the transformer layers", fwd_end - layers,
                      "embeddings, final norm, LM head and loss save tensors too; the per-layer formula "
                      "covers the layers only (measured at the end of the last forward)")]
    return []


# ---------------------------------------------------------------------- activations: the per-module rules


# Where the rules of the modules that saved a storage count more or less than the storage:
# (tag, sign of the gap measured - formula, cause, sentence).
_RULE_VIEW_CAUSES = (
    ("saved_by_two_modules", -1, "saved by two modules",
     "one storage saved by two neighbouring modules (ReLU's output is the next Linear's input): the "
     "per-module formula counts it once for each"),
    ("saved_as_expanded_view", -1, "saved expanded views",
     "a module saved an expanded view (x[:, None].expand(...)): its rule counts the expanded size, "
     "autograd keeps only the storage under it"),
    ("saved_as_view_of_larger", 1, "saved views of larger storages",
     "modules saved views of larger tensors (x[:, 0] of a sequence): their rules count the view, memprof "
     "the storage under it, which autograd keeps whole"),
)


def per_module_rules(ctx: Context) -> list[Cause]:
    """What the per-module formula does not see, or counts differently from autograd."""
    if ctx.transformer is not None or not ctx.both(A) or ctx.activations.saved_bytes is None:
        return []
    if ctx.phase is Phase.FORWARD and ctx.rec is not None and ctx.measured is ctx.rec.start:
        return []  # a forward's start: nothing saved yet, and no per-module count to correct
    tag = ctx.activation_tags
    out = []
    functional = tag.get("saved_in_container_code", 0)
    if functional:
        out.append(Cause(A, "functional code in container modules", functional,
                         "tensors saved by torch functions called directly in a forward() that has "
                         "submodules (attention math, residual adds): per-module rules do not see them"))
    norule = tag.get("saved_in_module_without_rule", 0)
    if norule:
        out.append(Cause(A, "modules without a formula", norule,
                         "saved by module types memprof has no saved-bytes rule for ("
                         + (", ".join(ctx.activations.modules_without_rule) or "see the notes")
                         + "): measured, not predicted"))
    if ctx.phase in (Phase.FORWARD, Phase.BACKWARD):
        for tag_name, sign, name, sentence in _RULE_VIEW_CAUSES:
            amount = tag.get(tag_name, 0)
            if amount:
                out.append(Cause(A, name, sign * amount, sentence))
        model_inputs = ctx.trace.facts.activation_inputs_saved
        if model_inputs:
            out.append(Cause(A, "model inputs saved by modules", -model_inputs,
                             "the model's inputs that its modules save for backward (the first layer's "
                             "input, an embedding's indices): the per-module formula counts them as "
                             "activations, memprof as inputs"))
    return out


def activation_checkpointing(ctx: Context) -> list[Cause]:
    """torch.utils.checkpoint: what checkpointed regions would have saved, what they keep instead, and
    what their recomputation in backward holds."""
    if ctx.transformer is not None or not ctx.both(A):
        return []
    tag = ctx.activation_tags
    out = []
    skipped = ctx.activations.checkpointed_bytes
    if skipped and ctx.phase in (Phase.FORWARD, Phase.BACKWARD):
        out.append(Cause(A, "activation checkpointing: saves not kept", -skipped,
                         "modules under torch.utils.checkpoint keep nothing for backward in forward; the "
                         "per-module formula counts what they would have saved"))
    kept = tag.get("kept_by_checkpoint", 0)
    if kept:
        out.append(Cause(A, "activation checkpointing: region inputs", kept,
                         "the inputs of checkpointed regions, kept to recompute them in backward"))
    recomputed = ctx.tags.get("recomputed_for_backward", 0)  # backward's own: read at this moment
    if recomputed:
        out.append(Cause(A, "activation checkpointing: recomputed in backward", recomputed,
                         "what a checkpointed region saved when backward recomputed it, alive at this moment"))
    return out


def saved_outside_the_model(ctx: Context) -> list[Cause]:
    outside = ctx.activation_tags.get("saved_outside_modules", 0)
    if ctx.transformer is None and outside and ctx.both(A):
        return [Cause(A, "saved outside the model", outside,
                      "tensors saved by code outside the model's modules (the loss function: its "
                      "log-softmax output and targets), which no module formula covers")]
    return []


# ---------------------------------------------------------------------- temporaries, the device, the rest


def for_loop_step_bound(ctx: Context) -> list[Cause]:
    t = ctx.pair(T)
    if (ctx.phase is Phase.OPTIMIZER and t is not None and t[0] < t[1]
            and ctx.trace.optimizer_implementation == "for-loop"):
        return [Cause(T, "for-loop step is below its bound", t[0] - t[1],
                      "the for-loop step's formula is an upper bound (a few times the largest parameter); "
                      "this step needed less")]
    return []


def device_rows(ctx: Context) -> list[Cause]:
    out = []
    oh = ctx.measured[Category.ALLOCATOR_OVERHEAD]
    if oh:
        out.append(Cause(Category.ALLOCATOR_OVERHEAD, "caching allocator", oh,
                         "blocks the caching allocator keeps reserved but not allocated: rounding to 512 B, "
                         "segments of 2 or 20 MiB, and fragmentation"))
    ot = ctx.measured[Category.OUTSIDE_TORCH]
    if ot:
        lo, hi = CUDA_CONTEXT_RANGE
        out.append(Cause(Category.OUTSIDE_TORCH, "CUDA context and libraries", ot,
                         f"the CUDA context, kernels and cuBLAS/cuDNN workspaces, typically "
                         f"{format_bytes(lo)} to {format_bytes(hi)} per process"))
    return out


_NO_FORMULA = {
    Category.INPUTS: "the batch and targets handed to the model and the loss; the textbook's model-state and "
                     "activation formulas leave them out",
    Category.COMMUNICATION: "buffers handed to collectives: FSDP's all-gather and reduce-scatter staging, whose size "
                            "depends on how the model is wrapped and what is prefetched, and other collectives' "
                            "buffers",
    Category.TEMPORARIES: "op outputs nobody saved for backward and scratch memory live at this moment; the textbook "
                          "has a formula for them only inside the optimizer step",
}


def no_formula(ctx: Context) -> list[Cause]:
    """Tensor categories without a formula at this moment count in the total's gap as measured."""
    inference = ctx.phase in (Phase.PREFILL, Phase.DECODE)
    return [Cause(cat, "no formula", measured, (_DECODING if inference and cat is T else _NO_FORMULA.get(
        cat, "the textbook has no formula for this category: measured, not predicted")))
        for cat in TENSOR_CATEGORIES if ctx.formula[cat] is None and (measured := ctx.measured[cat])]


_DECODING = ("the call's logits (batch x vocabulary per position it keeps) and scratch; a cache that grows by "
             "concatenation (transformers' DynamicCache) also holds a layer's old keys and values next to the new "
             "ones for a moment")


#: The causes, in the order the reconciliation lists them.
CAUSES: tuple[Callable[[Context], list[Cause]], ...] = (
    sharded_rank,
    no_persistent_16bit_copy,
    gradients_missing,
    lazy_optimizer_state,
    released_by_backward,
    autocast_weight_copies,
    korthikanti_assumptions,
    per_module_rules,
    activation_checkpointing,
    saved_outside_the_model,
    outside_transformer_layers,
    for_loop_step_bound,
    device_rows,
    no_formula,
)


def causes(ctx: Context) -> tuple[Cause, ...]:
    """Every named cause with bytes, in table order."""
    return tuple(c for fn in CAUSES for c in fn(ctx) if c.bytes)


# ---------------------------------------------------------------------- helpers on traces


def repeated_block_activations(trace: Trace) -> "int | None":
    """Activations of the largest group of same-type siblings (the transformer layers)."""
    groups: dict[tuple[str, str], int] = {}
    counts: dict[tuple[str, str], int] = {}
    for m in trace.modules:
        if m.path == "<model>" or m.activations is None:
            continue
        key = (parent_path(m.path) or "<model>", m.type)
        groups[key] = groups.get(key, 0) + m.activations
        counts[key] = counts.get(key, 0) + 1
    best = [(v, k) for k, v in groups.items() if counts[k] >= 2]
    return max(best)[0] if best else None


def _order(rec: PhaseRecord) -> int:
    return {Phase.OTHER: 0, Phase.FORWARD: 1, Phase.PREFILL: 1, Phase.DECODE: 1, Phase.BACKWARD: 2,
            Phase.OPTIMIZER: 3}[rec.phase] * 100 + rec.occurrence
