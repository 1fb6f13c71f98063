"""How the facade wraps a floor's result: the same fields in the facade's class, and a public function
that keeps the signature and the docstring of the one it wraps."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, TypeVar

__all__ = ["promote", "same_as"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def promote(cls: "type[T]", data: Any, **changes: Any) -> T:
    """``data`` (a frozen dataclass of :mod:`memprof.analyse` or :mod:`memprof.simulate`) as ``cls``, its
    facade subclass: the same field values (but ``changes``), and the renderers the facade adds."""
    values = {f.name: getattr(data, f.name) for f in dataclasses.fields(data) if f.init}
    return cls(**{**values, **changes})


def same_as(wrapped: Callable[..., Any]) -> Callable[[F], F]:
    """The public function ``func`` reads as ``wrapped``, which does the work: its signature (with
    ``func``'s return annotation) and its docstring, so that ``help()`` documents it once."""

    def decorate(func: F) -> F:
        returns = inspect.signature(func).return_annotation
        func.__signature__ = inspect.signature(wrapped).replace(return_annotation=returns)  # type: ignore[attr-defined]
        func.__doc__ = wrapped.__doc__
        return func

    return decorate
