"""Meta kernels answered from what they answered before.

A simulation for a GPU target runs on meta tensors, whose kernels compute only the outputs' sizes, strides and
dtypes; many of them are torch's Python references (``torch/_refs``: broadcasting and type promotion for every
``mul``, ``add``, ``pow``), about 250 us a call on this machine, a third of a Llama step's simulation. Their answer
depends on nothing but the op, its arguments' metadata and the process's default dtype (an integer tensor promoted
to a float), and a step, its cuts and a plan's batches ask the same questions again and again.
:class:`MetaKernelCache`, the last of the simulation's rules beneath the collector
(:mod:`memprof.simulate.op_chain`: one dispatch mode for them all), answers a question it has seen with new tensors
of the metadata the kernel gave, without running it.

Which ops it answers is read from the op's schema, once per op: one that returns new tensors only (no view, no
``out=``), or one that writes into ``self`` alone and returns it (``mul_``, ``addcdiv_``: on meta tensors the kernel
only checks the arguments). An op with no tensor argument (a factory, whose dtype may be the process's default), a
data-dependent or dynamic output shape, a view's metadata change, is passed to its kernel every time, as is a call
with an argument the key cannot describe exactly (a tensor subclass, a tensor not on the meta device, a complex,
sparse or negated tensor, a symbolic size, an object other than a number, string, dtype, device, layout or memory
format). An answer
is kept only where new tensors made from it are what the kernel made: each output a tensor of its own storage
(none shared with an input or another output), at offset 0, whose storage has the bytes ``empty_strided`` gives;
an in-place op's output the very ``self`` it was given, unchanged. Everything above the rule (memprof's ledger, the
rules, autograd) sees what the kernel would have returned: fresh storages of the same bytes.

A simulation for a CPU target, or of a ``parallelize=`` function, runs on fake CPU tensors instead
(``torch._subclasses.fake_tensor``), whose mode runs the same meta kernels and keeps their answers itself, but asks
its cache by a key that describes every tensor argument in full (``FakeTensorMode._cache_key``: about 85 us a call
answered, seven times this mode's). Given that fake mode, this rule sits just above it and answers the same
questions for its fake tensors (each described with its device as well; one holding a constant value, or another
mode's, is not described), with new fake tensors of the device and metadata the fake mode gave, on meta storages
of the same bytes. Only aten's and prims' ops are answered there: another namespace's op may act on the side (a
collective), which the fake mode's own cache does not answer either. A view is answered there too (``view``, ``t``,
``detach``: half of a step's fake calls): a new fake tensor on the storage of the argument the schema says it
views, at the sizes, strides and offset the kernel gave it, where the kernel's output was such a view (on meta
tensors a view's own kernel costs what answering it would); so is an op whose output the fake mode put on an
argument's storage though its schema names no alias (``_unsafe_view``, which the fake mode's own cache never
answers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

import torch
from torch._subclasses.fake_tensor import (_DISPATCH_HANDLE_DIRECTLY, _DISPATCH_META_HANDLERS, FakeTensor,
                                           _check_for_subclass)
from torch.utils._pytree import tree_flatten

from .fake_made import FakeMaker, meta_empty
from .op_chain import OpRule

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .aliases import OpValue
    from .op_chain import OpNext

__all__ = ["MetaKernelCache", "answerable"]

#: An output's metadata as the kernel gave it: sizes, strides, dtype, and a fake tensor's device (None: meta).
_Made = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, "torch.device | None"]


class _ViewOf:
    """A kept answer of a view op on fake tensors: a view of argument ``index``'s storage of this metadata."""

    __slots__ = ("index", "size", "stride", "offset", "dtype", "device")

    def __init__(self, index: int, view: torch.Tensor) -> None:
        self.index, self.size, self.stride, self.offset = index, tuple(view.shape), view.stride(), view.storage_offset()
        self.dtype, self.device = view.dtype, view.device


#: A kept answer: the outputs' metadata and whether they came as a tuple; a view's; or _SELF (an in-place op's self).
_Answer: TypeAlias = "tuple[tuple[_Made, ...], bool] | _ViewOf | str"

_FRESH, _INPLACE, _NEVER = "fresh", "in-place", "never"
_SELF = "self"
_UNKEPT = "unkept"  # a key whose answer new tensors cannot reproduce: its kernel runs every time
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_REFUSED_TAGS = ("dynamic_output_shape", "data_dependent_output", "inplace_view", "nondeterministic_bitwise")
#: The ops the fake mode answers before it looks at its arguments' types (``FakeTensorMode.dispatch``).
_FAKE_HANDLED = frozenset([*_DISPATCH_META_HANDLERS, *_DISPATCH_HANDLE_DIRECTLY])
#: The namespaces whose ops are answered on fake tensors (the fake mode's own cache answers no other either).
_FAKE_NAMESPACES = ("aten", "prims")
#: The answers kept in this process, shared by every simulation (a key holds no tensor, only metadata). Bounded:
#: a run that asks more distinct questions starts it again.
_LIMIT = 1 << 16
_ANSWERS: "dict[tuple[object, ...], _Answer]" = {}
#: As _ANSWERS, for fake tensors (apart: a call whose tensor arguments are all None has one key in both).
_FAKE_ANSWERS: "dict[tuple[object, ...], _Answer]" = {}
_KINDS: "dict[OpOverload, str]" = {}
#: As _KINDS for fake tensors, where a view of argument i is answered too (i); another namespace's op never.
_FAKE_KINDS: "dict[OpOverload, str | int]" = {}


class MetaKernelCache(OpRule):
    """The last rule of a simulation's op chain: beneath every other on meta tensors, just above ``fake_mode`` on its
    fake tensors (alone, a dispatch mode entered there). Each op the module docstring names, asked again with the
    same metadata, is answered with new tensors of the metadata its kernel gave."""

    def __init__(self, fake_mode: "FakeTensorMode | None" = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is untyped
        if fake_mode is not None and not answerable(fake_mode):
            from ..errors import InvalidArgumentError

            raise InvalidArgumentError("a fake mode with a shape environment or real tensors gives answers that "
                                       "depend on more than the arguments' metadata: enter it without MetaKernelCache")
        self.fake_mode = fake_mode
        self._fake = None if fake_mode is None else FakeMaker(fake_mode)

    def handle(self, func: "OpOverload", args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]",
               next: "OpNext") -> "OpValue":
        mode = self.fake_mode
        kind: "str | int | None"
        if mode is None:
            kind = _KINDS.get(func)
            if kind is None:
                kind = _KINDS[func] = _kind(func)
        else:
            kind = _FAKE_KINDS.get(func)
            if kind is None:
                kind = _FAKE_KINDS[func] = _fake_kind(func)
        if kind is _NEVER:
            return next(func, args, kwargs)
        key = _key(func, args, kwargs, mode)
        if key is None:
            if mode is not None and func not in _FAKE_HANDLED and _subclassed(args, kwargs):
                # The fake mode's answer to a call on another tensor subclass (DTensor), which then handles it; the
                # fake mode gives it after its cache's key has failed on the subclass, for every DTensor op. (The
                # rules before this one in a chain hand it back untouched: the subclass's own ops on its local
                # tensors come through the whole chain, as do those of a subclass the collector hands on.)
                return NotImplemented
            return next(func, args, kwargs)
        answers = _ANSWERS if mode is None else _FAKE_ANSWERS
        answer = answers.get(key)
        if answer is _SELF:
            return args[0]
        if type(answer) is _ViewOf:
            assert self._fake is not None  # views are answered on fake tensors only
            return self._fake(_meta_view(answer, args[answer.index]), answer.device)
        if isinstance(answer, tuple):
            made, many = answer
            if mode is None:
                outs = [torch.empty_strided(size, stride, dtype=dtype, device="meta")
                        for size, stride, dtype, _ in made]
            else:
                fake = self._fake
                assert fake is not None  # made with the mode
                outs = [fake(meta_empty(size, stride, dtype), device) for size, stride, dtype, device in made]
            return tuple(outs) if many else outs[0]
        out = next(func, args, kwargs)
        if answer is None:
            if len(answers) >= _LIMIT:
                answers.clear()
            answers[key] = _answer(kind, out, args, kwargs, key, mode)
        return out


def _subclassed(args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]") -> bool:
    """Is a tensor among the arguments of a subclass the fake mode does not handle, so that it answers NotImplemented
    (``fake_tensor._check_for_subclass``)?"""
    flat, _spec = tree_flatten((args, kwargs))
    return _check_for_subclass(flat)


def _meta_view(view: _ViewOf, base: "OpValue") -> torch.Tensor:
    """A meta tensor on ``base``'s storage (a fake tensor's is a meta storage) at ``view``'s metadata."""
    assert isinstance(base, torch.Tensor)  # the key described it as a fake tensor
    with torch._C._DisableTorchDispatch():
        out = torch.empty((0,), dtype=view.dtype, device="meta")
        out.set_(base.untyped_storage(), view.offset, view.size, view.stride)
    return out


def answerable(fake_mode: "FakeTensorMode") -> bool:
    """Can ``fake_mode``'s answers be kept: no shape environment (symbolic sizes) and no real tensors beside the
    fake ones, so that an answer depends on the op and its arguments' metadata alone?"""
    return fake_mode.shape_env is None and not getattr(fake_mode, "propagate_real_tensors", False)


def _kind(func: "OpOverload") -> str:
    """Whether an op's schema lets its answer be kept: it returns new tensors only, or writes into ``self``
    alone and returns it; it takes a tensor; no tag says its output depends on values or changes a view."""
    schema = func._schema
    if any(getattr(torch.Tag, t, None) in func.tags for t in _REFUSED_TAGS):
        return _NEVER
    returns, arguments = schema.returns, schema.arguments
    if not returns or any(str(r.type) != "Tensor" for r in returns):
        return _NEVER
    if not any("Tensor" in str(a.type) for a in arguments):
        return _NEVER  # a factory: its dtype may be the process's default, which no key holds
    written = [i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write]
    aliased_out = [r for r in returns if r.alias_info is not None]
    if not written and not aliased_out:
        return _FRESH
    returned = aliased_out[0].alias_info if len(returns) == 1 and aliased_out else None
    if written == [0] and returned is not None and returned.is_write and str(arguments[0].type) == "Tensor":
        return _INPLACE
    return _NEVER


def _fake_kind(func: "OpOverload") -> "str | int":
    """:func:`_kind` for fake tensors, where a view of one argument (the index of the one it views) is kept too;
    another namespace than aten's and prims' never."""
    if func.namespace not in _FAKE_NAMESPACES:
        return _NEVER
    kind = _kind(func)
    if kind is not _NEVER or not func.is_view:
        return kind
    schema = func._schema
    if any(getattr(torch.Tag, t, None) in func.tags for t in _REFUSED_TAGS) or len(schema.returns) != 1:
        return _NEVER
    returned = schema.returns[0].alias_info
    if returned is None or returned.is_write or str(schema.returns[0].type) != "Tensor":
        return _NEVER
    viewed = [i for i, a in enumerate(schema.arguments)
              if a.alias_info is not None and a.alias_info.before_set == returned.before_set]
    if len(viewed) != 1 or str(schema.arguments[viewed[0]].type) != "Tensor" or schema.arguments[viewed[0]].kwarg_only:
        return _NEVER
    return viewed[0]


def _key(func: "OpOverload", args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]",
         mode: "FakeTensorMode | None" = None) -> "tuple[object, ...] | None":
    """The call's key: the op, the process's default dtype and its arguments' metadata (of meta tensors, or of
    ``mode``'s fake tensors); None where an argument is not described exactly."""
    # The default dtype too: a kernel promoting an integer tensor to a float (``i / i``, ``i * 0.5``, ``sigmoid``)
    # gives the default dtype, which ``torch.set_default_dtype`` may change between two calls.
    parts: "list[object]" = [func, torch.get_default_dtype()]
    if not _described(args, parts, mode):
        return None
    if kwargs:
        for name in sorted(kwargs):
            parts.append(name)
            if not _described((kwargs[name],), parts, mode):
                return None
    if mode is not None:
        # As the fake mode keys its own answers: a tensor made in inference mode is an inference tensor, and the
        # default device is read by some kernels. (After the arguments: key[2] is the first one's description.)
        parts.append((torch.is_inference_mode_enabled(), torch._C._get_default_device()))
    return tuple(parts)


def _described(values: "tuple[OpValue, ...] | list[OpValue]", parts: "list[object]",
               mode: "FakeTensorMode | None") -> bool:
    for v in values:
        t = type(v)
        # Strided tensors only (a sparse one has no strides or storage), with no negation bit (a view keeps it,
        # which no key here holds; a complex dtype is refused for its conjugation bit).
        if t is torch.Tensor:
            if mode is not None or not v.is_meta or not _plain(v):
                return False
            parts.append((v.dtype, tuple(v.shape), v.stride(), v.storage_offset()))
        elif t is FakeTensor:
            # A fake tensor holding a constant is computed on its value by the fake mode: never answered here.
            if v.fake_mode is not mode or v.constant is not None or not _plain(v):
                return False
            parts.append((v.dtype, tuple(v.shape), v.stride(), v.storage_offset(), v.device, v.is_inference()))
        elif t in _SCALARS:
            parts.append((t, v))  # the type too: 1 and 1.0 promote a tensor to different dtypes
        elif t is list or t is tuple:
            parts.append((t, len(v)))
            if not _described(v, parts, mode):
                return False
        else:
            return False  # a symbolic size, a subclass, an object the key cannot hold
    return True


def _plain(t: torch.Tensor) -> bool:
    """Is ``t`` strided, real and without a negation bit: described in full by its dtype, sizes, strides and
    offset?"""
    return t.layout is torch.strided and not t.dtype.is_complex and not t.is_neg()


def _answer(kind: "str | int", out: "OpValue", args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]",
            key: "tuple[object, ...]", mode: "FakeTensorMode | None") -> _Answer:
    """What to keep of the kernel's ``out``: the outputs' metadata where new tensors reproduce it; _SELF for an
    in-place op that returned its ``self`` unchanged (its metadata as ``key[2]`` holds it); _UNKEPT otherwise."""
    if type(kind) is int:  # a view of args[kind], given by position
        return _view_of(kind, out, args, mode)
    if kind is _INPLACE:
        if not args:
            return _UNKEPT  # self given by name: no key holds it first
        self = args[0]
        held = key[2]
        unchanged = out is self and isinstance(held, tuple) and held[:4] == (
            self.dtype, tuple(self.shape), self.stride(), self.storage_offset())
        return _SELF if unchanged else _UNKEPT
    many = type(out) is tuple
    if mode is not None and not many and type(out) is FakeTensor and _plain(out):
        # An op whose schema says nothing of aliasing but whose output is on an argument's storage
        # (``_unsafe_view``, the reshape of a matmul's output): kept as that argument's view.
        shared = [i for i, a in enumerate(args) if type(a) is FakeTensor
                  and a.untyped_storage()._cdata == out.untyped_storage()._cdata]
        if len(shared) == 1:
            return _view_of(shared[0], out, args, mode)
    outs = list(out) if many else [out]
    seen = set(_storages(args, kwargs))
    made: "list[_Made]" = []
    for o in outs:
        if mode is None:
            if type(o) is not torch.Tensor or not o.is_meta:
                return _UNKEPT
        elif type(o) is not FakeTensor or o.fake_mode is not mode or o.constant is not None or o.requires_grad:
            return _UNKEPT
        if not _plain(o) or o.storage_offset() != 0:
            return _UNKEPT
        storage = o.untyped_storage()
        ident: int = storage._cdata
        if ident in seen:
            return _UNKEPT  # shares a storage with an input or another output: not a fresh tensor
        seen.add(ident)
        size, stride = tuple(o.shape), o.stride()
        if meta_empty(size, stride, o.dtype).untyped_storage().nbytes() != storage.nbytes():
            return _UNKEPT
        made.append((size, stride, o.dtype, None if mode is None else o.device))
    return tuple(made), many


def _view_of(index: int, out: "OpValue", args: "tuple[OpValue, ...]", mode: "FakeTensorMode | None") -> _Answer:
    """``out`` kept as a view of ``args[index]``: a new tensor on that argument's storage; not the argument itself,
    whose identity a new tensor would lose. Not in inference mode or of an inference tensor: whether a view is an
    inference tensor follows its base, and a tensor made for it follows the mode."""
    base = args[index] if index < len(args) else None
    if (type(out) is FakeTensor and out.fake_mode is mode and out.constant is None and not out.requires_grad
            and type(base) is FakeTensor and out is not base and _plain(out)
            and not torch.is_inference_mode_enabled() and not base.is_inference()
            and out.untyped_storage()._cdata == base.untyped_storage()._cdata):
        return _ViewOf(index, out)
    return _UNKEPT


def _storages(args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]") -> "list[int]":
    """The storages (their ``_cdata``) of the tensors among the arguments, lists included."""
    found: "list[int]" = []
    stack: "list[OpValue]" = [*args, *kwargs.values()]
    while stack:
        v = stack.pop()
        if type(v) is torch.Tensor or type(v) is FakeTensor:
            found.append(v.untyped_storage()._cdata)
        elif type(v) in (list, tuple):
            stack.extend(v)
    return found
