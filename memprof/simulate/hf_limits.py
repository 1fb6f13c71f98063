"""What a transformers config allows, checked before anything is built or simulated from it.

* :func:`check_sizes`: the sizes a model is built from (hidden size, heads, layers, vocabulary, experts ...)
  are positive ints, and the experts each token picks are no more than the experts there are. A zero or a
  negative size otherwise stops deep inside transformers or torch (a ``ZeroDivisionError``, a negative
  dimension, a negative ``len()``) or, worse, builds a model that simulates without complaint.
* :func:`sequence_limit` / :func:`check_sequence`: the most tokens a sequence may hold, as the config declares
  it (``max_position_embeddings`` and the other names configs use for it), extended by rope scaling where the
  config says how far (``factor x original_max_position_embeddings``; dynamic NTK scaling has no bound). A
  model with a learned position table (GPT-2's ``wpe``, OPT's, BART's, BERT's) raises past it; shape-only
  tensors never look up a position, so without this check a simulation happily plans sequences the model
  cannot take. A sliding window bounds how far attention looks back, never how long the input is, so it is
  no limit here.
* :func:`dtype_note`: what the default precision of a config is, in words that say the dtype actually used
  (a config saved as ``int8`` is built and simulated in fp32; a ``quantization_config`` is not applied).
"""

from __future__ import annotations

import re
from typing import TypeGuard

from ..errors import InvalidArgumentError, is_interrupt

__all__ = ["check_sizes", "check_counts_in_file", "sequence_limit", "check_sequence", "size_culprit", "config_dtype",
           "dtype_note", "quantization_note", "POSITIVE", "NON_NEGATIVE", "POSITION_FIELDS", "MOST"]

#: Sizes a model is built from that must be at least 1, in transformers' canonical names (a config's
#: ``attribute_map`` gives its own spelling: GPT-2's ``n_embd`` is ``hidden_size``) and the names configs
#: without such a map use for the same thing.
POSITIVE = ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "num_hidden_layers", "max_position_embeddings", "n_positions", "n_ctx", "n_inner",
            "d_model", "d_ff", "d_kv", "num_heads", "num_layers", "num_decoder_layers", "encoder_layers",
            "decoder_layers", "encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim",
            "decoder_ffn_dim", "ffn_dim", "word_embed_proj_dim", "num_experts_per_tok", "moe_intermediate_size",
            "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "max_seq_len",
            "seq_length", "max_sequence_length", "num_local_experts", "n_embd", "n_head", "n_layer")

#: Counts where 0 means "none" (Qwen2-MoE's ``num_experts=0`` is a dense model), never below it.
NON_NEGATIVE = ("num_experts", "n_routed_experts", "n_shared_experts",
                "shared_expert_intermediate_size", "num_nextn_predict_layers", "first_k_dense_replace")

#: Where configs declare the most tokens a sequence may hold, in the order they are read.
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "max_seq_len",
                   "seq_length")

_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")

#: Counts of repeated parts past which a config is refused rather than built: every layer is a module built one by
#: one (as transformers builds it), and the MoE rules keep per-expert token counts, so 2**31 layers or experts never
#: finish; the largest published models have a few hundred of either (Llama-3.1-405B: 126 layers; DeepSeek-V3: 61
#: layers, 256 routed experts), far below these.
MOST = {**dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers",
                         "decoder_layers"), (10_000, "layers (each is a module, built one by one)")),
        **dict.fromkeys(_EXPERTS, (65_536, "experts (its MoE rules count every expert's tokens)"))}


def _int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _spelled(config: object, name: str) -> str:
    """``name`` as the config's own file spells it (its ``attribute_map``: GPT-2's ``hidden_size`` is ``n_embd``)."""
    return str((getattr(config, "attribute_map", None) or {}).get(name, name))


def _fields(config: object, prefix: str = "") -> "list[tuple[str, str, object]]":
    """(canonical name, name as written with its sub-config's prefix, value) of the size fields of ``config`` and of
    its sub-configs (``text_config``, ``vision_config`` ...)."""
    out = []
    stored = vars(config)
    for name in POSITIVE + NON_NEGATIVE:
        if _spelled(config, name) not in stored and isinstance(getattr(type(config), name, None), property):
            # What the config's class computes rather than the file gives (XLNet's max_position_embeddings
            # answers -1, "no limit", and cannot be set): nothing config.json could fix; sequence_limit reads it.
            continue
        try:
            value = getattr(config, name, None)
        except Exception as exc:  # a property of the config that cannot answer: not a size this check can read
            if is_interrupt(exc):
                raise
            continue
        if value is not None:
            out.append((name, prefix + _spelled(config, name), value))
    from transformers import PretrainedConfig

    for attr, sub in sorted(vars(config).items()):
        if isinstance(sub, PretrainedConfig) and sub is not config:
            out.extend(_fields(sub, f"{prefix}{attr}."))
    return out


def check_sizes(config: object) -> None:
    """Refuse a config whose sizes cannot make a model: a size of :data:`POSITIVE` below 1, a count of
    :data:`NON_NEGATIVE` below 0 (each of them where the config gives one per layer), a non-integer where an int
    belongs, more layers or experts than :data:`MOST` allows, or more experts per token than experts."""
    seen = set()
    for name, spelled, value in _fields(config):
        if spelled in seen:
            continue
        seen.add(spelled)
        low = 1 if name in POSITIVE else 0
        # A size per layer (a list, as some configs give intermediate_size) holds each layer's to the same rule.
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        sizes = [v for v in values if _int(v)]
        if not values or len(sizes) != len(values) or any(v < low for v in sizes):
            kind = "a positive int" if low == 1 else "an int of 0 or more"
            raise InvalidArgumentError(f"the config's {spelled} is {value!r}; it must be {kind} (a size of the "
                                       f"model): fix {spelled} in config.json")
        most, what = MOST.get(name, (None, ""))
        if most is not None and max(sizes) > most:
            raise InvalidArgumentError(f"the config's {spelled} is {max(sizes):,}; memprof refuses more than {most:,} "
                                       f"{what} (the largest models have a few hundred): fix {spelled} in config.json")
    k = getattr(config, "num_experts_per_tok", None)
    for name in _EXPERTS:
        n = getattr(config, name, None)
        if _int(k) and _int(n) and n > 0 and k > n:
            raise InvalidArgumentError(f"the config's num_experts_per_tok {k} is more than its {name} {n}: each "
                                       f"token picks among the experts there are; set num_experts_per_tok to at "
                                       f"most {n}")


def check_counts_in_file(raw: object, prefix: str = "") -> None:
    """Refuse a config file's count of layers or experts above :data:`MOST` (in the file as written, its
    sub-configs too) before transformers builds the config: some config classes loop over their layers when made."""
    if not isinstance(raw, dict):
        return
    for key, value in raw.items():
        if isinstance(value, dict):
            check_counts_in_file(value, f"{prefix}{key}.")
            continue
        most, what = MOST.get(str(key), (None, ""))
        if most is not None and _int(value) and value > most:
            raise InvalidArgumentError(f"the config's {prefix}{key} is {value:,}; memprof refuses more than {most:,} "
                                       f"{what} (the largest models have a few hundred): fix {prefix}{key} in "
                                       "config.json")


def size_culprit(config: object, message: str) -> "str | None":
    """The config's size field a torch error's message names by value (``Storage size calculation overflowed with
    sizes=[4611686018427387904, 64]``: the field holding 4611686018427387904), else its largest size: the words
    that say which field to fix."""
    numbers = {int(n) for n in re.findall(r"-?\d{2,}", message)}
    fields = [(spelled, value) for _, spelled, value in _fields(config) if _int(value)]
    named = [(s, v) for s, v in fields if v in numbers and v > 1]
    if named:
        spelled, value = max(named, key=lambda f: f[1])
    elif fields:
        spelled, value = max(fields, key=lambda f: f[1])
    else:
        return None
    return f"{spelled} = {value:,}"


def _text_config(config: object) -> object:
    """The config that holds a multimodal model's language sizes (its ``text_config``), or the config itself."""
    get = getattr(config, "get_text_config", None)
    try:
        return get() if callable(get) else config
    except Exception as exc:  # an older transformers' signature, or a config with several text configs
        if is_interrupt(exc):
            raise
        return config


def _rope_reach(config: object, declared: int) -> "tuple[int | None, str]":
    """How far rope scaling extends ``declared`` positions: ``factor x original_max_position_embeddings`` where the
    config gives both (YaRN, llama3, linear with its original length), no bound for dynamic NTK scaling (it
    rescales for any length), else ``declared`` (transformers asks a config whose scaling extends the context to
    raise ``max_position_embeddings`` itself)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return declared, ""
    dicts = [v for v in params.values() if isinstance(v, dict)] or [params]  # one per layer type (Gemma 3)
    reach, why = declared, ""
    for rope in dicts:
        kind = str(rope.get("rope_type") or rope.get("type") or "default")
        if kind == "dynamic":
            return None, "dynamic rope scaling, which rescales for any length"
        factor = rope.get("factor")
        original = rope.get("original_max_position_embeddings",
                            getattr(config, "original_max_position_embeddings", None))
        if isinstance(factor, (int, float)) and not isinstance(factor, bool) and _int(original) and factor > 0:
            extended = int(factor * original)
            if extended > reach:
                reach, why = extended, (f"{kind} rope scaling: factor {factor:g} x original_max_position_embeddings "
                                        f"{original:,}")
    return reach, why


def sequence_limit(config: object) -> "tuple[int, str] | None":
    """The most tokens a sequence of the model ``config`` describes may hold and where that figure comes from, or
    None when the config declares no bound (T5's relative positions, BLOOM's ALiBi, Mamba, dynamic rope scaling)."""
    text = _text_config(config)
    for name in POSITION_FIELDS:
        value = getattr(text, name, None)
        if _int(value) and value > 0:
            reach, why = _rope_reach(text, value)
            if reach is None:
                return None
            return reach, why or f"the config's {_spelled(text, name)}"
    return None


def check_sequence(config: object, tokens: int, what: str = "seq_len") -> None:
    """Refuse ``tokens`` per sequence beyond :func:`sequence_limit`, naming ``what`` (the argument that set it)."""
    limit = sequence_limit(config)
    if limit is None or tokens <= limit[0]:
        return
    most, why = limit
    raise InvalidArgumentError(f"{what} {tokens:,} is beyond the {most:,} tokens per sequence this model takes "
                               f"({why}): a model with a learned position table raises past it, and the others were "
                               f"not built for it; give {what} of at most {most:,}, or a config that declares more "
                               "(max_position_embeddings, or rope scaling with factor and "
                               "original_max_position_embeddings)")


_PRECISIONS = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "half": "fp16", "fp16": "fp16",
               "float32": "fp32", "float": "fp32", "fp32": "fp32"}


def config_dtype(config: object) -> "str | None":
    """The dtype the config was saved in (``dtype``, formerly ``torch_dtype``) without torch's prefix, or None."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def default_precision(config: object) -> str:
    """The precision a config's own dtype names (bf16, fp16), fp32 for any other dtype or none."""
    return _PRECISIONS.get(config_dtype(config) or "float32", "fp32")


def dtype_note(config: object) -> str:
    """The note that says which precision the config's dtype gave, and the dtype actually simulated."""
    dtype = config_dtype(config)
    precision = default_precision(config)
    if dtype is None:
        return ("precision fp32: the config names no dtype, so the parameters stay fp32 as built (give precision= "
                "for another)")
    if dtype in _PRECISIONS:
        return f"precision {precision}: the config's dtype, {dtype} (give precision= for another)"
    return (f"precision fp32: the config's dtype is {dtype}, which is not a precision memprof simulates a training "
            "step in (fp32, bf16, fp16, mixed, mixed-fp16), so the parameters were simulated in fp32 as built, not "
            f"in {dtype} (give precision= for another)")


def quantization_note(config: object) -> "str | None":
    """What a config's ``quantization_config`` means for an estimate: it is not applied (``from_pretrained``'s
    quantizer replaces the layers; a model built from the config has full-width ones)."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    as_dict = quant if isinstance(quant, dict) else getattr(quant, "to_dict", lambda: {})()
    method = as_dict.get("quant_method", "") if isinstance(as_dict, dict) else ""
    bits = [k for k in ("load_in_8bit", "load_in_4bit") if isinstance(as_dict, dict) and as_dict.get(k)]
    what = ", ".join(str(x) for x in [method, *bits] if x) or type(quant).__name__
    return (f"the config's quantization_config ({what}) was not applied: the layers were built and simulated "
            "full-width, as the config's dtype or precision= says, not quantized")
