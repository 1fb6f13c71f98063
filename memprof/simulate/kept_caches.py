"""The ``functools`` caches of the model's code that a simulation filled, emptied when it ends.

A model's code may keep what it computes in a process-wide ``functools.lru_cache``: transformers' BEiT (and
DINOv3-ViT, DETR, SAM2 ...) caches the relative position index of a window size in a static method
(``compile_compatible_method_lru_cache``, transformers/pytorch_utils.py), and models cache position tables by
length in module-level functions. Called inside a simulation, such a function made and cached a fake tensor: the
user's next real forward read it and computed on fake tensors without an error (a FakeTensor loss; an optimizer step
that left half the parameters as they were), until ``loss.item()`` raised from deep inside torch.

:func:`caches_left_real` finds the caches the model's code can reach without walking the heap: in the class body of
every class of the model's modules (methods, static and class methods, and the cache a decorator keeps in its
closure, as transformers' does) and in the globals of the Python modules that define those classes and the step's own
functions (the loss function, a ``train_step``), where a model module's cached helpers are, its own or imported.
Classes and modules of torch, memprof and the standard library are left out: torch's caches keep what ops answer from
metadata, alike for a fake tensor. It notes each cache's misses (each miss adds an entry) when the outermost
simulation of a thread starts; when it ends, however it ends, it empties each one that gained an entry. An emptied
cache is filled again by the next real call, as in a new process: nothing the user computes changes, only that first
call's time. A cache only a deeper helper reaches (a function the model's modules do not name) is not found.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from typing import Any, Callable, Iterable, Iterator

from torch import nn

from ..errors import is_interrupt

__all__ = ["caches_left_real"]

_LRU: type = functools._lru_cache_wrapper
#: A ``functools`` cache (``functools._lru_cache_wrapper``), whose type is not public: its ``cache_info()`` and
#: ``cache_clear()`` are called as on any object.
Cache = Any
#: The top-level packages whose classes and modules are not searched (the module docstring says why).
_LEFT = frozenset({"torch", "memprof", *sys.stdlib_module_names})
_state = threading.local()


def _package(name: object) -> str:
    return str(name or "").partition(".")[0]


def _cached(value: object) -> Iterator[Cache]:
    """The caches ``value`` is or keeps: a cached function, a static or class method's, or one in a decorator's
    closure (a function whose closure holds the cached function)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
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


def _caches(model: nn.Module, functions: Iterable[object]) -> "dict[int, tuple[Cache, int]]":
    """The caches the model's code reaches (the module docstring), by id: each, and its misses so far."""
    found: dict[int, tuple[Cache, int]] = {}
    classes: set[type] = set()
    modules = {getattr(f, "__module__", None) for f in functions}

    def note(values: Iterable[object]) -> None:
        for value in values:
            for cache in _cached(value):
                found[id(cache)] = (cache, cache.cache_info().misses)

    for module in model.modules():
        for cls in type(module).__mro__:
            if cls not in classes and _package(cls.__module__) not in _LEFT:
                classes.add(cls)
                modules.add(cls.__module__)
                note(vars(cls).values())
    for name in modules:
        python_module = sys.modules.get(str(name)) if _package(name) not in _LEFT else None
        if python_module is not None:
            note(list(vars(python_module).values()))
    return found


@contextlib.contextmanager
def caches_left_real(model: nn.Module, *functions: "Callable[..., object] | None") -> Iterator[None]:
    """The block, with the caches of ``model``'s code (and of ``functions``' modules) it filled emptied after it (the
    module docstring); a block inside another of the same thread does nothing of its own."""
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
                cache.cache_clear()
