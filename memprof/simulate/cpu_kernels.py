"""Kernels as a CPU runs them, for simulations that target the CPU on fake tensors.

A simulation for a CPU target runs every op on fake CPU tensors, whose kernels are torch's meta kernels:
each output gets a storage of exactly its shape. A few CPU kernels return outputs whose storage is not
their shape's, and memprof's exact mode counts storages: ``F.mse_loss`` with a reduction computes the
elementwise losses into a buffer, reduces it in place and returns the 0-dim loss *on that buffer*, so
the loss holds ``numel * itemsize`` bytes (131,072 B for a 4 x 64 x 128 fp32 input) where its shape says
4. :class:`CpuKernels`, a dispatch mode beneath memprof's profiler, gives each such output the storage
the CPU kernel gives it, computed from the op's arguments, before the profiler counts it.

Which ops: ``benchmarks/cpu_kernel_sweep.py`` runs every sample of torch's operator database
(``op_db``) on real and on fake CPU tensors, without gradients and forward and backward with them, and
compares the storage of every output; the ops in :data:`RULES` are the ones that differ (torch 2.13):
in bytes, or in layout where the layout makes a later op copy on one side only (``max_unpool2d``). The
sweep checks each rule against the real kernel. One more has no sample there: ``nn.LSTM``'s oneDNN
kernel, whose workspace :mod:`memprof.simulate.onednn_rnn` sizes. None depends on tensor values: each is exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .onednn_rnn import lstm_workspace_bytes
from .sparse_kernels import NOT_SPARSE, SPARSE_OPS, Args, Kwargs, SparseKernels, arg

if TYPE_CHECKING:
    from .aliases import OpValue
    from .op_chain import OpNext

__all__ = ["CpuKernels", "RULES", "SWEPT_OPINFOS", "MIXED_OPINFOS"]

_aten = torch.ops.aten
# at::Reduction (aten/src/ATen/core/Reduction.h): 0 none, 1 mean, 2 sum.
_NONE, _MEAN = 0, 1
# EmbeddingBag modes (aten/src/ATen/native/EmbeddingBag.cpp): 0 sum, 1 mean, 2 max.
_SUM, _MAX = 0, 2

#: What a rule gives for one output: its storage bytes on a real CPU, a tensor to return in its place, or None.
Storage = int | torch.Tensor | None

#: A rule: the op's arguments and its fake outputs -> for each output, the storage bytes it has on a real
#: CPU (an int, never less than the fake storage's), a tensor to return in its place (where the CPU kernel
#: returns another shape or layout), or ``None``: as the fake kernel made it.
Rule = Callable[[Args, Kwargs, Args], tuple[Storage, ...]]


def _reduced_loss(reduction_at: int, input_dtype: bool = False) -> Rule:
    """The rule of an elementwise loss whose ``reduction`` is its argument number ``reduction_at``.

    ``mse_loss``, ``smooth_l1_loss``, ``soft_margin_loss`` and ``binary_cross_entropy`` with a reduction:
    the CPU kernel writes the elementwise losses into a buffer of the broadcast shape, reduces it, and
    resizes that buffer to the 0-dim result (``resize_`` keeps the storage), so the loss holds the whole
    buffer; an empty input still leaves one element. The buffer is in the promoted dtype of input and
    target, or with ``input_dtype`` in the input's (``soft_margin_loss`` and ``binary_cross_entropy`` make
    it ``like`` the input; for a bf16 input and an fp32 target the meta kernel promotes)."""

    def rule(args: Args, kwargs: Kwargs, outs: Args) -> tuple[Storage, ...]:
        out = outs[0]
        dtype = args[0].dtype if input_dtype else out.dtype
        if arg(args, kwargs, reduction_at, "reduction", _MEAN) == _NONE:
            return (None,) if dtype == out.dtype else (torch.empty_like(out, dtype=dtype),)
        # (torch.broadcast_shapes is untyped)
        nbytes = max(torch.broadcast_shapes(args[0].shape, args[1].shape).numel(), 1) * dtype.itemsize  # type: ignore[no-untyped-call]
        if dtype == out.dtype:
            return (nbytes,)
        loss = torch.empty_like(out, dtype=dtype)
        loss.untyped_storage().resize_(nbytes)
        return (loss,)

    return rule


def _in_dtype_of(at: int, output: int = 0) -> Rule:
    """The rule of an op whose CPU kernel makes output ``output`` like its argument ``at`` (``empty_like`` or
    ``zeros_like``), in that argument's dtype, where the meta kernel promotes a 16-bit argument with an fp32
    one: ``huber_loss`` (its reduced result too), ``normal(mean, std)``, and the losses' backwards, whose
    input gradient the CPU returns in the input's dtype and the meta kernel in fp32 (autograd then casts)."""

    def rule(args: Args, kwargs: Kwargs, outs: Args) -> tuple[Storage, ...]:
        got, like = outs[output], args[at]
        fixed: list[Storage] = [None] * len(outs)
        if isinstance(got, torch.Tensor) and got.dtype != like.dtype:
            fixed[output] = torch.empty_like(got, dtype=like.dtype)
        return tuple(fixed)

    return rule


def _keeps_input_storage(args: Args, kwargs: Kwargs, outs: Args) -> tuple[Storage, ...]:
    """``im2col`` and ``col2im`` (``F.unfold``, ``F.fold`` and their backwards): the CPU kernel makes its
    output with ``empty_like(input)`` and resizes it to the output shape, which grows the storage but
    never shrinks it."""
    out = outs[0]
    return (max(args[0].numel(), out.numel()) * out.element_size(),)


def _embedding_bag(forward_only: bool) -> Rule:
    """The rule of ``_embedding_bag`` (``forward_only=False``) or ``_embedding_bag_forward_only``.

    ``_embedding_bag`` and ``_embedding_bag_forward_only`` (``F.embedding_bag``, ``nn.EmbeddingBag``),
    whose index outputs the CPU kernel sizes by resizing (aten/src/ATen/native/EmbeddingBag.cpp):

    * ``offset2bag`` is computed at one element more than it keeps (``n + 1``, then resized to ``n``),
      except on the fast path of mode sum, where it is left empty: the fast path takes fp32, fp16 and bf16
      weights (the meta kernel leaves bf16 out);
    * ``bag_size`` is made at the length of ``offsets`` and resized to the number of bags (one less with
      ``include_last_offset``); without gradients in mode sum it keeps that length;
    * ``max_indices`` is made at ``bag_size``'s length, and resized to bags x embedding dim in mode max.

    The index dtype is that of ``indices`` and ``offsets`` promoted together."""

    def rule(args: Args, kwargs: Kwargs, outs: Args) -> tuple[Storage, ...]:
        weight, indices, offsets = args[0], args[1], args[2]
        mode = arg(args, kwargs, 4, "mode", _SUM)
        per_sample = arg(args, kwargs, 6, "per_sample_weights", None)
        last = arg(args, kwargs, 7, "include_last_offset", False)
        padding_idx = arg(args, kwargs, 8, "padding_idx", -1)
        item = torch.promote_types(indices.dtype, offsets.dtype).itemsize
        fast = (weight.dtype in (torch.float32, torch.float16, torch.bfloat16) and weight.stride(1) == 1
                and outs[0].stride(1) == 1 and padding_idx < 0
                and (per_sample is None or per_sample.stride(0) == 1))
        # The real kernel returns offset2bag empty on the fast path: so does the simulation.
        offset2bag = outs[1].new_empty((0,)) if mode == _SUM and fast else (indices.size(0) + 1) * item
        bags = offsets.size(0) - (1 if last else 0)
        kept = offsets.size(0) if forward_only and mode == _SUM else bags  # bag_size's final length
        max_indices = max(kept, bags * weight.size(1)) if mode == _MAX else kept
        return (None, offset2bag, offsets.size(0) * item, max_indices * item)

    return rule


def _sparse_mm_reduce(args: Args, kwargs: Kwargs, outs: Args) -> tuple[Storage, ...]:
    """``_sparse_mm_reduce_impl`` (``torch.sparse.mm(a, b, reduce)``): for ``amax`` and ``amin``, when a
    gradient will be asked for, the CPU kernel returns the int64 arg indices at the output's shape, where
    the meta kernel returns them empty."""
    reduce = arg(args, kwargs, 2, "reduce", "sum")
    if reduce not in ("amax", "amin") or not (torch.is_grad_enabled() and (args[0].requires_grad
                                                                          or args[1].requires_grad)):
        return (None, None)
    return (None, outs[0].numel() * torch.int64.itemsize)


def _max_unpool2d(args: Args, kwargs: Kwargs, outs: Args) -> tuple[Storage, ...]:
    """``max_unpool2d``: the CPU kernel lays its output out in the input's memory format (channels-last in,
    channels-last out), the meta kernel always contiguously; a later ``reshape`` or ``contiguous`` then
    copies in one and not in the other."""
    # torch's Python twin of Tensor::suggest_memory_format (c10/core/TensorImpl.h), which the kernel asks.
    from torch._prims_common import suggest_memory_format

    fmt = suggest_memory_format(args[0])
    if fmt == torch.contiguous_format or outs[0].is_contiguous(memory_format=fmt):
        return (None,)
    return (torch.empty_like(outs[0], memory_format=fmt),)


def _made(args: Args, kwargs: Kwargs, outs: Args) -> tuple[Storage, ...]:
    """Every output as the fake kernel made it (the base of a layout rule)."""
    return (None,) * len(outs)


#: ``mkldnn_rnn_layer``'s ``mode`` for an LSTM (ideep's ``rnn_kind::LSTM``), the only kind torch sends it.
_LSTM = 2


def _lstm_workspace(args: Args, kwargs: Kwargs, outs: Args) -> tuple[Storage, ...]:
    """``mkldnn_rnn_layer`` (``nn.LSTM`` on a CPU): with grad mode on, the CPU kernel returns the workspace oneDNN's
    training primitive asks for (:mod:`memprof.simulate.onednn_rnn`), which the meta kernel returns empty; without
    it, none. (input, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden_size, ...): the input is already
    (steps, batch, features)."""
    if not torch.is_grad_enabled() or arg(args, kwargs, 9, "mode", _LSTM) != _LSTM:
        return (None,) * len(outs)
    steps, batch, features = args[0].shape
    cell = args[6] if isinstance(args[6], torch.Tensor) else args[0]
    return (None, None, None, lstm_workspace_bytes(steps, batch, features, arg(args, kwargs, 10, "hidden_size", 0),
                                                   args[0].dtype, cell.dtype))


def _lstm_backward(args: Args, kwargs: Kwargs, outs: Args) -> tuple[Storage, ...]:
    """``mkldnn_rnn_layer_backward``: the CPU kernel returns the two bias gradients (``bias_ih``'s and
    ``bias_hh``'s, equal: oneDNN has one bias) as two tensors, the second a clone of the first; the meta kernel
    returns one tensor twice, so that a storage autograd hands to both parameters was counted once."""
    fixed: list[Storage] = [None] * len(outs)
    if len(outs) > 4 and isinstance(outs[4], torch.Tensor) and outs[4] is outs[3]:
        fixed[4] = torch.empty_like(outs[4])
    return tuple(fixed)


_LOW = (torch.bfloat16, torch.float16)


def _mixed_norm(params_at: tuple[int, ...]) -> Rule:
    """The rule of a normalisation whose parameters (weight, bias, running statistics) are its arguments
    ``params_at``: with a 16-bit input and fp32 parameters (a "mixed type" to the CPU kernels,
    aten/src/ATen/native/mixed_type.h; what CPU autocast hands BatchNorm after a bf16 convolution, and a
    model that keeps its norms in fp32 hands them all) the CPU kernel keeps the statistics it returns
    (mean and inverse deviation) in fp32, where the meta kernel keeps them in the input's dtype."""

    def rule(args: Args, kwargs: Kwargs, outs: Args) -> tuple[Storage, ...]:
        if args[0].dtype not in _LOW or not any(isinstance(args[i], torch.Tensor) and args[i].dtype == torch.float32
                                                for i in params_at if i < len(args)):
            return (None,) * len(outs)
        stats = tuple(torch.empty_like(t, dtype=torch.float32) if t.dtype in _LOW else None for t in outs[1:])
        return (None, *stats)

    return rule


def _layer_norm_backward(args: Args, kwargs: Kwargs, outs: Args) -> tuple[Storage, ...]:
    """``native_layer_norm_backward``: the CPU kernel returns the weight's and the bias's gradients in their
    dtypes; with a 16-bit input, fp32 parameters and no rows the meta kernel returns them in the input's
    dtype, and autograd then adds a cast."""
    params = (None, args[5], args[6])  # (grad_out, input, normalized_shape, mean, rstd, weight, bias, mask)
    return tuple(torch.empty_like(g, dtype=p.dtype) if isinstance(g, torch.Tensor) and isinstance(p, torch.Tensor)
                 and g.dtype != p.dtype else None for g, p in zip(outs, params))


def _first_laid_out(rule: Rule, format_of: "Callable[[Args], torch.memory_format | None]") -> Rule:
    """``rule``, with the first output laid out in the memory format ``format_of(args)`` names (None: as made)
    where the output is not laid out so already. Same bytes, another layout."""

    def laid_out(args: Args, kwargs: Kwargs, outs: Args) -> tuple[Storage, ...]:
        out = rule(args, kwargs, outs)
        first = outs[0] if outs else None
        if not isinstance(first, torch.Tensor):
            return out
        fmt = format_of(args)
        if fmt is None:
            return out
        made = out[0] if isinstance(out[0], torch.Tensor) else first
        if made.is_contiguous(memory_format=fmt):
            return out
        return (torch.empty_like(made, memory_format=fmt), *out[1:])

    return laid_out


def _contiguous_first(rule: Rule) -> Rule:
    """``rule``, with the first output laid out contiguously where the fake one is not: the CPU's layer norm
    kernels make their input contiguous and write the output (forward) or the input's gradient (backward) into a
    contiguous tensor (``layer_norm_cpu``, ``layer_norm_backward_cpu``, aten/src/ATen/native/layer_norm.cpp), where
    the meta kernels keep a non-contiguous input's layout. A later ``reshape`` then copies in the simulation only:
    Swin's backward, whose layer norms meet transposed tensors, was 8,192 B over in temporaries (a new user's
    sweep)."""
    return _first_laid_out(rule, lambda args: torch.contiguous_format)


def _in_input_format(rule: Rule, input_at: int) -> Rule:
    """``rule``, with the first output laid out in the memory format torch suggests for argument ``input_at``: the
    CPU's batch norm kernels make their output (forward) and the input's gradient (backward) with
    ``empty_like(input, input.suggest_memory_format())`` (``batch_norm_cpu``, ``batch_norm_backward_cpu``,
    aten/src/ATen/native/Normalization.cpp), contiguous unless the input is channels-last, where the meta kernels keep
    a transposed input's strides. PatchTST normalises ``x.transpose(1, 2)`` with a BatchNorm1d and transposes back:
    on the CPU the result is then not contiguous, and each Linear after it copies its input and saves the copy, which
    the simulation did not (3.8 % low; 19 % for three Linears after one such norm, a new user's sweep)."""
    from torch._prims_common import suggest_memory_format

    def suggested(args: Args) -> "torch.memory_format | None":
        given = args[input_at]
        return suggest_memory_format(given) if isinstance(given, torch.Tensor) else None

    return _first_laid_out(rule, suggested)


#: aten op -> its rule. Found by ``benchmarks/cpu_kernel_sweep.py`` (but the LSTM's); docs/accuracy.md has the table.
RULES: dict[torch._ops.OpOverload, Rule] = {
    _aten.mse_loss.default: _reduced_loss(2),  # (self, target, reduction)
    _aten.smooth_l1_loss.default: _reduced_loss(2),  # (self, target, reduction, beta)
    _aten.soft_margin_loss.default: _reduced_loss(2, input_dtype=True),  # (self, target, reduction)
    _aten.binary_cross_entropy.default: _reduced_loss(3, input_dtype=True),  # (self, target, weight, reduction)
    _aten.huber_loss.default: _in_dtype_of(0),
    _aten.normal.Tensor_Tensor: _in_dtype_of(0),  # (mean, std)
    # (grad_output, self, target, ...): the input gradient in the input's dtype
    _aten.mse_loss_backward.default: _in_dtype_of(1),
    _aten.smooth_l1_loss_backward.default: _in_dtype_of(1),
    _aten.soft_margin_loss_backward.default: _in_dtype_of(1),
    _aten.huber_loss_backward.default: _in_dtype_of(1),
    _aten.im2col.default: _keeps_input_storage,
    _aten.col2im.default: _keeps_input_storage,
    _aten._embedding_bag.default: _embedding_bag(forward_only=False),
    _aten._embedding_bag_forward_only.default: _embedding_bag(forward_only=True),
    _aten._sparse_mm_reduce_impl.default: _sparse_mm_reduce,
    _aten.max_unpool2d.default: _max_unpool2d,
    # (input, weight, bias, running_mean, running_var, ...), and the variants torch's decompositions call
    _aten.native_batch_norm.default: _in_input_format(_mixed_norm((1, 2, 3, 4)), 0),
    _aten._native_batch_norm_legit.default: _in_input_format(_mixed_norm((1, 2, 3, 4)), 0),
    _aten._native_batch_norm_legit.no_stats: _in_input_format(_mixed_norm((1, 2)), 0),
    _aten._batch_norm_with_update.default: _in_input_format(_mixed_norm((1, 2, 3, 4)), 0),
    # (grad_out, input, weight, ...): the input's gradient in the input's suggested format
    _aten.native_batch_norm_backward.default: _in_input_format(_made, 1),
    _aten.batch_norm_backward.default: _in_input_format(_made, 1),
    _aten.native_layer_norm.default: _contiguous_first(_mixed_norm((2, 3))),  # (input, normalized_shape, weight, bias,
    # eps)
    _aten.native_group_norm.default: _mixed_norm((1, 2)),  # (input, weight, bias, N, C, HxW, group, eps)
    _aten.native_group_norm_backward.default: _in_dtype_of(1),  # (grad_out, input, mean, rstd, weight, ...)
    _aten.native_layer_norm_backward.default: _contiguous_first(_layer_norm_backward),
    # Not in op_db's samples: tests/integration/test_sim_lstm.py holds them to real runs.
    _aten.mkldnn_rnn_layer.default: _lstm_workspace,
    _aten.mkldnn_rnn_layer_backward.default: _lstm_backward,
}

#: The OpInfos of torch's operator database that reach the ops in :data:`RULES`, in their own dtypes and with
#: a bf16 input among fp32 parameters (the sweep's ``--mixed``): the sweep over them checks every rule
#: (tests/integration/test_sim_cpu_kernels.py runs it).
SWEPT_OPINFOS = ("nn.functional.mse_loss", "nn.functional.smooth_l1_loss", "nn.functional.soft_margin_loss",
                 "nn.functional.binary_cross_entropy", "nn.functional.unfold", "nn.functional.embedding_bag",
                 "sparse.mm.reduce", "nn.functional.max_unpool2d")
MIXED_OPINFOS = ("nn.functional.batch_norm", "nn.functional.group_norm", "nn.functional.layer_norm",
                 "nn.functional.mse_loss", "nn.functional.soft_margin_loss", "nn.functional.huber_loss")


class CpuKernels(SparseKernels):
    """Give the outputs of the ops in :data:`RULES` the storage a CPU kernel gives them, and sparse tensors the
    elements the CPU's sparse kernels give them (:class:`~memprof.simulate.sparse_kernels.SparseKernels`, every
    rule). Entered beneath memprof's profiler (so the profiler counts the corrected storage) and above the
    fake-tensor mode; :attr:`used` counts the ops it corrected, :attr:`bytes` the bytes it added (or took off)
    for each."""

    def __init__(self) -> None:
        super().__init__(cpu=True)

    def handle(self, func: torch._ops.OpOverload, args: Args, kwargs: Kwargs, next: "OpNext") -> "OpValue":
        if func in SPARSE_OPS:
            answer = self.sparse(func, args, kwargs, next)
            if answer is not NOT_SPARSE:
                return answer
        out = next(func, args, kwargs)
        rule = RULES.get(func)
        if rule is None:
            if type(out) is FakeTensor and out.layout is torch.sparse_coo:
                return self.kept_elements(out, args)
            return out
        return self._apply(func, rule, args, kwargs, out)

    def _apply(self, func: torch._ops.OpOverload, rule: Rule, args: Args, kwargs: Kwargs, out: "OpValue") -> "OpValue":
        outs = out if isinstance(out, tuple) else (out,)
        if any(t is not None and not isinstance(t, FakeTensor) for t in outs):
            return out  # only data-less tensors are changed: a real tensor's storage would really grow
        fixed, added = list(outs), 0
        for i, (t, real) in enumerate(zip(outs, rule(args, kwargs, outs))):
            if real is None or t is None:  # (an output a backward was not asked for is None)
                continue
            have = t.untyped_storage().nbytes()
            if isinstance(real, torch.Tensor):
                fixed[i] = real
                # In place of an output still returned elsewhere (the LSTM's second bias gradient), all of it is new.
                kept = any(o is t for j, o in enumerate(fixed) if j != i)
                added += real.untyped_storage().nbytes() - (0 if kept else have)
            elif real > have:
                t.untyped_storage().resize_(real)  # the same tensor, on the storage the CPU kernel leaves
                added += real - have
        if added or any(a is not b for a, b in zip(fixed, outs)):
            name = str(func.overloadpacket)
            self.used[name] += 1
            self.bytes[name] += added
        return tuple(fixed) if isinstance(out, tuple) else fixed[0]

    def notes(self) -> list[str]:
        """What the simulation assumed, in words, for the estimate's notes."""
        if not self.used:
            return []
        from ..units import format_bytes

        def change(name: str) -> str:
            n = self.bytes[name]
            return f" ({'+' if n > 0 else '-'}{format_bytes(abs(n))})" if n else " (laid out as the CPU lays it out)"

        parts = ", ".join(f"{name} x{n}{change(name)}" for name, n in sorted(self.used.items()))
        return [f"CPU kernels whose outputs keep another storage than their shape's fake one, simulated as the "
                f"CPU runs them: {parts}{self.sparse_notes()}"]
