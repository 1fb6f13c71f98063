"""A run described in a file: the sections of :class:`~memprof.simulate.run.RunConfig` in TOML or JSON, so that
what ``memprof estimate`` and ``memprof plan`` simulate can be versioned beside a training config.

The file's sections are RunConfig's and its keys are their fields, by the names the keyword arguments of
``estimate()`` use (:data:`memprof.simulate.run.OPTIONS`: the one mapping, which :meth:`RunConfig.from_options`
reads back into the sections)::

    model = "mypkg.models:build"      # or hf = "path/to/config.json" (a folder, the file, a cached hub id)
    precision = "bf16"

    [workload]                        # a training step; [generation] instead for prefill and decoding
    batch_size = 8
    steps = 2

    [target]
    device = "cuda"
    gpu = "h100-80gb"

    [parallelism]
    world_size = 8
    parallel = "fsdp"

    [depth]
    extrapolate = 2

What a file cannot hold (a tensor, a Python object) is in :data:`NOT_IN_FILE` with what gives it instead; a
function (``parallelize``, ``step_context``) is named ``"module:function"``, as the command line names it. The
file is read by memprof's one reader (:func:`memprof.record.files.read_bytes`: a regular file, bounded); an
unknown section or key, a value of the wrong type, a section or key given twice is one
:class:`~memprof.errors.InvalidArgumentError` naming the file, the section, the key and the keys that section
takes. What the values mean is checked where they are used, as the keyword arguments' are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, TypeGuard

from ..errors import InvalidArgumentError, is_interrupt
from .loops import LOOPS
from .run import PRECISIONS, Depth, Generation, Parallelism, Target, Workload

if TYPE_CHECKING:
    from .aliases import FileValue

__all__ = ["RunFile", "read_run_file", "SECTIONS", "TOP_KEYS", "NOT_IN_FILE", "BUILD_KEYS", "section_keys"]

#: The sections a run file may hold, each RunConfig's section of that name (``generation`` in ``workload``'s place).
SECTIONS: "Mapping[str, type]" = {"workload": Workload, "generation": Generation, "target": Target,
                                  "parallelism": Parallelism, "depth": Depth}
#: The keys outside the sections: which model (a factory or a transformers config, one of them) and the precision.
TOP_KEYS = ("model", "hf", "precision")

#: The fields of RunConfig's sections a file cannot give, each with why and what gives it instead.
NOT_IN_FILE: "Mapping[str, Mapping[str, str]]" = {
    "workload": {
        "model": "the model is the file's top-level model = \"module:function\" (a factory) or hf = \"...\"",
        "inputs": "tensors: the factory's 'inputs' key builds them, or hf's batch_size x seq_len tokens",
        "targets": "tensors: the factory's 'targets' key (with hf, the labels transformers takes)",
        "loss_fn": "the factory's 'loss_fn' key (with hf, the loss transformers computes from the labels)",
    },
    "generation": {"model": "the model is the file's top-level model = \"module:function\" or hf = \"...\""},
    "parallelism": {"pipeline": "a memprof.Pipeline object: the factory's 'pipeline' key"},
}

#: Keys a section takes that are no field of it: how the model and its batch are built (a factory is called with
#: ``batch_size``; a transformers config's batch is ``batch_size`` sequences of ``seq_len`` tokens).
BUILD_KEYS: "Mapping[str, tuple[str, ...]]" = {"workload": ("batch_size", "seq_len", "checkpointing")}


class _Wrong(Exception):
    """A value is not what its key takes: ``expected`` says what it takes."""

    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: object) -> int:
    if not _is_int(value) or value < 1:
        raise _Wrong("a whole number of at least 1")
    return int(value)


def _index(value: object) -> int:
    if not _is_int(value) or value < 0:
        raise _Wrong("a whole number of at least 0")
    return int(value)


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise _Wrong("true or false")
    return value


def _text(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Wrong("a string")
    return value


def _function(value: object) -> str:
    module, sep, name = value.partition(":") if isinstance(value, str) else ("", "", "")
    if not sep or not module.strip() or not name.strip():
        raise _Wrong("a function named \"module:function\" (for example \"mypkg.parallel:shard\")")
    return str(value)


def _choice(*names: str) -> "Callable[[object], str]":
    def check(value: object) -> str:
        if not isinstance(value, str) or value.strip().lower() not in names:
            raise _Wrong("one of " + ", ".join(f'"{n}"' for n in names))
        return value.strip().lower()
    return check


def _positive(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _Wrong("a number above 0")
    return value


def _fraction(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise _Wrong("a number in (0, 1]")
    return value


def _mesh(value: object) -> "dict[str, int]":
    """The mesh's dimensions, ``{name: size}`` in order (a TOML table ``mesh = {pp = 2, dp = 4}``)."""
    expected = "a table of dimension names and sizes, such as {dp = 4, tp = 2}"
    if not isinstance(value, dict) or not value:
        raise _Wrong(expected)
    for name, size in value.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or not _is_int(size) or size < 1:
            raise _Wrong(expected)
    return dict(value)


# What each key takes, by its name in its section (a name is one thing wherever it appears). The meaning (a GPU's
# name, a routing's spelling, a conf's text) is checked where it is used, as the keyword arguments' are.
_KINDS: "Mapping[str, Callable[[object], FileValue]]" = {
    "batch_size": _count, "seq_len": _count, "checkpointing": _flag, "steps": _count,
    "optimizer": _choice("adamw", "adam", "sgd", "none"), "step_context": _function, "routing": _text,
    "train_step": _function, "loop": _choice(*LOOPS),
    "prompt_len": _count, "max_new_tokens": _count, "num_beams": _count, "do_sample": _flag,
    "temperature": _positive, "top_k": _index, "top_p": _fraction,
    "device": _text, "gpu": _text, "alloc_conf": _text, "attention": _choice("auto", "flash", "efficient", "math"),
    "world_size": _count, "parallel": _choice("ddp", "fsdp", "fsdp1", "zero1", "zero2", "zero3"),
    "parallelize": _function,
    "mesh": _mesh, "rank": _index, "extrapolate": _count,
    "model": _function, "hf": _text, "precision": _choice(*PRECISIONS),
}


def section_keys(section: str) -> "tuple[str, ...]":
    """The keys ``[section]`` takes: its RunConfig section's fields a file can give, in their order, then
    :data:`BUILD_KEYS`'s."""
    fields = [f.name for f in dataclasses.fields(SECTIONS[section])
              if f.name not in NOT_IN_FILE.get(section, {}) and f.name in _KINDS]
    return (*fields, *BUILD_KEYS.get(section, ()))


@dataclass(frozen=True)
class RunFile:
    """A run file, read and checked: which model (``model``, a factory ``"module:function"``, or ``hf``), the
    ``precision``, and each section given, as ``{key: value}`` in the file's order."""

    path: str
    model: "str | None"
    hf: "str | None"
    precision: "str | None"
    sections: "Mapping[str, Mapping[str, FileValue]]"

    @property
    def generates(self) -> bool:
        """The file describes a generation (a ``[generation]`` section), not a training step."""
        return "generation" in self.sections

    def given(self) -> "dict[tuple[str, str], FileValue]":
        """Every value the file gives, by (section, key); the top-level keys' section is ``""``."""
        out: dict[tuple[str, str], FileValue] = {("", key): getattr(self, key) for key in TOP_KEYS
                                           if getattr(self, key) is not None}
        for section, values in self.sections.items():
            out.update(((section, key), value) for key, value in values.items())
        return out


def read_run_file(path: "str | os.PathLike[str]") -> RunFile:
    """The run file at ``path`` (``.toml`` or ``.json``), read by memprof's one reader and checked key by key."""
    from ..record.files import read_bytes

    name = os.fspath(path)
    fix = "give a .toml or .json file of a run's sections (docs/cli.md, 'A run in a file')"
    kind = os.path.splitext(name)[1].lower()
    if kind not in (".toml", ".json"):
        raise InvalidArgumentError(f"{name}: a run file is .toml or .json, and its name says which; rename it")
    data = read_bytes(name, what="a run file", fix=fix, error=InvalidArgumentError)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if is_interrupt(exc):
            raise
        raise InvalidArgumentError(f"{name} is not UTF-8 text ({exc.reason} at byte {exc.start}); {fix}") from None
    raw = _parse_toml(name, text) if kind == ".toml" else _parse_json(name, text)
    return _checked(name, raw)


def _parse_toml(name: str, text: str) -> object:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10 reads TOML with tomli, tomllib's original
        import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        if is_interrupt(exc):
            raise
        twice = _toml_twice(text)
        if twice is not None:  # tomllib's own words say where, not what
            raise _error(name, *twice, "is given twice; give each section and key once") from None
        raise InvalidArgumentError(f"{name} is not valid TOML ({exc}); fix that line") from None


def _toml_twice(text: str) -> "tuple[str, str] | None":
    """The first (section, key) a TOML text gives twice (key ``""``: the section's header twice), read line by
    line: it only names what tomllib refused."""
    seen: set[tuple[str, str]] = set()
    section = ""
    for line in text.splitlines():
        header = re.fullmatch(r"\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?", line)
        key = re.fullmatch(r"\s*([A-Za-z0-9_-]+)\s*=.*", line)
        if header:
            section = header.group(1).strip("\"' ")
            if (section, "") in seen:
                return section, ""
            seen.add((section, ""))
        elif key:
            if (section, key.group(1)) in seen:
                return section, key.group(1)
            seen.add((section, key.group(1)))
    return None


class _Pairs(list[tuple[str, object]]):
    """A JSON object's (key, value) pairs, as written: a key given twice stays visible until it is checked."""


def _parse_json(name: str, text: str) -> object:
    try:
        return json.loads(text, object_pairs_hook=_Pairs)
    except (ValueError, RecursionError) as exc:
        if is_interrupt(exc):
            raise
        raise InvalidArgumentError(f"{name} is not valid JSON ({exc}); fix that line") from None


def _table(name: str, section: str, value: object) -> "dict[str, object]":
    """A table of the file (the top level, a section) as a dict of its values as parsed, a key given twice
    refused (JSON allows it and keeps the last silently)."""
    if isinstance(value, _Pairs):
        out: dict[str, object] = {}
        for key, item in value:
            if key in out:
                raise _error(name, section, key, "is given twice; give each section and key once")
            out[key] = item
        return out
    if isinstance(value, dict):
        return dict(value)
    if not section:
        raise InvalidArgumentError(f"{name} must hold a table of sections (an object in JSON), not {_kind(value)}")
    raise _error(name, section, "", f"must be a table of keys, not {_kind(value)}")


def _plain(name: str, section: str, key: str, value: object) -> object:
    """A value with JSON's objects inside it as dicts (a mesh's table), a key given twice refused."""
    if isinstance(value, _Pairs):
        out: dict[str, object] = {}
        for inner, item in value:
            if inner in out:
                raise _error(name, section, key, f"gives {inner!r} twice; give each key once")
            out[inner] = _plain(name, section, key, item)
        return out
    if isinstance(value, list):
        return [_plain(name, section, key, item) for item in value]
    return value


def _checked(name: str, raw: object) -> RunFile:
    """The file's values checked: known sections and keys, each value of its kind, one model."""
    top = _table(name, "", raw)
    sections: dict[str, dict[str, FileValue]] = {}
    values: dict[str, FileValue] = {}
    for key, value in top.items():
        if key in SECTIONS:
            table = _table(name, key, value)
            sections[key] = {k: _value(name, key, k, v) for k, v in table.items()}
        elif key in TOP_KEYS:
            values[key] = _value(name, "", key, value)
        else:
            raise _error(name, "", key, "is no section or key of a run file")
    if "model" in values and "hf" in values:
        raise _error(name, "", "hf", "and model both say which model; give one of them")
    if "workload" in sections and "generation" in sections:
        raise _error(name, "generation", "", "and [workload] both describe the run: a run trains ([workload]) or "
                     "generates ([generation]); give one")
    if "generation" in sections:
        for other in (s for s in ("parallelism", "depth") if s in sections):
            raise _error(name, other, "", "is a training step's: a generation runs on one device, whole; leave it "
                         "out with [generation]")
    return RunFile(path=name, model=values.get("model"), hf=values.get("hf"), precision=values.get("precision"),
                   sections=sections)


def _value(name: str, section: str, key: str, value: object) -> "FileValue":
    accepted = section_keys(section) if section else TOP_KEYS
    if key not in accepted:
        why = NOT_IN_FILE.get(section, {}).get(key)
        raise _error(name, section, key, f"cannot be given in a file ({why})" if why else "is unknown")
    value = _plain(name, section, key, value)
    try:
        return _KINDS[key](value)
    except _Wrong as exc:
        if is_interrupt(exc):
            raise
        raise _error(name, section, key, f"must be {exc.expected}, not {_kind(value)} {_shown(value)}") from None


def _error(name: str, section: str, key: str, problem: str) -> InvalidArgumentError:
    """One refusal naming the file, the section, the key, and the keys that section takes."""
    if not section:
        where = f"key {key!r}" if key else "the top level"
        takes = ("the top level takes " + ", ".join(TOP_KEYS) + " and the sections "
                 + ", ".join(f"[{s}]" for s in SECTIONS))
    elif section not in SECTIONS:  # a table inside a section ([parallelism.mesh]), named by tomllib's refusal
        head = section.split(".")[0]
        where = f"[{section}]" + (f" key {key!r}" if key else "")
        takes = f"[{head}] takes " + ", ".join(section_keys(head)) if head in SECTIONS else "fix the file"
    else:
        where = f"[{section}]" + (f" key {key!r}" if key else "")
        takes = f"[{section}] takes " + ", ".join(section_keys(section))
    return InvalidArgumentError(f"{name}: {where} {problem}; {takes}")


def _kind(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "a table", _Pairs: "a table", type(None): "null"}.get(type(value), type(value).__name__)


def _shown(value: object) -> str:
    text = repr(value) if not isinstance(value, (dict, _Pairs, list)) else ""
    return text if len(text) <= 40 else text[:37] + "..."
