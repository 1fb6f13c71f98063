"""The shape-only tensors a simulation left in the model code's ``functools`` caches, taken out when it ends.

A model's code may keep what it computes in a process-wide ``functools.lru_cache``: transformers' BEiT (and
DINOv3-ViT, DETR, SAM2 ...) caches the relative position index of a window size in a static method
(``compile_compatible_method_lru_cache``, transformers/pytorch_utils.py), and models cache position tables or random
features by shape in helper functions. Called inside a simulation, such a function made and cached a fake tensor:
the user's next real call with that key read it and computed on fake tensors without an error (a FakeTensor loss; an
optimizer step that left half the parameters as they were), until ``loss.item()`` raised from deep inside torch.

:func:`caches_left_real` finds, without walking the heap, the caches the model's code reaches: in the class bodies of
the model's module classes (methods, static and class methods, a decorator's closure, as transformers' keeps it), in
each module's own attributes (a cache, or a helper object holding one, set on the instance), and in the Python modules
that define those classes and the step's own functions (the loss function, a ``train_step``): their functions and
caches, the classes they define or import (a helper class's cached static method), ``functools.partial`` objects,
and, one level down, the modules they import under a name (``from . import helpers as H``) or import functions from
(a helper that calls a cached function of its own module). Classes and modules of
torch, memprof and the standard library are left out: torch's caches keep what ops answer from metadata, alike for a
fake tensor. It notes each cache's misses (each miss adds an entry) when the outermost simulation of a thread starts;
when it ends, however it ends, each cache that gained an entry and now holds a shape-only tensor (a fake tensor, or
one on the meta device) among its results loses it: an unbounded cache (``functools.cache``) the entries that hold
one, the user's own entries kept; a bounded one (``lru_cache(maxsize=...)``), whose entries ``functools`` offers no
way to take out one by one, is emptied whole, and refills at its next real calls. A cache that gained only real
entries is left as it is: emptying it could change what the user's code computes next (a cache of random features
drawn again). A cache only a deeper helper reaches (a function the model's modules do not name) is not found.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import threading
import types
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from ..errors import is_interrupt
from .shadows import shape_only

__all__ = ["caches_left_real"]

_LRU: type = functools._lru_cache_wrapper
#: A ``functools`` cache (``functools._lru_cache_wrapper``), whose type is not public: its ``cache_info()``,
#: ``cache_parameters()`` and ``cache_clear()`` are called as on any object.
Cache = Any
#: The top-level packages whose classes and modules are not searched (the module docstring says why).
_LEFT = frozenset({"torch", "memprof", *sys.stdlib_module_names})
_state = threading.local()
#: The types of values that may hold a cache (:func:`_cached`), beside a cache itself.
_HOLDERS = frozenset({staticmethod, classmethod, functools.partial, types.FunctionType})
#: The types of a module's attributes that are no helper object to search (its OrderedDicts of parameters and hooks,
#: flags, sizes, submodules, tensors).
_NOT_HELPERS = (dict, list, tuple, set, frozenset, str, bytes, int, float, nn.Module, torch.Tensor)


def _package(name: object) -> str:
    return str(name or "").partition(".")[0]


def _cached(value: object) -> Iterator[Cache]:
    """The caches ``value`` is or keeps: a cached function, a static or class method's, a partial's, or one in a
    function's closure (a decorator's: the function closes over the cached one)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, functools.partial):
        value = value.func
    if type(value) is _LRU:
        yield value
    elif isinstance(value, types.FunctionType):
        for cell in value.__closure__ or ():
            try:
                held = cell.cell_contents
            except ValueError as empty:  # an empty cell (a name the closure has not bound yet)
                if is_interrupt(empty):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                continue
            if type(held) is _LRU:
                yield held


class _Finder:
    """The search of the module docstring: every cache found, with its misses when found."""

    def __init__(self) -> None:
        self.found: dict[int, tuple[Cache, int]] = {}
        self.classes: set[type] = set()
        self.modules: dict[str, int] = {}  # each Python module searched, and the least depth it was searched at
        self.objects: set[int] = set()  # helper objects searched (a config every module holds: once)

    def note(self, values: Iterable[object]) -> None:
        self.add(_caches_in(values))

    def add(self, caches: Iterable[Cache]) -> None:
        for cache in caches:
            self.found[id(cache)] = (cache, cache.cache_info().misses)

    def a_class(self, cls: type) -> None:
        if cls not in self.classes and _package(cls.__module__) not in _LEFT:
            self.classes.add(cls)
            self.add(_class_caches(cls))

    def a_module(self, name: object, depth: int = 0) -> None:
        """The Python module ``name``'s functions and caches, its classes', and (at ``depth`` 0) the modules it
        imports under a name or imports functions from, searched the same way."""
        if _package(name) in _LEFT or self.modules.get(str(name), depth + 1) <= depth:
            return  # (searched at this depth or a lesser one: a module named first one level down is searched again)
        self.modules[str(name)] = depth
        parts = _module_parts(str(name))
        if parts is None:
            return
        caches, classes, further = parts
        self.add(caches)
        for cls in classes:
            self.a_class(cls)
        if depth == 0:
            for other in further:
                self.a_module(other, depth + 1)

    def an_instance(self, module: nn.Module) -> None:
        """The caches a module holds as attributes, or its plain helper objects hold."""
        for value in vars(module).values():
            kind = type(value)
            if isinstance(value, _NOT_HELPERS):
                continue  # (most of a module's attributes: its dicts of parameters and hooks, flags, submodules)
            if kind is _LRU or kind in _HOLDERS:
                self.note((value,))
            elif id(value) not in self.objects and hasattr(value, "__dict__") and not isinstance(value, (
                    type, types.ModuleType)):
                self.objects.add(id(value))
                self.a_class(kind)
                self.note(list(vars(value).values()))


def _caches_in(values: Iterable[object]) -> list[Cache]:
    return [cache for value in values if type(value) is _LRU or type(value) in _HOLDERS for cache in _cached(value)]


#: What a class body and a Python module hold, kept between simulations (a plan's, a test suite's) by the class and
#: by the module's name, each with the size of its namespace then: searched again when the namespace has grown (a
#: lazy import), forgotten all at once past :data:`_KEPT`.
_CLASSES: "dict[type, tuple[int, list[Cache]]]" = {}
_MODULES: "dict[str, tuple[tuple[int, int], tuple[list[Cache], list[type], list[str]]]]" = {}
_KEPT = 4096


def _class_caches(cls: type) -> list[Cache]:
    size = len(vars(cls))
    kept = _CLASSES.get(cls)
    if kept is None or kept[0] != size:
        if len(_CLASSES) > _KEPT:
            _CLASSES.clear()
        kept = _CLASSES[cls] = (size, _caches_in(list(vars(cls).values())))
    return kept[1]


def _module_parts(name: str) -> "tuple[list[Cache], list[type], list[str]] | None":
    """The caches of module ``name``'s namespace, its classes, and the modules it names (imported under a name, or
    the homes of the functions it imports); None where no such module is loaded."""
    python_module = sys.modules.get(name)
    if python_module is None:
        return None
    namespace = vars(python_module)
    key = (id(python_module), len(namespace))
    kept = _MODULES.get(name)
    if kept is not None and kept[0] == key:
        return kept[1]
    values = list(namespace.values())
    further = [v.__name__ for v in values if isinstance(v, types.ModuleType)]
    # (A function's __module__ is whatever its globals' __name__ was, None where they had none: exec'd code.)
    further += sorted({v.__module__ for v in values if isinstance(v, types.FunctionType)
                       and isinstance(v.__module__, str) and v.__module__ != name})
    parts = (_caches_in(values), [v for v in values if isinstance(v, type)], further)
    if len(_MODULES) > _KEPT:
        _MODULES.clear()
    _MODULES[name] = (key, parts)
    return parts


def _caches(model: nn.Module, functions: Iterable[object]) -> "dict[int, tuple[Cache, int]]":
    """The caches the model's code reaches (the module docstring), by id: each, and its misses so far."""
    finder = _Finder()
    kinds: set[type] = set()
    for module in model.modules():
        finder.an_instance(module)
        kinds.add(type(module))
    for kind in kinds:
        for cls in kind.__mro__:
            finder.a_class(cls)
    for name in {cls.__module__ for cls in finder.classes} | {getattr(f, "__module__", None) for f in functions}:
        finder.a_module(name)
    return finder.found


def _shape_only(value: object, depth: int = 0) -> bool:
    """Is ``value`` a tensor without data (fake, or on the meta device), or does a tuple, list or dict hold one?"""
    if isinstance(value, torch.Tensor):
        return shape_only(value)
    if depth < 2 and isinstance(value, (tuple, list)):
        return any(_shape_only(v, depth + 1) for v in value)
    if depth < 2 and isinstance(value, dict):
        return any(_shape_only(v, depth + 1) for v in value.values())
    return False


def _take_out_shape_only(cache: Cache) -> None:
    """``cache`` without its entries whose result holds a shape-only tensor (the module docstring)."""
    # The cache's own dict and its bounded list's keys and results are what the collector sees it hold.
    held = [r for r in gc.get_referents(cache) if r is not getattr(cache, "__dict__", None)]
    if cache.cache_parameters().get("maxsize") is None:
        for table in (r for r in held if type(r) is dict):
            for key in [k for k, v in table.items() if _shape_only(v)]:
                del table[key]  # (an unbounded cache is a plain dict of results: nothing else refers to the key)
    elif any(_shape_only(r) for r in held):
        cache.cache_clear()


@contextlib.contextmanager
def caches_left_real(model: nn.Module, *functions: "Callable[..., object] | None") -> Iterator[None]:
    """The block, with the shape-only tensors it left in the caches of ``model``'s code (and of ``functions``'
    modules) taken out after it (the module docstring); a block inside another of the same thread does nothing of
    its own."""
    if getattr(_state, "depth", 0):
        yield
        return
    before: dict[int, tuple[Cache, int]] = {}
    _state.depth = 1
    try:
        before = _caches(model, functions)
        yield
    finally:
        _state.depth = 0
        for cache, misses in before.values():
            if cache.cache_info().misses > misses:
                _take_out_shape_only(cache)
