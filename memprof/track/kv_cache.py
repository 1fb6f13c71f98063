"""The KV cache: tensors a model keeps from one forward to the next.

The rule is about what happens to a tensor, not its class. A tensor the model made in one call of its
forward that comes back into a later call is carried state: a KV cache. That covers a user's own cache
(a tuple of key/value tensors handed back), and transformers' ``Cache`` objects (``DynamicCache``,
``StaticCache``, sliding-window and encoder-decoder caches), which the model fills in place: tensors the
call made and left inside an object it was given are the cache too, as are those it returns under the
name it was given a cache by (or ``past_key_values``, transformers' name for it).

In full mode, where memprof sees every storage made, only tensors made inside the model's forward
count, so the attention mask or position ids a decoding loop builds between calls stay inputs. In light
mode storages made by ops are not seen: tensors under a cache's name are counted as the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from .ledger import KV_CACHE, TEMPORARIES

if TYPE_CHECKING:
    from ..profiler import Profiler

__all__ = ["CacheTracker"]

#: transformers' name for the cache, in its models' arguments and outputs.
CACHE_NAME = "past_key_values"
_MAX_DEPTH = 6
_MAX_NODES = 20_000  # a walk stops here: a cache of a thousand layers has a few thousand objects


class CacheTracker:
    """Finds the cache among what a root forward is given and gives back, and counts it as ``kv_cache``."""

    def __init__(self, prof: "Profiler") -> None:
        self.prof = prof
        self.names: set[str] = {CACHE_NAME}  # where caches were seen: argument and output names
        self.calls_with_cache = 0
        self.tokens: "tuple[int, int] | None" = None  # (batch, prompt length) of the last prefill

    def before_call(self, args: tuple, kwargs: dict) -> bool:
        """Claim the cache handed to this call; True if one holding tensors was."""
        found = False
        for name, obj in _arguments(args, kwargs):
            if self._claim(obj, named=name in self.names):
                found = True
                self.names.add(name)
        if found:
            self.calls_with_cache += 1
        return found

    def after_call(self, args: tuple, kwargs: dict, output: Any) -> bool:
        """Claim what the call added to the cache it was given (filled in place) or returned under a cache's
        name; True if anything was."""
        made = False
        for name, obj in _arguments(args, kwargs):
            if not isinstance(obj, torch.Tensor) and self._claim(obj, named=name in self.names):
                made = True
        for name in self.names:
            obj = _field(output, name)
            if obj is not None and self._claim(obj, named=True):
                made = True
        return made

    def _claim(self, obj: Any, *, named: bool) -> bool:
        storages = self.prof.storages
        led = self.prof.ledger
        full = self.prof.mode == "full"
        claimed = False
        for t in _tensors(obj):
            entry = storages.entry_of(t)
            if entry is None:
                if named and not full:  # light mode: an op's output memprof did not see made
                    entry = storages.add_tensor(t, KV_CACHE)
                    claimed = claimed or entry is not None
                continue
            if entry.cat == KV_CACHE:
                claimed = True
            elif entry.cat == TEMPORARIES and (entry.module >= 0 or named):
                # Made inside the model (or handed over under a cache's name), kept past the call.
                led.move(entry, KV_CACHE)
                claimed = True
        return claimed


def _arguments(args: tuple, kwargs: dict) -> Iterator[tuple[str, Any]]:
    for i, a in enumerate(args):
        yield f"#{i}", a
    yield from kwargs.items()


def _field(output: Any, name: str) -> Any:
    if isinstance(output, dict):  # transformers' ModelOutput is an OrderedDict
        return output.get(name)
    return getattr(output, name, None) if not isinstance(output, (torch.Tensor, tuple, list)) else None


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors reachable from ``obj`` through sequences, mappings and plain objects' attributes."""
    seen: set[int] = set()
    stack = [(obj, 0)]
    nodes = 0
    while stack and nodes < _MAX_NODES:
        o, depth = stack.pop()
        nodes += 1
        if isinstance(o, torch.Tensor):
            if id(o) not in seen:
                seen.add(id(o))
                yield o
            continue
        if depth >= _MAX_DEPTH or o is None or isinstance(o, (str, bytes, int, float, bool, nn.Module, type)):
            continue
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, dict):
            children = list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            children = list(o)
        else:
            attrs = getattr(o, "__dict__", None)
            if not isinstance(attrs, dict):
                continue
            children = list(attrs.values())
        stack.extend((c, depth + 1) for c in reversed(children))
