"""What formulas need to know about a run, recorded with it: module calls and optimizers.

The collector records facts, never a formula's result: each module call of
the first grad-enabled forward (its classes, plain configuration, parameters'
``requires_grad`` and tensor shapes) and each optimizer (class, groups,
parameter shapes). :mod:`memprof.anatomy.predict` applies the formulas to
these records, so a saved trace can be predicted again by a newer memprof.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import filterfalse
from typing import Mapping

from ..errors import is_interrupt
from . import fields as fileform
from .checks import corrupt, count, mapping, seq, text
from .aliases import JSON, JSONObject, Setting, UserObject
from .fields import form

__all__ = ["TensorSpec", "NotDescribed", "ModuleCall", "ParamSpec", "OptimizerSpec", "plain_config", "itemsize"]

# Bytes per element of the dtypes a record can name (torch's names without "torch.").
_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "complex32": 4, "int32": 4,
    "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8, "complex64": 8, "complex128": 16,
}


#: torch's limit on a tensor's bytes (and elements): an int64 byte count.
_TORCH_MAX_BYTES = 2**63 - 1


def _dtype(value: object) -> str:
    """A dtype's name from a file: one this table or torch knows (formulas make meta tensors of it)."""
    name = text(value, "a dtype")
    if name not in _ITEMSIZE:
        import torch  # a newer torch's dtype, or none: only torch can tell

        if not isinstance(getattr(torch, name, None) if name.isidentifier() else None, torch.dtype):
            raise corrupt(f"{name[:40]!r} is not a dtype torch knows")
    return name


def _shape(value: object, dtype: str) -> tuple[int, ...]:
    """A tensor's shape from a file: one torch can hold, as the formulas make a meta tensor of it."""
    shape = tuple(count(n, "a dimension") for n in seq(value, "a shape"))
    size = itemsize(dtype)
    for n in shape:
        size *= n
    if size > _TORCH_MAX_BYTES:
        raise corrupt(f"a tensor of shape {list(shape)[:8]} and dtype {dtype} is larger than torch can hold")
    return shape


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as a record names it (``"bfloat16"``)."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        import torch  # a dtype this table does not know (a newer torch's): ask torch

        size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return size


class NotDescribed(ValueError):
    """A tensor that :meth:`TensorSpec.of` cannot describe; the message says why, as a report's note would."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor: enough to size it."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, t: UserObject) -> "TensorSpec":
        """The spec of tensor ``t``; :class:`NotDescribed`, saying why, for a tensor that a shape and a dtype do
        not size: a layout other than strided (sparse, jagged nested), a size that is no number (a nested
        tensor's ragged dimension), or a shape or dtype that cannot be read (a subclass whose ``shape``
        raises)."""
        try:
            layout, shape, dtype = t.layout, tuple(t.shape), t.dtype
        except Exception as exc:  # the tensor's own code failed: whatever it raised, it has no spec
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            raise NotDescribed(f"a {type(t).__name__} whose shape or dtype cannot be read "
                               f"({type(exc).__name__}: {str(exc)[:80]})") from exc
        if str(layout) != "torch.strided":
            raise NotDescribed(f"a {type(t).__name__} of layout {str(layout).replace('torch.', '')}")
        try:
            # A SymInt with a value (a simulation's) is a number; a ragged size (j1) is not one.
            dims = tuple(n if type(n) is int else int(n) for n in shape)
        except Exception as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            raise NotDescribed(f"a {type(t).__name__} of size {list(shape)}, which is not a number in every "
                               "dimension") from exc
        return cls(dims, str(dtype).replace("torch.", ""))

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    # Written by hand, not from its fields (record/fields.py): a positional [shape, dtype] pair in the file, and
    # its shape is checked against its dtype (a tensor torch can hold).
    def to_dict(self) -> list[JSON]:
        return [list(self.shape), self.dtype]

    @classmethod
    def from_dict(cls, data: object) -> "TensorSpec":
        shape, dtype = seq(data, "a tensor's shape and dtype", 2)
        dtype = _dtype(dtype)
        return cls(_shape(shape, dtype), dtype)


_PLAIN = (bool, int, float, str, type(None))


_PRIVATE = operator.methodcaller("startswith", "_")


def plain_config(attrs: Mapping[str, UserObject]) -> tuple[tuple[str, Setting], ...]:
    """A module's or an optimizer group's configuration: its public attributes whose values are plain
    (numbers, strings, None, and tuples of those), sorted by name. Tensors, submodules and callables
    are left out; a tensor-valued setting is recorded as a float with its key prefixed ``"tensor:"``."""
    out: list[tuple[str, Setting]] = []
    try:
        # The private names (most of a module's attributes: _parameters, _forward_hooks ...) left out in C.
        names = list(filterfalse(_PRIVATE, attrs))
    except (AttributeError, TypeError) as failure:  # a name that is no string
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        names = [key for key in attrs if isinstance(key, str) and not key.startswith("_")]
    for key in names:
        if key == "params":
            continue
        value = attrs[key]
        if isinstance(value, _PLAIN):
            out.append((key, value))
        elif isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
            out.append((key, tuple(value)))
        elif type(value).__name__ == "Tensor" and getattr(value, "numel", lambda: 0)() == 1:
            out.append((f"tensor:{key}", float(value.item())))
    return tuple(sorted(out))


def _config(items: object) -> tuple[tuple[str, Setting], ...]:
    """Plain settings from a file: (name, value) pairs whose values are numbers, strings, null or lists
    of them (strings read as :func:`~memprof.record.checks.text` reads them)."""
    out = []
    for key, value in (seq(item, "a setting", 2) for item in seq(items, "settings")):
        key = text(key, "a setting's name")
        if isinstance(value, (list, tuple)):
            value = tuple(_setting(key, v) for v in value)
        else:
            value = _setting(key, value)
        out.append((key, value))
    return tuple(out)


def _setting(key: str, value: object) -> Setting:
    if not isinstance(value, _PLAIN):
        raise corrupt(f"setting {key[:40]!r} must be a number, string, null or a list of them")
    return text(value, f"setting {key[:40]!r}") if isinstance(value, str) else value


@dataclass(frozen=True)
class ModuleCall:
    """One module call of the first grad-enabled forward: what the per-module formula needs.

    ``classes`` are the module's class and its bases as ``module.QualName``
    (rules registered for a base class apply), ``config`` its plain attributes
    (``training``, ``p``, ``normalized_shape`` ...), ``params`` its own
    parameters with whether each needs a gradient, ``grad`` whether autograd
    recorded the call (an input or a parameter needed a gradient).
    """

    path: str = field(metadata=form(label="a module call's path"))
    classes: tuple[str, ...] = field(metadata=form(label="a module call's classes"))
    config: tuple[tuple[str, Setting], ...] = field(metadata=form(read=lambda v, _: _config(v), absent=()))
    params: tuple[tuple[str, bool], ...] = field(metadata=form(label="a parameter", absent=()))
    inputs: tuple[TensorSpec, ...] = field(metadata=form(label="a module call's inputs", absent=()))
    output: "TensorSpec | None" = field(metadata=form(absent=None))
    grad: bool = field(metadata=form(label="a module call's grad", absent=False))
    leaf: bool = field(metadata=form(label="a module call's leaf", absent=True))
    #: The call ran inside torch.utils.checkpoint (non-reentrant): it keeps nothing for backward in
    #: forward, and is recomputed in backward (schema 4; False in older files).
    checkpointed: bool = field(default=False, metadata=form(label="a module call's checkpointed"))

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "ModuleCall":
        return fileform.read(cls, data, "a module call")


@dataclass(frozen=True)
class ParamSpec:
    """An optimizer's parameter as its formulas see it."""

    shape: tuple[int, ...] = field(metadata=form(label="a dimension"))
    dtype: str = field(metadata=form(read=lambda v, _: _dtype(v)))
    device: str = field(metadata=form(label="a device"))
    requires_grad: bool = field(metadata=form(label="requires_grad"))
    #: A plain tensor or Parameter (torch's foreach default treats subclasses apart).
    plain: bool = field(default=True, metadata=form(label="plain"))

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "ParamSpec":
        """Read from a file: a shape torch can hold in its dtype."""
        spec = fileform.read(cls, data, "an optimizer's parameter")
        _shape(spec.shape, spec.dtype)
        return spec


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer as its formulas see it: class, parameter groups (plain settings, which parameters,
    the implementation torch chose for the group) and parameters."""

    classes: tuple[str, ...] = field(metadata=form(label="an optimizer's classes"))
    # Each group is a mapping in the file: {"config": [[name, value] ...], "params": [index ...], "implementation"}.
    groups: tuple[tuple[tuple[tuple[str, Setting], ...], tuple[int, ...], str], ...] = field(
        metadata=form(read=lambda v, _: _groups(v), write=lambda v: _groups_data(v)))
    params: tuple[ParamSpec, ...] = field(metadata=form(label="an optimizer's parameters"))
    #: Plain attributes of ``optimizer.args`` (bitsandbytes keeps min_8bit_size there), if it has one.
    args: tuple[tuple[str, Setting], ...] = field(default=(), metadata=form(read=lambda v, _: _config(v)))

    def to_dict(self) -> JSONObject:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: object) -> "OptimizerSpec":
        """Read from a file: every group names parameters the record holds."""
        spec = fileform.read(cls, data, "an optimizer")
        if any(i >= len(spec.params) for _, idx, _ in spec.groups for i in idx):
            raise corrupt("an optimizer group names a parameter the record does not hold")
        return spec


def _groups(items: object) -> tuple[tuple[tuple[tuple[str, Setting], ...], tuple[int, ...], str], ...]:
    groups = []
    for g in seq(items, "an optimizer's groups"):
        g = mapping(g, "a parameter group")
        idx = tuple(count(i, "a parameter index") for i in seq(g["params"], "a group's parameters"))
        groups.append((_config(g.get("config", ())), idx, text(g["implementation"], "an implementation")))
    return tuple(groups)


def _groups_data(groups: tuple[tuple[tuple[tuple[str, Setting], ...], tuple[int, ...], str], ...]) -> list[JSON]:
    return [{"config": [[k, v] for k, v in cfg], "params": list(idx), "implementation": impl}
            for cfg, idx, impl in groups]
