"""Two runs compared: :func:`diff` and the :class:`Diff` it returns (:mod:`memprof.analyse.compare`'s record,
whose text, tables and HTML are the views :mod:`.views` registers)."""

from __future__ import annotations


from ..analyse import compare
from ..analyse.compare import Diff
from .wrap import same_as, Forwarded

__all__ = ["Diff", "diff"]


@same_as(compare.diff)
def diff(a: Forwarded, b: Forwarded, **options: Forwarded) -> Diff:
    return compare.diff(a, b, **options)
