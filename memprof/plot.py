"""Deprecated: moved to :mod:`memprof.render.plot` (see docs/changelog.md)."""

from __future__ import annotations

from .errors import MissingExtraError, warn_renamed  # noqa: F401
from .render.common import CATEGORY_COLORS, PHASE_COLORS  # noqa: F401
from .render.plot import plot_modules, plot_timeline, plot_waterfall  # noqa: F401

__all__ = ["CATEGORY_COLORS", "PHASE_COLORS", "MissingExtraError", "plot_timeline", "plot_modules", "plot_waterfall"]

warn_renamed("memprof.plot", "memprof.render.plot")
