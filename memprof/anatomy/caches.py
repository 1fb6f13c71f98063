"""Inference caches by what the implementation keeps, layer by layer, at every moment of a generation.

A generation's cache is not one formula: each layer keeps what its kind of mixer needs, and how it grows
is the implementation's choice. The rules here follow transformers' ``cache_utils.py`` (the classes named
below), which every model of transformers 5 fills:

* **full attention** (``DynamicLayer``): a key and a value per token and key/value head, grown by
  ``torch.cat`` on the token dimension in every call, so while a layer is updated its old keys and its new
  ones both live (Pope et al. 2022, "Efficiently Scaling Transformer Inference", count the cache this way;
  grouped- and multi-query attention keep fewer key/value heads);
* **sliding-window attention** (``DynamicSlidingWindowLayer``, also chunked attention): after each call the
  layer keeps the last ``window - 1`` tokens as a *view* of that call's concatenation, so the storage it holds
  is ``min(tokens before the call, window - 1) + tokens the call added``: the whole prompt after the prefill,
  ``window`` tokens after each decode call once the window is full;
* **static caches** (``StaticLayer``, ``StaticSlidingWindowLayer``): allocated at their full length
  (``max_cache_len``, capped at the window for sliding layers) by the first call and written in place;
* **multi-head latent attention** (DeepSeek-V2, section 2.1): a latent ``c_KV`` of ``kv_lora_rank`` and a
  shared rotary key of ``qk_rope_head_dim`` per token (:func:`latent_attention_dims`);
* **state-space and linear-attention layers** (``LinearAttentionLayer``): a convolution state of
  ``conv_kernel`` columns and a recurrent state per sequence, allocated by the first call and written in
  place, whatever the number of tokens;
* **encoder-decoder caches** (``EncoderDecoderCache``): each decoder layer's self-attention cache, and its
  cross-attention keys and values over the encoder's tokens, written by the first decoder call.

:class:`CacheSpec` describes a model's cache (``memprof.anatomy.cache_spec`` reads one from a transformers
config); :func:`call_slots` lists the tensors one call leaves in the cache, before and after it, in the
order the model writes them, and :func:`cache_bytes` / :func:`bytes_at` add them up at a call's end or at a
moment inside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..errors import InvalidArgumentError
from ..units import as_count
from ..record.aliases import Setting

__all__ = ["CacheSpec", "Slot", "LAYER_KINDS", "call_slots", "cache_bytes", "bytes_at", "sliding_kept_tokens",
           "latent_attention_dims"]

#: transformers' names for what a layer caches (``cache_utils.py``, ``DYNAMIC_LAYER_TYPE_MAPPING``); "none"
#: for a layer that keeps nothing (transformers' ``DummyLayer``: "moe", "mlp", a layer reusing another's).
LAYER_KINDS = ("full_attention", "sliding_attention", "linear_attention", "hybrid", "hybrid_sliding", "none")
_ATTENTION = {"full_attention", "sliding_attention", "hybrid", "hybrid_sliding"}
_LINEAR = {"linear_attention", "hybrid", "hybrid_sliding"}
_SLIDING = {"sliding_attention", "hybrid_sliding"}


@dataclass(frozen=True)
class CacheSpec:
    """What a model caches, per layer and per sequence: the input of the cache formulas.

    ``layers`` names each decoder layer's kind (:data:`LAYER_KINDS`). Attention layers keep ``kv_heads``
    keys of ``head_dim`` and values of ``value_head_dim`` (``head_dim`` when None) per token. State-space
    layers keep ``conv_channels x conv_kernel`` convolution elements and ``recurrent_elements`` state
    elements per sequence; ``recurrent_itemsize`` is the state's element size when the implementation keeps
    it in a dtype of its own (4: the float32 scans of transformers' Mamba, Mamba-2 and gated-delta-rule
    layers), None when it has the model's. A hybrid layer writes its attention first when
    ``attention_first``, else its state first. ``cross_attention``: each decoder layer also keeps keys and
    values over the encoder's tokens; ``encoder_hidden``: the width of the encoder's output, which the
    decoding loop hands back to every call and memprof counts with the cache. ``kept`` and ``source`` say
    in words what is kept and where that comes from.
    """

    layers: tuple[str, ...]
    kv_heads: int = 0
    head_dim: int = 0
    value_head_dim: "int | None" = None
    sliding_window: "int | None" = None
    conv_channels: int = 0
    conv_kernel: int = 0
    recurrent_elements: int = 0
    recurrent_itemsize: "int | None" = None
    attention_first: bool = True
    cross_attention: bool = False
    encoder_hidden: int = 0
    kept: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        unknown = sorted(set(self.layers) - set(LAYER_KINDS))
        if unknown:
            raise InvalidArgumentError(f"unknown cache layer kind(s) {unknown}; use one of {list(LAYER_KINDS)}")
        kinds = set(self.layers)
        if kinds & _ATTENTION and (self.kv_heads < 1 or self.head_dim < 1):
            raise InvalidArgumentError("attention layers need kv_heads >= 1 and head_dim >= 1 in the CacheSpec")
        if kinds & _SLIDING and (self.sliding_window is None or self.sliding_window < 1):
            raise InvalidArgumentError("sliding-window layers need sliding_window >= 1 in the CacheSpec")
        if kinds & _LINEAR and (self.conv_channels < 1 or self.conv_kernel < 1 or self.recurrent_elements < 1):
            raise InvalidArgumentError("state-space layers need conv_channels, conv_kernel and recurrent_elements "
                                       ">= 1 in the CacheSpec")

    def to_dict(self) -> dict[str, object]:
        out = dict(self.__dict__)
        out["layers"] = list(self.layers)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Setting]) -> "CacheSpec":
        """The spec :meth:`to_dict` wrote (keys it does not know are left out: a newer writer's extras)."""
        # Setting: a trace file's values, checked by type (int, str, bool, None, list of str) by
        # memprof.record.cache.spec_data but not field by field; __post_init__ and the formulas check their sense.
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


@dataclass(frozen=True)
class Slot:
    """One tensor a call leaves in the cache: its bytes when the call begins and ends, and whether the call
    puts a new storage there (a concatenation, or the first allocation) rather than writing in place.
    ``held_with``: bytes of the layer's other old storage still alive while this slot's new one is made
    (a sliding-window layer lets go of its old keys only once its values are concatenated too)."""

    name: str
    before: int
    after: int
    renewed: bool
    held_with: int = 0


def sliding_kept_tokens(before: int, added: int, window: int) -> int:
    """Tokens of storage a sliding-window layer holds after a call that added ``added`` tokens to ``before``.

    ``DynamicSlidingWindowLayer.update`` (transformers ``cache_utils.py``) concatenates its kept tokens with
    the new ones and keeps a view of the last ``window - 1``: the view holds the whole concatenation, so the
    storage is ``min(before, window - 1) + added`` (the prompt after a prefill, ``window`` once full).
    """
    return min(before, window - 1) + added


def latent_attention_dims(*, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int,
                          v_head_dim: int, kept: str = "latent") -> tuple[int, int, int]:
    """(key/value heads, key width, value width) a multi-head latent attention layer caches per token.

    ``kept="latent"``: the compressed latent ``c_KV`` (``kv_lora_rank``) and the decoupled rotary key
    (``qk_rope_head_dim``), ``(d_c + d_h^R)`` elements per token and layer (DeepSeek-V2, section 2.1.3 and
    Table 1); transformers 5 caches these as a one-head key and value (``DeepseekV3Attention.forward``,
    ``models/deepseek_v3/modeling_deepseek_v3.py``). ``kept="expanded"``: per-head keys of
    ``qk_nope_head_dim + qk_rope_head_dim`` and values of ``v_head_dim``, what transformers 4 cached.
    """
    if kept == "latent":
        return 1, kv_lora_rank, qk_rope_head_dim
    if kept == "expanded":
        return num_heads, qk_nope_head_dim + qk_rope_head_dim, v_head_dim
    raise InvalidArgumentError(f"kept must be 'latent' or 'expanded', got {kept!r}")


def call_slots(spec: CacheSpec, *, batch: int, itemsize: int, before: int, after: int, earlier: int = 0,
               max_cache_len: "int | None" = None, encoder_tokens: int = 0, encoder_made: bool = False) -> list[Slot]:
    """The cache's tensors around one call that took it from ``before`` to ``after`` tokens, in the order
    the model writes them (layer by layer; keys before values; a state-space layer's convolution state
    before its recurrent state).

    ``earlier``: the tokens when the call before this one began (only sliding-window layers depend on it:
    what they hold before this call is what that call left). ``max_cache_len``: the length a static cache
    was allocated at (None: transformers' dynamic cache). ``encoder_tokens``: the encoder's tokens of an
    encoder-decoder model; ``encoder_made``: the call makes the encoder's output (a prefill that begins with
    the encoder's forward, as ``generate()`` runs it): then it is the first storage the call puts in the cache,
    absent when the call begins, else it is there throughout. ``itemsize`` is the keys', values' and
    convolution states' element size.
    """
    n = {k: as_count(k, v) for k, v in (("batch", batch), ("itemsize", itemsize), ("before", before),
                                        ("after", after), ("earlier", earlier), ("encoder_tokens", encoder_tokens))}
    if not n["earlier"] <= n["before"] <= n["after"]:
        raise InvalidArgumentError(f"the tokens must not shrink: earlier {earlier} <= before {before} <= after "
                                   f"{after}")
    static = None if max_cache_len is None else as_count("max_cache_len", max_cache_len, minimum=1)
    b, size, first = n["batch"], n["itemsize"], n["before"] == 0
    k_width = spec.kv_heads * spec.head_dim * size
    v_width = spec.kv_heads * (spec.value_head_dim or spec.head_dim) * size
    slots: list[Slot] = []
    # The encoder's output, handed back to every decoder call: made before the decoder's first layer writes.
    encoder_out = b * n["encoder_tokens"] * spec.encoder_hidden * size
    made = bool(encoder_made and spec.encoder_hidden)
    if made:
        slots.append(Slot("encoder output", 0, encoder_out, True))

    def attention(i: int, sliding: bool) -> None:
        if static is not None:  # StaticLayer / StaticSlidingWindowLayer: allocated whole by the first call
            length = min(static, spec.sliding_window) if sliding and spec.sliding_window else static
            held_before, held_after, renewed = (0 if first else length), length, first
        elif sliding:
            assert spec.sliding_window is not None
            w = spec.sliding_window
            held_before = 0 if first else sliding_kept_tokens(n["earlier"], n["before"] - n["earlier"], w)
            held_after = sliding_kept_tokens(n["before"], n["after"] - n["before"], w)
            renewed = n["after"] > n["before"]
        else:
            held_before, held_after, renewed = n["before"], n["after"], n["after"] > n["before"]
        keys = Slot(f"layer {i} keys", b * held_before * k_width, b * held_after * k_width, renewed)
        # DynamicLayer.update replaces self.keys before it concatenates the values; DynamicSlidingWindowLayer
        # concatenates both and only then replaces them, so its old keys live through the values' cat.
        held = keys.before if sliding and static is None else 0
        slots.extend([keys, Slot(f"layer {i} values", b * held_before * v_width, b * held_after * v_width,
                                 renewed, held)])

    def states(i: int) -> None:
        # LinearAttentionLayer.lazy_initialization: zeros of (batch, channels, conv_kernel) and zeros_like the
        # final recurrent state, written in place (copy_) by every later call.
        conv = b * spec.conv_channels * spec.conv_kernel * size
        rec = b * spec.recurrent_elements * (spec.recurrent_itemsize or size)
        for part, nbytes in (("convolution state", conv), ("recurrent state", rec)):
            slots.append(Slot(f"layer {i} {part}", 0 if first else nbytes, nbytes, first))

    for i, kind in enumerate(spec.layers):
        if kind in _LINEAR and not (kind in _ATTENTION and spec.attention_first):
            states(i)
        if kind in _ATTENTION:
            attention(i, kind in _SLIDING)
        if kind in _LINEAR and kind in _ATTENTION and spec.attention_first:
            states(i)
        if spec.cross_attention and kind != "none":
            # EncoderDecoderCache: the cross-attention keys and values over the encoder's tokens, written once
            # by the first decoder call (DynamicLayer.update from empty) and read by the later ones.
            cross_k, cross_v = b * n["encoder_tokens"] * k_width, b * n["encoder_tokens"] * v_width
            slots.append(Slot(f"layer {i} cross-attention keys", 0 if first else cross_k, cross_k, first))
            slots.append(Slot(f"layer {i} cross-attention values", 0 if first else cross_v, cross_v, first))
    if spec.encoder_hidden and not made:
        slots.append(Slot("encoder output", encoder_out, encoder_out, False))  # there before the call begins
    return slots


def bytes_at(slots: "list[Slot]", *, written: int, overlap: bool = False) -> int:
    """The cache inside a call, once it had made ``written`` of its new storages (in the slots' order).

    A slot the call renews holds its new bytes once written and its old ones until then; the others hold
    the same bytes throughout (written in place). ``overlap``: the moment is the making of the last of those
    ``written`` storages, while the one it replaces still lives (``torch.cat`` reads the old keys to make the
    new ones), so both count, and what that slot is ``held_with``.
    """
    as_count("written", written)
    total, seen, last = 0, 0, None
    for s in slots:
        if not s.renewed:
            total += s.after
            continue
        if seen < written:
            total += s.after
            last = s
        else:
            total += s.before
        seen += 1
    if overlap and last is not None:
        total += last.before + last.held_with
    return total


def cache_bytes(spec: CacheSpec, batch: int, tokens: int, *, itemsize: int = 2, added: int = 1,
                max_cache_len: "int | None" = None, encoder_tokens: int = 0) -> int:
    """Bytes of the cache when a call that added ``added`` tokens ends with ``tokens`` in it.

    ``added=tokens`` is the cache after a prefill of ``tokens`` tokens; the default, after a decode call
    (a sliding-window layer then holds ``min(tokens - 1, window - 1) + 1`` tokens). Other arguments as in
    :func:`call_slots`.
    """
    before = as_count("tokens", tokens) - as_count("added", added)
    if before < 0:
        raise InvalidArgumentError(f"added ({added}) cannot exceed tokens ({tokens})")
    slots = call_slots(spec, batch=batch, itemsize=itemsize, before=before, after=tokens,
                       earlier=before, max_cache_len=max_cache_len,
                       encoder_tokens=encoder_tokens)
    return sum(s.after for s in slots)
