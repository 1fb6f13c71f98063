"""A set of objects held weakly, by identity, that runs no code when they die (objects by name, held the same
way, are record/device_memory.py's replays: the one other such structure).

``weakref.WeakSet`` removes a dead member from a callback, Python code run as a finaliser, where Python
drops any exception raised, the one a signal handler raises there included (Ctrl-C, a preemption
handler): so no memprof structure may keep one. This one keeps weak references without callbacks and
forgets the dead ones when it is next changed.
"""

from __future__ import annotations

import weakref
from typing import Generic, Iterator, TypeVar

__all__ = ["WeakIdentitySet"]

T = TypeVar("T")


class WeakIdentitySet(Generic[T]):
    """Objects by identity (their own ``__eq__`` and ``__hash__`` are never called), held weakly."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[T]] = {}

    def add(self, obj: T) -> None:
        self._refs = {key: ref for key, ref in self._refs.items() if ref() is not None}
        self._refs[id(obj)] = weakref.ref(obj)

    def discard(self, obj: T) -> None:
        if obj in self:
            del self._refs[id(obj)]

    def __contains__(self, obj: object) -> bool:
        ref = self._refs.get(id(obj))
        return ref is not None and ref() is obj

    def __iter__(self) -> Iterator[T]:
        live = [ref() for ref in list(self._refs.values())]
        return iter([obj for obj in live if obj is not None])

    def __len__(self) -> int:
        return sum(1 for ref in list(self._refs.values()) if ref() is not None)
