"""What the KV cache's formula needs of a generation, gathered as its calls run: the model's cache from its
config (layers, heads, head dimension, sliding window; the per-layer spec), the encoder's tokens and a static
cache's length, the cache's element sizes and batch, the tokens after each prefill and decode phase, and the
cache at their peaks and ends. :class:`~.kv_cache.CacheTracker` decides which calls are prefills and decodes
and which tensors are the cache, and writes here what it learns."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..anatomy.cache_config import cache_spec
from ..errors import MemprofError, is_interrupt
from ..record.cache import CacheMoment, frozen_spec
from ..record.parts import GenerationFacts

if TYPE_CHECKING:
    from .aliases import Kwargs

__all__ = ["CacheFacts", "config_int", "field"]


class CacheFacts:
    """The facts of one profile's generations (see the module's docstring)."""

    def __init__(self, config: object) -> None:
        self.shape = _cache_shape(config)
        try:
            spec = cache_spec(config)
        except MemprofError as failure:  # a config whose numbers make no cache (a head count of 0): no formula
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            spec = None
        self.spec = spec.to_dict() if spec is not None else None
        self.encoder_tokens: "int | None" = None
        self.max_cache_len: "int | None" = None
        self.moments: dict[tuple[int, str, int, str], CacheMoment] = {}
        self.batch: "int | None" = None
        self.itemsizes: set[int] = set()
        self.tokens: dict[tuple[int, str, int], int] = {}  # (step, phase, occurrence) -> tokens after it
        self.encoder_prefills: list[tuple[int, int]] = []  # (step, occurrence) of each prefill its encoder began

    def facts(self) -> "GenerationFacts | None":
        """The facts as the record keeps them (None: no prefill or decode call was seen)."""
        if not self.tokens:
            return None
        layers, kv_heads, head_dim, window = self.shape
        sizes = set(self.itemsizes)
        state = (self.spec or {}).get("recurrent_itemsize")
        if state is not None and len(sizes) == 2 and state in sizes:
            sizes.discard(state)  # states the implementation keeps in a dtype of their own say nothing of the rest
        # Keys and values of different dtypes (autocast) have no one element size: the formula then says so.
        itemsize = next(iter(sizes)) if len(sizes) == 1 else None
        return GenerationFacts(layers=layers, kv_heads=kv_heads, head_dim=head_dim, sliding_window=window,
                               itemsize=itemsize, batch=self.batch,
                               tokens=tuple((s, p, o, n) for (s, p, o), n in self.tokens.items()),
                               cache=frozen_spec(self.spec), encoder_tokens=self.encoder_tokens,
                               max_cache_len=self.max_cache_len,
                               moments=tuple(self.moments.values()), encoder_prefills=tuple(self.encoder_prefills))

    def note_shapes(self, handed: object, kwargs: "Kwargs") -> None:
        """The encoder's tokens (an encoder-decoder call's ``encoder_outputs``) and the length a static cache
        was allocated at (its layers' ``max_cache_len``): what the formula needs beside the config."""
        enc = kwargs.get("encoder_outputs")
        if isinstance(enc, (tuple, list)):  # the legacy tuple form: the last hidden state first
            enc = enc[0] if enc else None
        elif enc is not None:
            enc = field(enc, "last_hidden_state")
        else:
            enc = kwargs.get("encoder_hidden_states")
        if isinstance(enc, torch.Tensor) and enc.dim() >= 2:
            self.encoder_tokens = int(enc.shape[1])
        inner = getattr(handed, "self_attention_cache", handed)  # an EncoderDecoderCache's decoder side
        found = [getattr(layer, "max_cache_len", None) for layer in getattr(inner, "layers", None) or ()]
        lengths = [n for n in found if isinstance(n, int) and not isinstance(n, bool)]
        if lengths:
            self.max_cache_len = max(lengths)


def field(output: object, name: str) -> object:
    """``output``'s field ``name`` (a mapping's key or an object's attribute; None for tensors and sequences)."""
    if isinstance(output, dict):  # transformers' ModelOutput is an OrderedDict
        return output.get(name)
    return getattr(output, name, None) if not isinstance(output, (torch.Tensor, tuple, list)) else None


def config_int(config: object, *names: str) -> "int | None":
    """The first of ``names`` a transformers-style config (its text part, for multimodal ones) has as an int."""
    if config is None:
        return None
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            config = get()
        except Exception as failure:  # a config that cannot say: read it as it is
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            pass
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _cache_shape(config: object) -> "tuple[int | None, int | None, int | None, int | None]":
    """(layers, key/value heads, head dimension, sliding window) from a transformers-style config."""
    if config is None:
        return None, None, None, None

    def first(*names: str) -> "int | None":
        return config_int(config, *names)

    layers = first("num_hidden_layers", "n_layer", "num_layers")
    heads = first("num_attention_heads", "n_head", "num_heads")
    kv_heads = first("num_key_value_heads", "num_kv_heads", "multi_query_group_num") or heads
    if getattr(config, "multi_query", False) is True and not getattr(config, "new_decoder_architecture", False):
        kv_heads = 1  # Falcon's multi-query attention: one key/value head whatever num_kv_heads says
    head_dim = first("head_dim")
    hidden = first("hidden_size", "n_embd", "d_model")
    if head_dim is None and hidden is not None and heads:
        head_dim = hidden // heads
    window = first("sliding_window")
    return layers, kv_heads, head_dim, window
