"""The hooks memprof puts on the user's modules and optimizers, as objects a copy or a pickle drops.

A module keeps its hooks in its ``__dict__``, so ``copy.deepcopy(model)`` (an EMA copy, ``AveragedModel``) and
``torch.save(model)`` take memprof's with it: a deep copy kept them on the copy after the profile ended (a
plain function is copied as itself; a bound method deep-copied memprof's tracker with it), and pickling failed
("Can't pickle local object '_post_hook.<locals>.post_hook'"), so a whole-model checkpoint saved inside a
profile ended the run. Each hook is therefore a ``functools.partial`` of the hook function (called by C: no Python
frame beside the function's own, and torch.compile traces through a partial as through the function, where an
object with a ``__call__`` of its own broke the graph), whose copy, deep copy and pickle are :data:`DROPPED`: a
hook that does nothing and, the first time it runs, takes itself off the object it is on.
"""

from __future__ import annotations

import functools
from typing import Callable

__all__ = ["hook_object", "DROPPED"]


class _Hook(functools.partial):  # type: ignore[type-arg]  # functools.partial's parameter is its result type
    """A hook memprof put on a user's object: ``fn`` itself, called through ``functools.partial``'s C call (no
    Python frame of its own, and a callable torch.compile traces through as it traces the function), whose copy,
    deep copy and pickle is :data:`DROPPED`."""

    __slots__ = ()

    def __copy__(self) -> "_Dropped":
        return DROPPED

    def __deepcopy__(self, memo: "dict[int, object]") -> "_Dropped":
        return DROPPED

    def __reduce__(self) -> "tuple[Callable[[], _Dropped], tuple[()]]":
        return _dropped, ()


def hook_object(fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` as a hook object (see the module's docstring): called as ``fn`` is."""
    return _Hook(fn)


class _Dropped:
    """A copied or unpickled memprof hook: it does nothing, and takes itself off the module or optimizer that
    calls it (with the flags torch keeps beside a hook under the same key)."""

    __slots__ = ()

    def __call__(self, owner: object, *rest: object) -> None:
        state = getattr(owner, "__dict__", {})
        keys = [k for d in list(state.values()) if isinstance(d, dict)
                for k, v in list(d.items()) if v is self]
        for d in list(state.values()):
            if isinstance(d, dict):
                for k in keys:
                    d.pop(k, None)  # the hook, and its with_kwargs / always_call flags, by the handle's id
        return None

    def __reduce__(self) -> "tuple[Callable[[], _Dropped], tuple[()]]":
        return _dropped, ()


#: What a copy or a pickle of a memprof hook is.
DROPPED = _Dropped()


def _dropped() -> _Dropped:
    return DROPPED
