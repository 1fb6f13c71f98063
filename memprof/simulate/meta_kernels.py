"""Meta kernels answered from what they answered before.

A simulation for a GPU target runs on meta tensors, whose kernels compute only the outputs' sizes, strides and
dtypes; many of them are torch's Python references (``torch/_refs``: broadcasting and type promotion for every
``mul``, ``add``, ``pow``), about 250 us a call on this machine, a third of a Llama step's simulation. Their answer
depends on nothing but the op, its arguments' metadata and the process's default dtype (an integer tensor promoted
to a float), and a step, its cuts and a plan's batches ask the same questions again and again.
:class:`MetaKernelCache`, a dispatch mode beneath every other mode of the simulation, answers a question it has
seen with new tensors of the metadata the kernel gave, without running it.

Which ops it answers is read from the op's schema, once per op: one that returns new tensors only (no view, no
``out=``), or one that writes into ``self`` alone and returns it (``mul_``, ``addcdiv_``: on meta tensors the kernel
only checks the arguments). An op with no tensor argument (a factory, whose dtype may be the process's default), a
data-dependent or dynamic output shape, a view's metadata change, is passed to its kernel every time, as is a call
with an argument the key cannot describe exactly (a tensor subclass, a tensor not on the meta device, a complex
tensor, a symbolic size, an object other than a number, string, dtype, device, layout or memory format). An answer
is kept only where new tensors made from it are what the kernel made: each output a tensor of its own storage
(none shared with an input or another output), at offset 0, whose storage has the bytes ``empty_strided`` gives;
an in-place op's output the very ``self`` it was given, unchanged. Everything above the mode (memprof's ledger, the
rules, autograd) sees what the kernel would have returned: fresh storages of the same bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

import torch

from ..collect.torch_compat import UnwrappedMode

if TYPE_CHECKING:
    from torch._ops import OpOverload

    from .aliases import OpValue

__all__ = ["MetaKernelCache"]

#: An output's metadata as the kernel gave it: sizes, strides, dtype.
_Made = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
#: A kept answer: the outputs' metadata and whether they came as a tuple; or _SELF (an in-place op's self).
_Answer: TypeAlias = "tuple[tuple[_Made, ...], bool] | str"

_FRESH, _INPLACE, _NEVER = "fresh", "in-place", "never"
_SELF = "self"
_UNKEPT = "unkept"  # a key whose answer new tensors cannot reproduce: its kernel runs every time
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_REFUSED_TAGS = ("dynamic_output_shape", "data_dependent_output", "inplace_view", "nondeterministic_bitwise")
#: The answers kept in this process, shared by every simulation (a key holds no tensor, only metadata). Bounded:
#: a run that asks more distinct questions starts it again.
_LIMIT = 1 << 16
_ANSWERS: "dict[tuple[object, ...], _Answer]" = {}
_KINDS: "dict[OpOverload, str]" = {}


class MetaKernelCache(UnwrappedMode):
    """Beneath every other mode of a simulation on meta tensors: each op the module docstring names, asked
    again with the same metadata, is answered with new tensors of the metadata its kernel gave."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is untyped

    def __torch_dispatch__(self, func: "OpOverload", types: object, args: "tuple[OpValue, ...]" = (),
                           kwargs: "dict[str, OpValue] | None" = None) -> "OpValue":
        kwargs = kwargs or {}
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = _kind(func)
        if kind is _NEVER:
            return func(*args, **kwargs)
        key = _key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        answer = _ANSWERS.get(key)
        if answer is _SELF:
            return args[0]
        if isinstance(answer, tuple):
            made, many = answer
            outs = [torch.empty_strided(size, stride, dtype=dtype, device="meta") for size, stride, dtype in made]
            return tuple(outs) if many else outs[0]
        out = func(*args, **kwargs)
        if answer is None:
            if len(_ANSWERS) >= _LIMIT:
                _ANSWERS.clear()
            _ANSWERS[key] = _answer(kind, out, args, kwargs, key)
        return out


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


def _key(func: "OpOverload", args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]"
         ) -> "tuple[object, ...] | None":
    """The call's key: the op, the process's default dtype and its arguments' metadata; None where an argument is
    not described exactly."""
    # The default dtype too: a kernel promoting an integer tensor to a float (``i / i``, ``i * 0.5``, ``sigmoid``)
    # gives the default dtype, which ``torch.set_default_dtype`` may change between two calls.
    parts: "list[object]" = [func, torch.get_default_dtype()]
    if not _described(args, parts):
        return None
    if kwargs:
        for name in sorted(kwargs):
            parts.append(name)
            if not _described((kwargs[name],), parts):
                return None
    return tuple(parts)


def _described(values: "tuple[OpValue, ...] | list[OpValue]", parts: "list[object]") -> bool:
    for v in values:
        t = type(v)
        if t is torch.Tensor:
            if not v.is_meta or v.dtype.is_complex:
                return False
            parts.append((v.dtype, tuple(v.shape), v.stride(), v.storage_offset()))
        elif t in _SCALARS:
            parts.append((t, v))  # the type too: 1 and 1.0 promote a tensor to different dtypes
        elif t is list or t is tuple:
            parts.append((t, len(v)))
            if not _described(v, parts):
                return False
        else:
            return False  # a symbolic size, a subclass, an object the key cannot hold
    return True


def _answer(kind: str, out: "OpValue", args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]",
            key: "tuple[object, ...]") -> _Answer:
    """What to keep of the kernel's ``out``: the outputs' metadata where new tensors reproduce it; _SELF for an
    in-place op that returned its ``self`` unchanged (its metadata as ``key[2]`` holds it); _UNKEPT otherwise."""
    if kind is _INPLACE:
        if not args:
            return _UNKEPT  # self given by name: no key holds it first
        self = args[0]
        unchanged = out is self and key[2] == (self.dtype, tuple(self.shape), self.stride(), self.storage_offset())
        return _SELF if unchanged else _UNKEPT
    many = type(out) is tuple
    outs = list(out) if many else [out]
    seen = set(_storages(args, kwargs))
    made: "list[_Made]" = []
    for o in outs:
        if type(o) is not torch.Tensor or not o.is_meta or o.storage_offset() != 0:
            return _UNKEPT
        storage = o.untyped_storage()
        ident: int = storage._cdata
        if ident in seen:
            return _UNKEPT  # shares a storage with an input or another output: not a fresh tensor
        seen.add(ident)
        size, stride = tuple(o.shape), o.stride()
        if torch.empty_strided(size, stride, dtype=o.dtype, device="meta").untyped_storage().nbytes() \
                != storage.nbytes():
            return _UNKEPT
        made.append((size, stride, o.dtype))
    return tuple(made), many


def _storages(args: "tuple[OpValue, ...]", kwargs: "dict[str, OpValue]") -> "list[int]":
    """The storages (their ``_cdata``) of the tensors among the arguments, lists included."""
    found: "list[int]" = []
    stack: "list[OpValue]" = [*args, *kwargs.values()]
    while stack:
        v = stack.pop()
        if type(v) is torch.Tensor:
            found.append(v.untyped_storage()._cdata)
        elif type(v) in (list, tuple):
            stack.extend(v)
    return found
