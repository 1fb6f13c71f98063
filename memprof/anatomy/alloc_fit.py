"""Which cached block serves a request: torch's ``get_free_block`` (c10/cuda/CUDACachingAllocator.cpp).

The best fit among the free blocks of the request's pool and stream, under the ``max_split_size`` rules, taken out
of the free list. A function of the pools and the rules the allocator's frozen config fixes (:class:`FitRules`,
made once), called on every ``malloc`` of a replay.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import NamedTuple

from .alloc_blocks import Block, BlockPools

__all__ = ["FitRules", "get_free_block"]


class FitRules(NamedTuple):
    """What decides a fit beside the sizes: ``max_split_size`` (None: no limit), ``max_non_split_rounding``,
    whether expandable segments are on, and whether the garbage collector counts block ages."""

    limit: "int | None"
    max_non_split_rounding: int
    expandable: bool
    gc_on: bool


def get_free_block(pools: BlockPools, small: bool, stream: int, size: int, rules: FitRules) -> Block | None:
    """The smallest cached block of the pool and stream that fits ``size``, out of the free list; None when none
    may serve (the caller then makes a segment)."""
    if rules.gc_on:
        pools.gc_calls[small] += 1  # block ages are counted only while collection is on
    free = pools.free.get((small, stream))
    if not free:
        return None
    i = bisect_left(free, (size,))
    if i == len(free):
        return None
    if free[i][3].segment is not None:
        if rules.expandable:
            # Best fit counts an expandable block with the unmapped space behind it, so it loses to any
            # other block that fits with less.
            def reach(b: Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            while (free[i][3].segment is not None and i + 1 < len(free)
                   and reach(free[i + 1][3]) < reach(free[i][3])):
                i += 1
        else:  # expandable segments were turned off: only ordinary blocks may serve
            i += 1
            while i < len(free) and free[i][3].segment is not None:
                i += 1
            if i == len(free):
                return None
    block = free[i][3]
    limit = rules.limit
    if limit is not None:
        if size < limit <= block.size:
            return None  # an oversize block never serves a smaller request
        if size >= limit and block.size >= size + rules.max_non_split_rounding:
            return None  # nor a larger one it would waste max_non_split_rounding_mb or more of
    del free[i]
    return block
