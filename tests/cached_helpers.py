"""Cached helpers that tests/integration/test_kept_caches.py's models reach in the ways models' code does: through a
module imported under a name, behind an uncached helper, as a helper class's static method."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def table(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)


def deeper(n: int) -> torch.Tensor:
    """Uncached: its callee is."""
    return _deep(n)


@functools.cache
def _deep(n: int) -> torch.Tensor:
    return torch.linspace(0, 1, n)


class Rope:
    """A plain helper class with a cached static method (a bounded cache: emptied whole when it holds a fake entry)."""

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def freqs(n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32) / n


@functools.cache
def random_features(rows: int, cols: int) -> torch.Tensor:
    """Drawn once per shape: a cache whose entries are not recomputed alike."""
    return torch.randn(rows, cols)
