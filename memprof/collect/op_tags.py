"""What some ops' outputs are, beyond their category: the tags the reconciler's causes read (dropout masks, norm
statistics, attention's log-sum-exp, autocast's weight copies and fp32 outputs), and the collectives' buffers, which
are communication. :class:`~memprof.collect.dispatch.StorageTracker` applies :data:`TAG_RULES` to each op it sees,
found by the op once (``dispatch._op_info``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import torch

from .autocast_state import emulated_autocast_dtype
from .ledger import COMMUNICATION, INPUTS, TAGS, TEMPORARIES, WEIGHTS
from .moves import move

if TYPE_CHECKING:
    from .aliases import Op
    from .ledger import Entry, Ledger

__all__ = ["TAG_RULES", "TagRule", "COLLECTIVE_NAMESPACES", "autocast_dtype", "communication", "op_named"]


class StorageTracker(Protocol):
    """What the rules read and call of :class:`memprof.collect.dispatch.StorageTracker` (named here, not imported:
    the tracker applies the rules)."""

    ledger: "Ledger"
    device: torch.device
    autocast_dtype: "str | None"
    after_collective: "Callable[[], None] | None"

    def tag(self, t: torch.Tensor, tag: int) -> None: ...

    def entry_of(self, t: torch.Tensor) -> "Entry | None": ...

    def add_tensor(self, t: torch.Tensor, cat: int) -> "Entry | None": ...


_aten = torch.ops.aten
_TAG = {name: i for i, name in enumerate(TAGS)}
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def op_named(name: str, overload: str = "default") -> "Op | None":
    """aten's ``name.overload``, or None where this torch has no such op (it then simply gets no rule)."""
    packet = getattr(_aten, name, None)
    return getattr(packet, overload, None) if packet is not None else None


def autocast_dtype(device: torch.device) -> "torch.dtype | None":
    """The dtype autocast casts to for ops on ``device`` now, or ``None`` outside autocast; a simulation's
    emulated CUDA autocast (memprof.collect.autocast_state) counts too."""
    dev = device.type if device.type in ("cpu", "cuda") else None
    if dev is not None and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return emulated_autocast_dtype()


#: A rule: the tracker, the op, its arguments and its output (the op's own values, untyped by torch).
TagRule = Callable[["StorageTracker", "Op", "tuple[object, ...]", object], None]


def _tag_outputs(indices: tuple[int, ...], tag: str) -> "TagRule":
    def rule(storages: StorageTracker, func: "Op", args: "tuple[object, ...]", out: object) -> None:
        if isinstance(out, (tuple, list)):
            for i in indices:
                if i < len(out) and isinstance(out[i], torch.Tensor):
                    storages.tag(out[i], _TAG[tag])
    return rule


def _tag_dropout_inplace(storages: StorageTracker, func: "Op", args: "tuple[object, ...]", out: object) -> None:
    # F.dropout's CPU path: empty_like -> bernoulli_ -> div_ -> mul; the mask is bernoulli_'s target.
    if args and isinstance(args[0], torch.Tensor):
        size = args[0].element_size()
        storages.tag(args[0], _TAG["dropout_mask_4byte" if size >= 4 else "dropout_mask_2byte" if size == 2
                                    else "dropout_mask"])


def _tag_weight_cast(storages: StorageTracker, func: "Op", args: "tuple[object, ...]", out: object) -> None:
    # autocast casts an fp32 parameter to 16 bits with _to_copy.
    if isinstance(out, torch.Tensor) and out.dtype in _LOW_PRECISION and args and isinstance(args[0], torch.Tensor):
        entry = storages.entry_of(args[0])
        if entry is not None and entry.cat == WEIGHTS:
            storages.tag(out, _TAG["autocast_weight_copy"])


def _tag_fp32_under_autocast(index: "int | None") -> "TagRule":
    def rule(storages: StorageTracker, func: "Op", args: "tuple[object, ...]", out: object) -> None:
        if storages.autocast_dtype not in ("bfloat16", "float16"):
            return
        t = out[index] if index is not None and isinstance(out, (tuple, list)) else out
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and autocast_dtype(storages.device) is not None:
            storages.tag(t, _TAG["autocast_fp32_output"])
    return rule


# torch.distributed's collectives (c10d: DDP's allreduce of its buckets, FSDP's all-gather and reduce-scatter;
# _c10d_functional: the traceable collectives torch.compile and DTensor use).
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional"})


def communication(storages: StorageTracker, func: "Op", args: "tuple[object, ...]", out: object) -> None:
    # What a collective is handed and gives back is a communication buffer, unless it is a model state
    # (gradient_as_bucket_view makes the gradients the buckets; FSDP reduce-scatters into gradients).
    led = storages.ledger
    # In-place collectives (c10d: DDP's allreduce_ of its buckets) work in the buffers they are handed;
    # functional ones (_c10d_functional) return new buffers and only read their inputs.
    for t in _flat_tensors(out if func.namespace == "_c10d_functional" else (args, out)):
        entry = storages.entry_of(t)
        if entry is None:
            storages.add_tensor(t, COMMUNICATION)
        elif entry.cat in (TEMPORARIES, INPUTS):
            # Made for this collective (FSDP's staging buffers are filled before it runs): it was one at a
            # peak reached while it was being filled, too.
            move(led, entry, COMMUNICATION, retro=True)
    after = storages.after_collective
    if after is not None:
        # FSDP2 stores a group's sharded gradients after its reduce-scatter; by the next collective they are there.
        after()


def _flat_tensors(obj: object, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)) and depth < 3:
        for o in obj:
            yield from _flat_tensors(o, depth + 1)


def _both(*rules: "TagRule") -> "TagRule":
    def rule(storages: StorageTracker, func: "Op", args: "tuple[object, ...]", out: object) -> None:
        for r in rules:
            r(storages, func, args, out)
    return rule


_NORM = _tag_outputs((1, 2), "norm_statistics")
_LSE = _tag_outputs((1,), "attention_logsumexp")
TAG_RULES: "dict[Op, TagRule]" = {
    k: v for k, v in {
        op_named("_to_copy"): _tag_weight_cast,
        op_named("native_dropout"): _tag_outputs((1,), "dropout_mask"),
        op_named("bernoulli_", "float"): _tag_dropout_inplace,
        op_named("bernoulli_", "Tensor"): _tag_dropout_inplace,
        op_named("native_layer_norm"): _both(_NORM, _tag_fp32_under_autocast(0)),
        op_named("native_batch_norm"): _NORM,
        op_named("_native_batch_norm_legit"): _NORM,
        op_named("_native_batch_norm_legit", "no_stats"): _NORM,
        op_named("native_group_norm"): _NORM,
        op_named("_fused_rms_norm"): _tag_outputs((1,), "norm_statistics"),
        op_named("_scaled_dot_product_flash_attention_for_cpu"): _LSE,
        op_named("_scaled_dot_product_flash_attention"): _LSE,
        op_named("_scaled_dot_product_efficient_attention"): _LSE,
        op_named("_scaled_dot_product_cudnn_attention"): _LSE,
        op_named("_softmax"): _tag_fp32_under_autocast(None),
        op_named("_log_softmax"): _tag_fp32_under_autocast(None),
    }.items() if k is not None
}
