"""Progress for long simulations, in an interactive terminal only.

``max_batch_size`` runs several simulations and an estimate of a very large model takes seconds per
step: in a terminal a person watches, a tqdm bar (the ``progress`` extra, ``pip install
'torch-memprof[progress]'``) says what runs. Nothing is shown where nobody watches or where a bar
would be noise: when stderr is not a terminal (pipes, files, CI logs), when ``CI`` is set, in a
notebook kernel (whose stderr is not a terminal either), or without tqdm. ``MEMPROF_PROGRESS=0``
turns it off, ``=1`` on (still only with tqdm installed).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from ..errors import is_interrupt

if TYPE_CHECKING:
    from .aliases import Library

__all__ = ["Progress", "wanted"]


def wanted() -> bool:
    """Whether to show progress here and now."""
    setting = os.environ.get("MEMPROF_PROGRESS", "").strip()
    if setting in ("0", "false", "no"):
        return False
    if setting in ("1", "true", "yes"):
        return True
    if os.environ.get("CI"):
        return False
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError) as failure:  # a closed or replaced stderr
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return False


class Progress:
    """A bar of ``total`` steps titled ``what``, or nothing (see the module docstring). Use as a
    context manager; :meth:`step` advances it, with a note on the current step."""

    def __init__(self, total: "int | None", what: str) -> None:
        self._bar: "Library | None" = None  # a tqdm bar (tqdm: an optional import, without types)
        if not wanted():
            return
        try:
            from tqdm import tqdm
        except ImportError as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            return
        self._bar = tqdm(total=total, desc=what, unit="sim", leave=False, file=sys.stderr)

    def step(self, note: str = "") -> None:
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(1)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
