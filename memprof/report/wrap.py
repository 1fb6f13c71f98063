"""How the facade wraps a floor's public function: it keeps the signature and the docstring of the one it wraps,
leaves the process's random generators as it found them and raises an interrupt a finaliser swallowed. (The
floor's result is returned as it is: a record, whose views :mod:`.views` registers.)"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, TypeVar

from ..errors import remember_signal_handlers
from ..record.aliases import Forwarded
from ..swallowed import guarded
from .random_state import random_state_kept

__all__ = ["same_as", "Forwarded"]

F = TypeVar("F", bound=Callable[..., object])


def same_as(wrapped: Callable[..., object]) -> Callable[[F], F]:
    """The public function ``func`` reads as ``wrapped``, which does the work: its signature (with
    ``func``'s return annotation) and its docstring, so that ``help()`` documents it once. Every call of it
    leaves the process's random generators as it found them (:mod:`.random_state`), and raises an interrupt that
    a finaliser swallowed meanwhile (:mod:`memprof.swallowed`): this is the one seam every public function of the
    facade passes."""

    def decorate(func: F) -> F:
        returns = inspect.signature(func).return_annotation

        @functools.wraps(func)
        def public(*args: Forwarded, **kwargs: Forwarded) -> object:
            return guarded(lambda: _kept(func, args, kwargs))  # a finaliser's swallowed interrupt is raised

        public.__signature__ = inspect.signature(wrapped).replace(return_annotation=returns)  # type: ignore[attr-defined]
        public.__doc__ = wrapped.__doc__
        return public  # type: ignore[return-value]

    return decorate


def _kept(func: Callable[..., object], args: "tuple[Forwarded, ...]", kwargs: "dict[str, Forwarded]") -> object:
    remember_signal_handlers()  # one that uninstalls itself before it raises is still told apart
    with random_state_kept():
        return func(*args, **kwargs)
