"""The views of a record, registered from above: how a record prints without importing its renderers.

A result (an :class:`~memprof.record.estimate.Estimate`, a :class:`~memprof.record.plans.BatchSizePlan`, a
reconciliation ...) is one frozen record, and its text, tables and HTML are functions of it in
:mod:`memprof.render`. Imports run one way (record below render below report), so a record cannot import the
functions that show it: the facade (:mod:`memprof.report.views`, which ``import memprof`` runs) registers them
here, by record class and view name, and the record's own methods (``to_text()``, ``__str__``, ``to_frame()``
...) call :func:`show`. A view is looked up along the record's class's MRO, so a subclass (a ``WhatIf`` is an
``Estimate``) has its parent's views unless it registers its own. One class, and its views beside it: no
class exists twice.
"""

from __future__ import annotations

from typing import Callable

from ..errors import RegistryError
from .aliases import Above

__all__ = ["register", "show", "registered"]

#: (record class, view name) -> the function that takes the record (and the view's arguments).
_VIEWS: "dict[tuple[type, str], Callable[..., Above]]" = {}


def register(cls: type, name: str, view: "Callable[..., Above]") -> None:
    """Make ``view(record, *args, **kwargs)`` the view ``name`` of every ``cls`` record. Registering one view
    twice for one class raises :class:`~memprof.errors.RegistryError`, as every registry of memprof does."""
    key = (cls, name)
    if key in _VIEWS:
        raise RegistryError(f"the view {name!r} of {cls.__module__}.{cls.__qualname__} is already registered "
                            f"(by {_VIEWS[key].__module__}); a record has one view of each name")
    _VIEWS[key] = view


def registered(cls: type, name: str) -> bool:
    """Whether ``cls`` (or a class it derives from) has a view ``name``."""
    return any((klass, name) in _VIEWS for klass in cls.__mro__)


def show(record: object, name: str, *args: object, **kwargs: object) -> Above:
    """The view ``name`` of ``record``, with ``args`` and ``kwargs``: the first one registered along its class's
    MRO. Raises :class:`~memprof.errors.RegistryError` naming the module to import where none is."""
    for klass in type(record).__mro__:
        view = _VIEWS.get((klass, name))
        if view is not None:
            return view(record, *args, **kwargs)
    cls = type(record)
    raise RegistryError(f"{cls.__qualname__} has no view {name!r} registered: its views are registered by the "
                        "facade, memprof.report (import memprof; a reconciliation's, which need torch, by "
                        "memprof.report.reconciliation, which memprof.reconcile and Report.reconcile load)")
