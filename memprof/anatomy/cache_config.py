"""A model's cache, read from its transformers-style config: the :class:`~memprof.anatomy.caches.CacheSpec`
the cache formulas take.

The layer kinds are read as transformers' ``get_layer_types_and_kwargs`` (``cache_utils.py``) reads them:
the config's ``layer_types`` (Gemma 3, gpt-oss, Qwen3-Next, and the hybrids' ``layers_block_type``), else
sliding-window attention where a ``sliding_window`` (or chunked attention's ``attention_chunk_size``) is set,
else full attention; "moe" and "mlp" layers, and layers reusing another layer's keys, keep nothing. Jamba's
``attn_layer_period`` / ``attn_layer_offset`` and Bamba's ``attn_layer_indices`` place attention layers
among state-space ones when a config (a plain dict) has no ``layer_types``.

State-space layers are sized as each family's mixer allocates its states; a family memprof does not know
gives no spec (no formula rather than a wrong one). Works on config objects and on plain dicts.
"""

from __future__ import annotations

import math
from typing import Callable, TypedDict

from ..errors import is_interrupt
from .caches import CacheSpec, latent_attention_dims

__all__ = ["cache_spec"]

_KINDS = {"full_attention": "full_attention", "attention": "full_attention", "sliding_attention": "sliding_attention",
          "chunked_attention": "sliding_attention", "linear_attention": "linear_attention", "mamba": "linear_attention",
          "hybrid": "hybrid", "hybrid_sliding": "hybrid_sliding", "moe": "none", "mlp": "none", "dummy": "none"}
# The convolution and recurrent state of each family's mixer, as transformers 5 allocates them.
_MAMBA1 = ("the convolution state (d_inner, d_conv) and SSM state (d_inner, d_state) of each sequence: Gu & Dao "
           "2023, 'Mamba' (arXiv 2312.00752); transformers models/mamba/modeling_mamba.py MambaMixer")
_MAMBA2 = ("the convolution state (d_inner + 2 n_groups d_state, d_conv) and SSM state (n_heads, head_dim, d_state) "
           "of each sequence: Dao & Gu 2024, 'Transformers are SSMs' (arXiv 2405.21060); transformers "
           "models/mamba2/modeling_mamba2.py Mamba2Mixer")
_DELTA = ("the convolution state (2 n_k d_k + n_v d_v, d_conv) and state (n_v, d_k, d_v) of each sequence: Yang, "
          "Kautz, Hatamizadeh 2024, 'Gated Delta Networks' (arXiv 2412.06464); transformers "
          "models/qwen3_next/modeling_qwen3_next.py Qwen3NextGatedDeltaNet")
_FP32_STATE = 4  # the scans compute the state in float32 (mamba_selective_scan, mamba2_chunk_scan, the delta rule)

#: Reads one field of a config by name; None where it has none. What it returns is what the config holds.
Reader = Callable[[str], object]


class _Fields(TypedDict, total=False):
    """The keyword arguments of :class:`CacheSpec` the parts of a config give."""

    layers: tuple[str, ...]
    kv_heads: int
    head_dim: int
    value_head_dim: "int | None"
    sliding_window: "int | None"
    conv_channels: int
    conv_kernel: int
    recurrent_elements: int
    recurrent_itemsize: "int | None"
    attention_first: bool
    kept: str
    source: str


def cache_spec(config: object) -> "CacheSpec | None":
    """The cache a model with this config keeps, or None where memprof cannot size it (no config, a layer
    kind or state-space family it does not know). ``config`` is a transformers config object or a plain dict,
    read by field name."""
    if config is None:
        return None
    if _reader(config)("is_encoder_decoder") is True:
        # Read as it is: transformers' get_text_config(decoder=True) rewrites a flat encoder-decoder config.
        return _encoder_decoder(_reader(config))
    get_text = _get(config, "get_text_config")
    if callable(get_text):
        try:
            config = get_text(decoder=True)
        except TypeError as failure:  # an older signature without ``decoder``
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            config = get_text()
        except Exception as failure:  # a config that cannot say: read it as it is
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            pass
    read = _reader(config)
    layers = _int(read, "num_hidden_layers", "n_layer", "num_layers")
    if layers is None:
        return None
    kinds = _layer_kinds(read, layers)
    if kinds is None:
        return None
    spec: _Fields = {"layers": kinds, "source": "transformers cache_utils.py (DynamicCache, StaticCache)"}
    kept = []
    for wanted, part in (({"full_attention", "sliding_attention", "hybrid", "hybrid_sliding"}, _attention),
                         ({"linear_attention", "hybrid", "hybrid_sliding"}, _states)):
        if wanted & set(kinds):
            found = part(read)
            if found is None:
                return None
            kept.append(found.pop("kept", "keys and values per token"))
            spec.update(found)
    if {"sliding_attention", "hybrid_sliding"} & set(kinds):
        window = _int(read, "sliding_window", "attention_chunk_size")
        if window is None:
            return None
        spec["sliding_window"] = window
    spec["kept"] = "; ".join(kept)
    return CacheSpec(**spec)


def _get(config: object, name: str) -> object:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def _reader(config: object) -> Reader:
    def read(name: str) -> object:
        try:
            return _get(config, name)
        except Exception as failure:  # a property that raises on this config (an inconsistent attribute map)
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            return None
    return read


def _int(read: Reader, *names: str) -> "int | None":
    for n in names:
        v = read(n)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _layer_kinds(read: Reader, layers: int) -> "tuple[str, ...] | None":
    types = read("layer_types") or read("layers_block_type")
    if types is None:
        period, offset = _int(read, "attn_layer_period"), _int(read, "attn_layer_offset")
        indices = read("attn_layer_indices")
        if period is not None and offset is not None:  # Jamba
            types = ["full_attention" if i % period == offset else "linear_attention" for i in range(layers)]
        elif isinstance(indices, (list, tuple)):  # Bamba
            types = ["full_attention" if i in indices else "linear_attention" for i in range(layers)]
        elif read("sliding_window") is not None:
            types = ["sliding_attention"] * layers
        elif read("attention_chunk_size") is not None:
            types = ["chunked_attention"] * layers
        else:
            types = ["full_attention"] * layers
    if not isinstance(types, (list, tuple)) or any(t not in _KINDS for t in types):
        return None
    kinds = [_KINDS[t] for t in types][:layers]
    sharing = read("kv_sharing_modes")
    if isinstance(sharing, (list, tuple)):  # layers reusing another layer's keys keep none of their own
        kinds = ["none" if mode == "reuse" else k for k, mode in zip(kinds, sharing)]
    return tuple(kinds)


def _attention(read: Reader) -> "_Fields | None":
    heads = _int(read, "num_attention_heads", "n_head", "num_heads")
    if heads is None:
        return None
    if _int(read, "kv_lora_rank") is not None:
        rank, rope, nope, v_head = (_int(read, n) for n in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                             "v_head_dim"))
        if rank is None or rope is None or nope is None or v_head is None:
            return None
        kv_heads, k_dim, v_dim = latent_attention_dims(num_heads=heads, kv_lora_rank=rank, qk_rope_head_dim=rope,
                                                       qk_nope_head_dim=nope, v_head_dim=v_head, kept="latent")
        return {"kv_heads": kv_heads, "head_dim": k_dim, "value_head_dim": v_dim,
                "kept": "the multi-head latent attention latent (kv_lora_rank) and rotary key (qk_rope_head_dim) "
                        "per token: DeepSeek-V2 section 2.1.3; transformers models/deepseek_v3/"
                        "modeling_deepseek_v3.py DeepseekV3Attention"}
    kv_heads = _int(read, "num_key_value_heads", "num_kv_heads", "multi_query_group_num") or heads
    if read("multi_query") is True and not read("new_decoder_architecture"):
        kv_heads = 1  # Falcon's multi-query attention: one key/value head whatever num_kv_heads says
    head_dim = _int(read, "head_dim", "attention_head_dim")
    hidden = _int(read, "hidden_size", "n_embd", "d_model")
    if head_dim is None and hidden is not None:
        head_dim = hidden // heads
    if head_dim is None:
        return None
    return {"kv_heads": kv_heads, "head_dim": head_dim}


def _states(read: Reader) -> "_Fields | None":
    if (_int(read, "number_of_conv_states") or 1) > 1:
        return None  # several states per layer (LinearAttentionLayer's number_of_states): not sized here
    hidden = _int(read, "hidden_size", "d_model")
    if _int(read, "linear_key_head_dim") is not None:  # gated delta rule (Qwen3-Next)
        nk, dk, nv, dv, conv = (_int(read, n) for n in ("linear_num_key_heads", "linear_key_head_dim",
                                                         "linear_num_value_heads", "linear_value_head_dim",
                                                         "linear_conv_kernel_dim"))
        if nk is None or dk is None or nv is None or dv is None or conv is None:
            return None
        return {"conv_channels": 2 * nk * dk + nv * dv, "conv_kernel": conv, "recurrent_elements": nv * dk * dv,
                "recurrent_itemsize": _FP32_STATE, "kept": _DELTA}
    d_state = _int(read, "mamba_d_state", "state_size")
    d_conv = _int(read, "mamba_d_conv", "conv_kernel")
    expand = _int(read, "mamba_expand", "expand")
    heads = _int(read, "mamba_n_heads", "n_mamba_heads") or (
        _int(read, "num_heads") if read("model_type") == "mamba2" else None)
    if d_state is None or d_conv is None or hidden is None:
        return None
    inner = _int(read, "mamba_d_ssm") or (expand * hidden if expand is not None else None)
    if heads is None:  # Mamba-1 (Mamba, Falcon-Mamba, Jamba): a state per channel
        inner = _int(read, "intermediate_size") if read("model_type") in ("mamba", "falcon_mamba") else inner
        if inner is None:
            return None
        return {"conv_channels": inner, "conv_kernel": d_conv, "recurrent_elements": inner * d_state,
                "recurrent_itemsize": _FP32_STATE, "kept": _MAMBA1}
    groups = _int(read, "mamba_n_groups", "mamba_ngroups", "n_groups")
    head_dim = read("mamba_d_head")
    if read("model_type") == "mamba2":
        head_dim = _int(read, "head_dim")
    if inner is None or groups is None:
        return None
    if not isinstance(head_dim, int) or isinstance(head_dim, bool):  # "auto": the inner width over the heads
        head_dim = inner // heads
    return {"conv_channels": inner + 2 * groups * d_state, "conv_kernel": d_conv,
            "recurrent_elements": heads * head_dim * d_state, "recurrent_itemsize": _FP32_STATE,
            "attention_first": read("model_type") != "falcon_h1", "kept": _MAMBA2}


def _encoder_decoder(read: Reader) -> "CacheSpec | None":
    layers = _int(read, "num_decoder_layers", "decoder_layers", "num_layers", "num_hidden_layers")
    heads = _int(read, "decoder_attention_heads", "num_heads", "num_attention_heads")
    hidden = _int(read, "d_model", "hidden_size")
    if layers is None or heads is None or hidden is None:
        return None
    head_dim = _int(read, "d_kv", "head_dim") or hidden // heads
    kv_heads = _int(read, "decoder_num_key_value_heads", "num_key_value_heads") or heads
    if math.prod((layers, kv_heads, head_dim)) == 0:
        return None
    return CacheSpec(layers=("full_attention",) * layers, kv_heads=kv_heads, head_dim=head_dim, cross_attention=True,
                     encoder_hidden=hidden,
                     kept="self-attention keys and values per decoder token, cross-attention keys and values per "
                          "encoder token, and the encoder's output",
                     source="transformers cache_utils.py EncoderDecoderCache")
