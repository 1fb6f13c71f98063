"""The KV cache: tensors a model keeps from one forward to the next.

The rule is about what happens to a tensor, not its class. A tensor the model made in one call of its
forward that comes back into a later call is carried state: a KV cache. That covers a user's own cache
(a tuple of key/value tensors handed back), and transformers' ``Cache`` objects (``DynamicCache``,
``StaticCache``, sliding-window and encoder-decoder caches), which the model fills in place: tensors the
call made and left inside an object it was given are the cache too, as are those it returns under the
name it was given a cache by (or ``past_key_values`` and ``cache``, transformers' names for it).

In full mode, where memprof sees every storage made, only tensors made inside the model's forward
count, so the attention mask or position ids a decoding loop builds between calls stay inputs. In light
mode storages made by ops are not seen: tensors under a cache's name are counted as the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from ..categories import Phase
from ..records import GenerationFacts
from .ledger import KV_CACHE, TEMPORARIES

if TYPE_CHECKING:
    from ..profiler import Profiler

__all__ = ["CacheTracker"]

#: transformers' names for the cache, in its models' arguments and outputs (``cache`` from version 5).
CACHE_NAMES = ("past_key_values", "cache")
_MAX_DEPTH = 6
_MAX_NODES = 20_000  # a walk stops here: a cache of a thousand layers has a few thousand objects


class CacheTracker:
    """Finds the cache among what a root forward is given and gives back, and counts it as ``kv_cache``."""

    def __init__(self, prof: "Profiler", model: nn.Module) -> None:
        self.prof = prof
        self.names: set[str] = set(CACHE_NAMES)  # where caches were seen: argument and output names
        self.calls_with_cache = 0
        self.shape = _cache_shape(getattr(model, "config", None))
        self.batch: "int | None" = None
        self.itemsize: "int | None" = None
        self.in_cache = 0  # tokens in the cache now
        self.incoming = 0  # tokens handed to the call running now
        self.tokens: dict[tuple[int, str, int], int] = {}  # (step, phase, occurrence) -> tokens after it
        # The cache object (not a tensor) the running root call was handed, filled as its layers run.
        self.active: Any = None

    def before_call(self, args: tuple, kwargs: dict) -> bool:
        """Claim the cache handed to this call; True if one holding tensors was."""
        found = False
        self.active = None
        for name, obj in _arguments(args, kwargs):
            if self._claim(obj, named=name in self.names):
                found = True
                self.names.add(name)
            if name in self.names and obj is not None and not isinstance(obj, (torch.Tensor, tuple, list, dict)):
                self.active = obj
        if found:
            self.calls_with_cache += 1
        self.incoming, batch = _new_tokens(args, kwargs)
        if batch is not None:
            self.batch = batch
        if not found:
            self.in_cache = 0  # a prefill, if this call fills a cache
        return found

    def layer_done(self, args: tuple, kwargs: dict) -> None:
        """A module handed the running call's cache object returned: what it added there is the cache from
        now on, not at the end of the whole call (the prefill's peak is reached with half the layers filled)."""
        active = self.active
        if active is None:
            return
        if any(v is active for v in kwargs.values()) or any(a is active for a in args):
            self._claim(active, named=True)

    def add_tokens(self, n: int) -> None:
        """``n`` tokens joined the cache outside the model's forward (a simulation growing it directly)."""
        self.in_cache += n

    def facts(self) -> "GenerationFacts | None":
        if not self.tokens:
            return None
        layers, kv_heads, head_dim, window = self.shape
        return GenerationFacts(layers=layers, kv_heads=kv_heads, head_dim=head_dim, sliding_window=window,
                               itemsize=self.itemsize, batch=self.batch,
                               tokens=tuple((s, p, o, n) for (s, p, o), n in self.tokens.items()))

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
        self.active = None
        if made and not torch.is_grad_enabled():  # decoding (a training forward that returns a cache is not)
            self.in_cache += self.incoming
            phases = self.prof.phases
            phase = phases.current if phases.current is not Phase.FORWARD else Phase.PREFILL
            key = (phases.step, phase.value, phases.occurrence.get(phase, 0))
            self.tokens[key] = self.in_cache
        return made

    def _claim(self, obj: Any, *, named: bool) -> bool:
        storages = self.prof.storages
        led = self.prof.ledger
        claimed = False
        for t in _tensors(obj):
            if self.itemsize is None and t.is_floating_point():
                self.itemsize = t.element_size()
            entry = storages.entry_of(t)
            if entry is None:
                if named:  # made where memprof did not see it (light mode, before the profile): the cache's name says
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


def _new_tokens(args: tuple, kwargs: dict) -> "tuple[int, int | None]":
    """Tokens (and batch) handed to a call: its ``input_ids`` or ``inputs_embeds``, or its first
    two-dimensional integer tensor."""
    t = kwargs.get("input_ids")
    if not isinstance(t, torch.Tensor):
        t = kwargs.get("inputs_embeds")
    if not isinstance(t, torch.Tensor):
        t = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2 and not a.is_floating_point()),
                 None)
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        return 0, None
    return int(t.shape[1]), int(t.shape[0])


def config_int(config: Any, *names: str) -> "int | None":
    """The first of ``names`` a transformers-style config (its text part, for multimodal ones) has as an int."""
    if config is None:
        return None
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            config = get()
        except Exception:  # a config that cannot say: read it as it is
            pass
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _cache_shape(config: Any) -> "tuple[int | None, int | None, int | None, int | None]":
    """(layers, key/value heads, head dimension, sliding window) from a transformers-style config."""
    if config is None:
        return None, None, None, None

    def first(*names: str) -> "int | None":
        return config_int(config, *names)

    layers = first("num_hidden_layers", "n_layer", "num_layers")
    heads = first("num_attention_heads", "n_head", "num_heads")
    kv_heads = first("num_key_value_heads", "multi_query_group_num") or heads
    head_dim = first("head_dim")
    hidden = first("hidden_size", "n_embd", "d_model")
    if head_dim is None and hidden is not None and heads:
        head_dim = hidden // heads
    window = first("sliding_window")
    return layers, kv_heads, head_dim, window
