"""Deprecated: moved to :mod:`memprof.reconciler` (see docs/changelog.md)."""

from __future__ import annotations

from .errors import warn_renamed
from .reconciler import Cause, Reconciliation, formula_at, formula_breakdown, infer_precision, reconcile  # noqa: F401

__all__ = ["Cause", "Reconciliation", "reconcile", "formula_at", "formula_breakdown", "infer_precision"]

warn_renamed("memprof.reconciliation", "memprof.reconciler")
