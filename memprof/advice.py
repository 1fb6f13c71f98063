"""Deprecated: moved to :mod:`memprof.reconciler.advice` (see docs/changelog.md)."""

from __future__ import annotations

from .errors import warn_renamed
from .reconciler.advice import advice, levers  # noqa: F401

__all__ = ["advice", "levers"]

warn_renamed("memprof.advice", "memprof.reconciler.advice")
