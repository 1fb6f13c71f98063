"""Inference memory: the KV cache a decoder keeps while it generates.

Each attention layer caches a key and a value per token for every key/value head: two tensors of
(batch, kv_heads, tokens, head_dim) per layer, as transformers' caches store them
(``transformers/cache_utils.py``, ``DynamicLayer``) and as Pope et al. (2022), "Efficiently Scaling
Transformer Inference", count the cache (multi-query and grouped-query attention keep fewer key/value
heads than query heads). A sliding-window layer keeps at most the window's tokens.
"""

from __future__ import annotations

from ..units import as_count

__all__ = ["kv_cache_bytes"]


def kv_cache_bytes(layers: int, batch: int, tokens: int, kv_heads: int, head_dim: int, *,
                   bytes_per_element: int = 2, sliding_window: "int | None" = None) -> int:
    """Bytes of a KV cache holding ``tokens`` tokens: 2 x layers x batch x tokens x kv_heads x head_dim x bytes.

    ``kv_heads`` is the number of key/value heads (the query heads without grouped-query or multi-query
    attention). With ``sliding_window`` the tokens are capped at the window.
    ``kv_cache_bytes(32, 1, 4096, 32, 128)`` is 2 GiB (Llama-2-7B, bf16, one sequence of 4,096 tokens).
    """
    values = {"layers": layers, "batch": batch, "tokens": tokens, "kv_heads": kv_heads, "head_dim": head_dim,
              "bytes_per_element": bytes_per_element}
    n = {k: as_count(k, v) for k, v in values.items()}
    if sliding_window is not None:
        n["tokens"] = min(n["tokens"], as_count("sliding_window", sliding_window, minimum=1))
    return 2 * n["layers"] * n["batch"] * n["tokens"] * n["kv_heads"] * n["head_dim"] * n["bytes_per_element"]
