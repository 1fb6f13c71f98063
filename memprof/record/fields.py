"""A record part's file form, written once: a frozen dataclass to its JSON dict from its fields, and back.

:func:`write` gives each field's value under its name, in field order, in the JSON form its annotation
implies (a tuple as a list, recursively; an enum as its value; a nested part as its own dict; None as null).
:func:`read` checks each value against the annotation as strictly as :mod:`.checks` does (an int is a
non-negative int and never a bool, a str a str with lone surrogates replaced, a bool true or false, a tuple a
list of exactly its length, an enum exactly a member's value, a nested part through its own ``from_dict``,
an optional part null or absent) and builds the part. A field absent from the file takes its default (older
schemas); a required one absent is refused, naming it.

Where a part's file form differs from its fields, the field says so, not code per class:
``dataclasses.field(metadata=form(key=..., label=..., read=..., write=...))`` renames its key, names it in
refusals as the hand-written readers did, or reads and writes it in another form. A part whose checks span
several fields (a peak no lower than its start) reads through :func:`read` and then checks.
The plan of each class is built once (the loader reads thousands of parts per file).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Callable, NamedTuple, Protocol, TypeVar

from .aliases import JSON, JSONObject
from .checks import corrupt, count, flag, mapping, member, optional_count, optional_text, seq, text

__all__ = ["form", "read", "write"]

T = TypeVar("T")
#: A field's check of its value from a file, and its label: the value the part holds.
Reader = Callable[[object, str], object]
#: A field's JSON form of its value. Any: the value of the one field the writer is built for, whose type only its
#: annotation says (a plan holds the writers of every field of every part).
Writer = Callable[[Any], JSON]


class _ReadsItself(Protocol):
    """A nested record part: it reads its own file form."""

    @classmethod
    def from_dict(cls, data: object) -> object: ...

_KEY = "memprof.file"


#: A field without a default that the file must hold; a field whose dataclass default stands when absent.
_REQUIRED, _DEFAULT = object(), object()
#: The writer of a field the part writes elsewhere itself (the Trace's schema version, first in its file).
_UNWRITTEN: Writer = lambda value: None  # noqa: E731 - a sentinel that is a Writer


class _Form(NamedTuple):
    key: "str | None"
    label: "str | None"
    read: "Reader | None"
    write: "Writer | None"
    absent: object


def form(*, key: "str | None" = None, label: "str | None" = None, read: "Reader | None" = None,
         write: "Writer | None" = None, absent: object = _REQUIRED, written: bool = True) -> dict[str, object]:
    """A field's metadata when its file form differs: ``key`` the name in the file (default: the field's),
    ``label`` its name in a refusal (default ``Class.field``), ``read(value, label)`` and ``write(value)``
    its own conversion (default: from its annotation), ``absent`` the value of a required field that older
    files leave out; ``written=False``: :func:`write` leaves the field out (the part writes it itself)."""
    return {_KEY: _Form(key, label, read, write if written else _UNWRITTEN, absent)}


class _Field(NamedTuple):
    name: str
    key: str
    label: str
    read: Reader
    write: "Writer | None"  # None: the value is its JSON form already
    absent: object  # _REQUIRED, _DEFAULT (the dataclass's default) or the value an older file's absence gives


_PLANS: dict[type, tuple[_Field, ...]] = {}
_ABSENT = object()


def _plan(cls: type) -> tuple[_Field, ...]:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            own = f.metadata.get(_KEY) or _Form(None, None, None, None, _REQUIRED)
            absent = own.absent
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                absent = _DEFAULT
            out.append(_Field(f.name, own.key or f.name, own.label or f"{cls.__name__}.{f.name}",
                              own.read or _reader(hints[f.name]), own.write or _writer(hints[f.name]), absent))
        plan = _PLANS[cls] = tuple(out)
    return plan


def write(part: object) -> JSONObject:
    """The JSON dict of a frozen dataclass, from its fields."""
    out: JSONObject = {}
    for name, key, _, _, convert, _ in _PLANS.get(type(part)) or _plan(type(part)):
        if convert is None:
            out[key] = getattr(part, name)
        elif convert is not _UNWRITTEN:
            out[key] = convert(getattr(part, name))
    return out


def read(cls: "type[T]", data: object, what: str) -> T:
    """A ``cls`` from its JSON dict, every value checked; ``what`` names the part in a refusal ("a module")."""
    data = mapping(data, what)
    kw: dict[str, object] = {}
    missing = []
    for name, key, label, check, _, absent in _PLANS.get(cls) or _plan(cls):  # unpacked: the loader's hot loop
        value = data.get(key, _ABSENT)
        if value is not _ABSENT:
            kw[name] = check(value, label)
        elif absent is _REQUIRED:
            missing.append(key)
        elif absent is not _DEFAULT:
            kw[name] = absent
    if missing:
        raise corrupt(f"{what} lacks {sorted(missing)}")
    return cls(**kw)


def _optional(inner: Reader) -> Reader:
    return lambda value, name: None if value is None else inner(value, name)


def _reader(tp: object) -> Reader:
    """The check of a value from a file for annotation ``tp``."""
    simple: dict[object, Reader] = {int: count, str: text, bool: flag, int | None: optional_count,
                                    str | None: optional_text}
    if tp in simple:
        return simple[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return _optional(_reader(next(a for a in args if a is not type(None))))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _reader(args[0])
        return lambda value, name: tuple(item(v, name) for v in seq(value, name))
    if origin is tuple and args:
        items = tuple(_reader(a) for a in args)
        return lambda value, name: tuple(r(v, name) for r, v in zip(items, seq(value, name, len(items))))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda value, name: member(value, tp, name)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        # Every record part has a from_dict; a nested part reads itself.
        nested = typing.cast("type[_ReadsItself]", tp).from_dict
        return lambda value, name: nested(value)
    # float, Any, a mapping ...: the field must declare its own reader; a mistake in memprof, never let through
    raise RuntimeError(f"memprof cannot check a {tp} read from a file; declare the field's form(read=...)")


def _writer(tp: object) -> "Writer | None":
    """The JSON form of a value of annotation ``tp``; None where the value is its own JSON form."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [_writer(a) for a in args if a is not type(None)]
        if all(w is None for w in inner):
            return None
        if len(inner) != 1:
            raise RuntimeError(f"memprof cannot write a {tp}; declare the field's form(write=...)")
        one = inner[0]
        assert one is not None
        return lambda value: None if value is None else one(value)
    if origin is tuple:
        parts = [_writer(a) for a in args if a is not Ellipsis]
        if all(w is None for w in parts):
            return list
        if len(args) == 2 and args[1] is Ellipsis:
            each = parts[0]
            assert each is not None
            return lambda value: [each(v) for v in value]
        return lambda value: [v if w is None else w(v) for w, v in zip(parts, value)]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda value: value.value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return lambda value: value.to_dict()
    return None

