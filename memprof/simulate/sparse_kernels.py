"""Sparse COO tensors in a simulation, with the elements the real kernels give them.

On shape-only tensors a sparse tensor's elements are its indices and values tensors, whose sizes the kernels set.
The fake and meta kernels of several sparse ops make none, or keep their input's: an embedding's sparse gradient
cloned by autograd's AccumulateGrad held nothing, and every estimate with ``Embedding(sparse=True)`` was under from
backward's end. :class:`SparseKernels` makes them as the real kernels do, computed from the operands' element
counts. Two kinds of rule:

- ATen's device-independent code (``clone_sparse``, ``_embedding_bag_sparse_backward``): every target;
- the CPU's own kernels (``_coalesce``, ``sparse_mask``, the sum of two sparse tensors ``add_out_sparse_cpu``):
  the CPU target only (:class:`~memprof.simulate.cpu_kernels.CpuKernels`, which is this mode with its dense rules
  added). A CUDA target's are other kernels; where one has no meta kernel the step fails with a named error.

Where a count follows values (how many indices a coalesce or a sum merges, which bag indices are padding), the
most it can be stands for it: exact where indices are distinct, over where some repeat, with a note.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .op_chain import OpRule

if TYPE_CHECKING:
    from .aliases import OpValue
    from .op_chain import OpNext

__all__ = ["SparseKernels", "SPARSE_OPS", "NOT_SPARSE", "in_model", "Args", "Kwargs", "arg"]

_aten = torch.ops.aten
_CLONE = _aten.clone.default
_COALESCE = _aten._coalesce.default
_SPARSE_MASK = _aten.sparse_mask.default
_BAG_BACKWARD = _aten._embedding_bag_backward.default
# Sums of two sparse COO tensors (sub is add with -alpha: sub_sparse, SparseTensorMath.cpp), written into the first
# (True) or into a new tensor.
_SPARSE_SUMS = {_aten.add.Tensor: False, _aten.sub.Tensor: False, _aten.add_.Tensor: True, _aten.sub_.Tensor: True}
#: Every op a rule here may answer (the mode hands any other op on at once).
SPARSE_OPS = frozenset({_CLONE, _COALESCE, _SPARSE_MASK, _BAG_BACKWARD, *_SPARSE_SUMS})
#: What :meth:`SparseKernels.sparse` gives for a call no rule answers.
NOT_SPARSE = object()

#: An op's positional and keyword arguments (and its outputs), as a dispatch mode receives them.
Args = tuple["OpValue", ...]
Kwargs = dict[str, "OpValue"]


def _shape_only(t: object) -> bool:
    """A tensor with no data: fake (the CPU target) or meta (a CUDA target)."""
    return isinstance(t, FakeTensor) or (type(t) is torch.Tensor and t.is_meta)


def _sparse(t: object) -> bool:
    return isinstance(t, torch.Tensor) and _shape_only(t) and t.is_sparse


def arg(args: Args, kwargs: Kwargs, i: int, name: str, default: "OpValue") -> "OpValue":
    """An op's argument ``name``, given at position ``i`` or by name (``default`` where not given)."""
    return args[i] if len(args) > i else kwargs.get(name, default)


def in_model(model: torch.nn.Module) -> bool:
    """Does ``model`` hold a module that makes sparse gradients (``Embedding`` or ``EmbeddingBag`` with
    ``sparse=True``)? Without one, a CUDA target's simulation enters no sparse rule (a mode costs a Python call
    per op)."""
    return any(isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse for m in model.modules())


class SparseKernels(OpRule):
    """Sparse outputs with the elements the real kernels give them (the module docstring); ``cpu``: the CPU's own
    kernels' rules too. :attr:`used` counts the ops answered, :attr:`bytes` the bytes of what they made."""

    def __init__(self, cpu: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is untyped
        self.cpu = cpu
        self.used: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def handle(self, func: torch._ops.OpOverload, args: Args, kwargs: Kwargs, next: "OpNext") -> "OpValue":
        if func in SPARSE_OPS:
            answer = self.sparse(func, args, kwargs, next)
            if answer is not NOT_SPARSE:
                return answer
        return next(func, args, kwargs)

    def sparse(self, func: torch._ops.OpOverload, args: Args, kwargs: Kwargs, next: "OpNext") -> "OpValue":
        """The answer of a rule to this call of an op of :data:`SPARSE_OPS`, or :data:`NOT_SPARSE`."""
        if func is _CLONE and args and _sparse(args[0]):
            return self._sparse_clone(args[0])
        if func is _BAG_BACKWARD and arg(args, kwargs, 9, "sparse", False) and _shape_only(args[0]):
            return self._bag_gradient(args[0], args[1], int(arg(args, kwargs, 6, "num_weights", 0)))
        if not self.cpu:
            return NOT_SPARSE
        if func is _COALESCE and args and _shape_only(args[0]):
            return self._coalesced(args[0])
        if func is _SPARSE_MASK and len(args) == 2 and _sparse(args[1]):
            return self._masked(args[0], args[1])
        if func in _SPARSE_SUMS and len(args) >= 2 and _sparse(args[0]) and _sparse(args[1]):
            return self._sparse_sum(next(func, args, kwargs), args[0], args[1], _SPARSE_SUMS[func])
        if (func in _SPARSE_SUMS and len(args) >= 2 and _shape_only(args[0]) and args[0].layout is torch.strided
                and _sparse(args[1]) and args[1].is_coalesced() and args[0].shape == args[1].shape):
            return self._dense_plus_sparse(args[0], args[1], _SPARSE_SUMS[func])
        return NOT_SPARSE

    def _dense_plus_sparse(self, dense: torch.Tensor, sparse: torch.Tensor, inplace: bool) -> torch.Tensor:
        """``dense + sparse`` (or ``-``) with a coalesced sparse tensor, as the CPU makes it
        (``add_out_dense_sparse_cpu``): into ``dense`` itself, or into a new tensor of ``dense``'s shape in the
        promoted dtype. The fake kernel takes the CPU's coalesced path, which reads the values, and raised ("its data
        is not allocated yet"): SGD's step over a coalesced sparse gradient failed to simulate (a review's finding).
        (Shapes that differ never come here: the kernel's own check refuses them.)"""
        if inplace:
            return dense
        return torch.empty(dense.shape, dtype=torch.result_type(dense, sparse), device=dense.device)

    def kept_elements(self, out: "OpValue", args: Args) -> "OpValue":
        """``out``, an op's sparse COO output, or, where it holds no element though a sparse argument of its shape
        holds some, a sparse tensor of that argument's element count: the CPU's elementwise kernels over a sparse
        tensor (``neg``, ``mul`` and ``div`` by a scalar: ``mul_out_sparse_zerodim``, SparseTensorMath.cpp) copy
        its indices and make values for each, where the fake kernels made none (SGD's ``maximize`` negates a sparse
        gradient, ``p.grad = p.grad * 0.5`` scales it: both were under by the gradient, a review's finding).
        Kernels that coalesce first keep one element per distinct index: as many as the argument's stand for them,
        over where indices repeat."""
        if not isinstance(out, FakeTensor) or out.layout is not torch.sparse_coo or out._nnz():
            return out
        sparse = out.sparse_dim()
        source = next((a for a in args if isinstance(a, FakeTensor) and a.layout is torch.sparse_coo
                       and a.shape == out.shape and a._nnz()), None)
        if source is None:
            dense = next((a for a in args if isinstance(a, FakeTensor) and a.layout is torch.strided
                          and a.shape == out.shape and a.numel()), None)
            if dense is None:
                return out
            # A dense tensor made sparse (to_sparse): one element per nonzero position, which the values decide.
            # Every position stands for them: never under, over by the zeros (a review found a gradient rebuilt
            # with to_dense().to_sparse() held nothing, 20,480 B under). Coalesced, as the CPU's is.
            positions = 1
            for n in out.shape[:sparse]:
                positions *= n
            return self._made("to_sparse (every position kept)", list(out.shape),
                              torch.empty((sparse, positions), dtype=torch.int64, device=dense.device),
                              out._values().new_empty((positions, *out.shape[sparse:])), True)
        nnz = source._nnz()
        return self._made("elementwise (sparse)", list(out.shape), source._indices().new_empty((sparse, nnz)),
                          out._values().new_empty((nnz, *out.shape[sparse:])), source.is_coalesced())

    def _sparse_sum(self, out: "OpValue", t: torch.Tensor, s: torch.Tensor, inplace: bool) -> "OpValue":
        """``t + s`` (or ``t - s``) of two sparse COO tensors as the CPU makes it (``add_out_sparse_cpu``,
        aten/src/ATen/native/sparse/SparseTensorMath.cpp): new indices and values with room for both operands'
        elements, which keep that room when equal indices merge (the result's count is narrowed, its storage is
        not); ``t`` alone copied where ``s`` has none, ``s`` alone scaled where ``t`` has none. The fake kernel
        (``out``: its checks and metadata) keeps ``t``'s elements, or none: SGD's momentum buffer over a sparse
        gradient (``buf.mul_(momentum).add_(grad)``) was under by the gradient's elements from the second step.
        How many indices merge follows their values: none merge here, so the result holds as many elements as
        its room, exact where the operands' indices are distinct and over where some are equal (where a real
        buffer's room stays, this one's grows by the gradient's each step)."""
        if not isinstance(out, torch.Tensor) or not out.is_sparse or not _shape_only(out):
            return out
        tn, sn = t._nnz(), s._nnz()
        base = t if sn == 0 or tn > 0 else s
        nnz = tn + sn if tn and sn else base._nnz()
        coalesced = (t.is_coalesced() and s.is_coalesced()) if tn and sn else base.is_coalesced()
        sparse = out.sparse_dim()
        made = self._made("add (sparse)", list(out.shape), base._indices().new_empty((sparse, nnz)),
                          out._values().new_empty((nnz, *out.shape[sparse:])), coalesced)
        if not inplace:
            return made
        # The kernel puts its new indices and values into t (set_indices_and_values_unsafe); copying them in
        # replaces t's on the fake tensor as well, beneath the collector, which sees t's new storages as the
        # real run's collector does.
        _aten.copy_sparse_to_sparse_.default(out, made)
        return out

    def _bag_gradient(self, grad: torch.Tensor, indices: torch.Tensor, num_weights: int) -> torch.Tensor:
        """``EmbeddingBag(sparse=True)``'s weight gradient as ATen makes it on any device
        (``_embedding_bag_sparse_backward``: a row of ``grad``'s width per index, uncoalesced,
        aten/src/ATen/native/EmbeddingBag.cpp); the shape-only kernel's had none. An index equal to
        ``padding_idx`` is dropped by the real kernel, which the values decide: every index is kept here, over
        where some are padding."""
        nnz = indices.numel()
        return self._made("_embedding_bag_backward (sparse)", [num_weights, grad.shape[-1]],
                          indices.new_empty((1, nnz)), grad.new_empty((nnz, grad.shape[-1])), False)

    def _masked(self, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``t.sparse_mask(mask)`` as the CPU makes it: ``t``'s values at ``mask``'s indices, in new indices and
        values, one per index of ``mask`` (the fake kernel's had none)."""
        nnz, sparse = mask._nnz(), mask.sparse_dim()
        indices = mask._indices().new_empty((sparse, nnz))
        values = t.new_empty((nnz, *t.shape[sparse:]))
        return self._made("sparse_mask", list(mask.shape), indices, values, mask.is_coalesced())

    def _made(self, name: str, size: "list[int]", indices: torch.Tensor, values: torch.Tensor,
              coalesced: bool) -> torch.Tensor:
        """A sparse COO tensor of ``size`` on ``indices`` (its sparse dimensions' rows) and ``values``, counted for
        the notes."""
        made: torch.Tensor = torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors.default(
            indices.shape[0], values.dim() - 1, size, indices, values, dtype=values.dtype,
            layout=torch.sparse_coo, device=values.device, is_coalesced=coalesced)
        self.used[name] += 1
        self.bytes[name] += indices.untyped_storage().nbytes() + values.untyped_storage().nbytes()
        return made

    def _coalesced(self, t: torch.Tensor) -> torch.Tensor:
        """A sparse COO tensor coalesced with every index it holds kept: the CPU kernel keeps one per distinct
        index, which shape-only tensors cannot count, so the most it can keep (the indices given, at most one per
        position of the sparse dimensions) stands for it; the fake kernel's kept none. An embedding's sparse
        gradient coalesced by Adagrad's or SparseAdam's step holds a row per looked-up index: exact where the
        looked-up rows are distinct, over where some repeat."""
        sparse, dense = t.sparse_dim(), t.dense_dim()
        positions = 1
        for n in t.shape[:sparse]:
            positions *= n
        nnz = min(t._nnz(), positions)
        indices = t._indices().new_empty((sparse, nnz))
        values = t._values().new_empty((nnz, *t.shape[sparse:sparse + dense]))
        return self._made("_coalesce (every index kept)", list(t.shape), indices, values, True)

    def _sparse_clone(self, t: torch.Tensor) -> torch.Tensor:
        """A sparse COO tensor's clone as ATen makes it on any device (``clone_sparse``): its indices and values
        copied. The fake kernel's
        (``constructors`` on the meta device) has no element: a sparse gradient, which autograd's
        AccumulateGrad clones when references to its parts other than its own are held (every fake tensor's
        Python object is one: torch/csrc/autograd/functions/accumulate_grad.h), held nothing, where the real
        run's holds its indices and values (an embedding's: 8 B per looked-up index and a row of values each).
        A real run that keeps the gradient it was given (its shallow-copy path) holds no copy beside it while
        AccumulateGrad runs: the simulation's copy is the larger of the two, never under."""
        return self._made("clone (sparse)", list(t.shape), t._indices().clone(), t._values().clone(),
                          t.is_coalesced())

    def sparse_notes(self) -> str:
        """The upper bounds the rules took, in words (empty where none was)."""
        out = ""
        if self.used["_coalesce (every index kept)"]:
            out += ("; a sparse tensor coalesced kept every index it was given, which is exact where they are "
                    "distinct and over where some repeat (a real run keeps one per distinct index: the values "
                    "decide, which shape-only tensors do not hold)")
        if self.used["elementwise (sparse)"]:
            out += ("; an elementwise op's sparse result kept all of its argument's elements (exact for negation and "
                    "scaling; a kernel that coalesces first keeps one per distinct index, over where they repeat)")
        if self.used["to_sparse (every position kept)"]:
            out += ("; a dense tensor made sparse kept every position (a real run keeps its nonzero ones: the values "
                    "decide, over by the zeros)")
        if self.used["add (sparse)"]:
            out += ("; a sum of sparse tensors merged no equal indices (a real run merges them and keeps the room: "
                    "exact where they are distinct, over where some are equal, the values decide)")
        return out

    def notes(self) -> list[str]:
        """What the simulation assumed, in words, for the estimate's notes."""
        if not self.used:
            return []
        from ..units import format_bytes

        parts = ", ".join(f"{name} x{n} (+{format_bytes(self.bytes[name])})" for name, n in sorted(self.used.items()))
        return [f"sparse tensors made with the elements ATen's own code gives them, which the meta kernels did not: "
                f"{parts}{self.sparse_notes()}"]
