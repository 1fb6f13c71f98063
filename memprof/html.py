"""Deprecated: moved to :mod:`memprof.render.html` (see docs/changelog.md)."""

from __future__ import annotations

from .errors import warn_renamed
from .render.html import breakdown_html, frame_html, report_html  # noqa: F401

__all__ = ["report_html", "frame_html", "breakdown_html"]

warn_renamed("memprof.html", "memprof.render.html")
