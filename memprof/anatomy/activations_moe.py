"""Saved-activation formulas for mixture-of-experts blocks and Mamba (selective state-space) mixers.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.1) count a
transformer layer's saved tensors term by term; these are the same kind of terms for the two layer types
their paper does not cover. With ``T`` the layer's tokens (``s·b``), ``h`` the hidden size, ``E`` experts,
``k`` experts per token, ``S = k·T`` token-expert pairs, ``F`` an expert's intermediate width, ``e`` the
element size of the activations:

* :func:`moe_layer_terms` -- the router (Shazeer et al. 2017, "Outrageously Large Neural Networks", §2.1:
  a linear layer, a softmax and a top-k) and the experts as transformers 5 runs them by default
  (``grouped_mm_experts_forward`` in ``transformers/integrations/moe.py``: sort the pairs by expert,
  gather the tokens, two grouped matmuls, weight and restore the order). Checked against what autograd
  saves on CPU (torch 2.13, transformers 5.24) to the byte (``tests/integration/test_moe_activations.py``).
* :func:`mamba_layer_terms` -- what the fused Mamba kernel keeps for backward (Gu & Dao 2023, "Mamba:
  Linear-Time Sequence Modeling with Selective State Spaces", §3.3.2: the states are recomputed in
  backward, never stored; ``MambaInnerFn.forward`` in ``mamba_ssm/ops/selective_scan_interface.py``
  saves ``xz``, the convolution's output, ``x_dbl``, ``delta``, and the scan's output).

The derivations are in ``docs/anatomy.md#moe-and-mamba-layers``. :func:`recognised_layers` finds these
layers among a trace's recorded module calls and gives each its formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Sequence

from ..errors import UnknownNameError
from ..units import as_count

if TYPE_CHECKING:
    from ..record.specs import ModuleCall

__all__ = ["ROUTERS", "moe_router_terms", "moe_experts_terms", "moe_layer_terms", "mamba_layer_terms",
           "LayerFormula", "recognised_layers"]

#: Bytes of an int64 index (topk's indices, the sort's permutation) and of an fp32 score.
INDEX_BYTES, SCORE_BYTES = 8, 4

#: The routers of transformers 5.24 by what they compute: ``"softmax_topk"`` (softmax over the experts in
#: fp32, then top-k of the probabilities; Mixtral always renormalises the k weights, the Qwen MoE and OLMoE
#: routers when ``norm_topk_prob``) and ``"topk_softmax"`` (top-k of the logits, then a softmax over the k:
#: gpt-oss in the logits' dtype, Granite-MoE in fp32). Keyed by class name; a router not listed is measured,
#: not predicted.
ROUTERS: dict[str, tuple[str, "bool | str", "int | None"]] = {
    # class name: (family, renormalised (or the config key saying so), bytes of the k scores (None: e))
    "MixtralTopKRouter": ("softmax_topk", True, SCORE_BYTES),
    "Qwen2MoeTopKRouter": ("softmax_topk", "norm_topk_prob", SCORE_BYTES),
    "Qwen3MoeTopKRouter": ("softmax_topk", "norm_topk_prob", SCORE_BYTES),
    "OlmoeTopKRouter": ("softmax_topk", "norm_topk_prob", SCORE_BYTES),
    "JambaTopKRouter": ("softmax_topk", False, SCORE_BYTES),
    "GptOssTopKRouter": ("topk_softmax", False, None),
    "GraniteMoeTopKRouter": ("topk_softmax", False, SCORE_BYTES),
}


def moe_router_terms(tokens: int, hidden: int, experts: int, top_k: int, *, family: str = "softmax_topk",
                     renormalised: bool = True, bytes_per_element: int = 2,
                     score_bytes: "int | None" = SCORE_BYTES) -> dict[str, Fraction]:
    """A router's saved bytes term by term.

    ``router_input`` e·T·h (the linear's input, for its weight gradient: the layer's MLP input, Korthikanti's
    ``mlp_input``); ``"softmax_topk"``: ``router_probs`` 4·T·E (the fp32 softmax output), ``topk_indices``
    8·T·k, and when renormalised ``topk_weights`` 4·T·k and ``topk_weight_sums`` 4·T (the division saves
    both operands); ``"topk_softmax"``: ``topk_indices`` 8·T·k and ``topk_softmax_output`` (score bytes)·T·k.
    """
    t, h, n, k, e = (as_count(name, v) for name, v in (("tokens", tokens), ("hidden", hidden),
                                                        ("experts", experts), ("top_k", top_k),
                                                        ("bytes_per_element", bytes_per_element)))
    terms = {"router_input": Fraction(e * t * h)}
    if family == "softmax_topk":
        terms["router_probs"] = Fraction(SCORE_BYTES * t * n)
        terms["topk_indices"] = Fraction(INDEX_BYTES * t * k)
        if renormalised:
            terms["topk_weights"] = Fraction(SCORE_BYTES * t * k)
            terms["topk_weight_sums"] = Fraction(SCORE_BYTES * t)
    elif family == "topk_softmax":
        terms["topk_indices"] = Fraction(INDEX_BYTES * t * k)
        terms["topk_softmax_output"] = Fraction((e if score_bytes is None else score_bytes) * t * k)
    else:
        raise UnknownNameError(f"unknown router family {family!r}; use 'softmax_topk' or 'topk_softmax'")
    return terms


def moe_experts_terms(tokens: int, hidden: int, experts: int, top_k: int, expert_ffn: int, *,
                      gated: bool = True, bytes_per_element: int = 2,
                      weight_bytes: int = SCORE_BYTES) -> dict[str, Fraction]:
    """The experts' saved bytes term by term (transformers' ``grouped_mm`` path), with ``S = k·T`` pairs.

    ``dispatch_indices`` 16·S (the gathers by ``perm // k`` and ``perm`` keep their int64 indices),
    ``dispatched_tokens`` e·S·h (the gathered input of the first grouped matmul), ``expert_offsets`` 4·E
    (int32), ``expert_hidden`` e·S·4F gated (the gate/up output 2F, which SiLU and the product keep, the
    SiLU output F and the product F, the second matmul's input: Korthikanti's SwiGLU ``4·e·sbF`` over S
    pairs) or e·S·2F ungated, ``expert_output`` e·S·h (kept by the weighting product), ``combine_weights``
    (weight bytes)·S (the routing weights, kept by the same product) and ``combine_indices`` 8·S (the
    inverse permutation's gather).
    """
    t, h, n, k, f, e = (as_count(name, v) for name, v in (
        ("tokens", tokens), ("hidden", hidden), ("experts", experts), ("top_k", top_k),
        ("expert_ffn", expert_ffn), ("bytes_per_element", bytes_per_element)))
    s = t * k
    return {
        "dispatch_indices": Fraction(2 * INDEX_BYTES * s),
        "dispatched_tokens": Fraction(e * s * h),
        "expert_offsets": Fraction(4 * n),
        "expert_hidden": Fraction(e * s * f * (4 if gated else 2)),
        "expert_output": Fraction(e * s * h),
        "combine_weights": Fraction(weight_bytes * s),
        "combine_indices": Fraction(INDEX_BYTES * s),
    }


def moe_layer_terms(tokens: int, hidden: int, experts: int, top_k: int, expert_ffn: int, *,
                    family: str = "softmax_topk", renormalised: bool = True, gated: bool = True,
                    bytes_per_element: int = 2) -> dict[str, Fraction]:
    """One MoE block (router and experts, no shared expert): :func:`moe_router_terms` and
    :func:`moe_experts_terms` together. Against a dense SwiGLU MLP of width F (Korthikanti's ``mlp_input``
    + ``mlp_hidden`` = e·sbh + 4·e·sbF) the expert activations grow with k, not with E."""
    return {**moe_router_terms(tokens, hidden, experts, top_k, family=family, renormalised=renormalised,
                               bytes_per_element=bytes_per_element),
            **moe_experts_terms(tokens, hidden, experts, top_k, expert_ffn, gated=gated,
                                bytes_per_element=bytes_per_element)}


def mamba_layer_terms(tokens: int, hidden: int, inner: int, state: int, dt_rank: int, *,
                      bytes_per_element: int = 2) -> dict[str, Fraction]:
    """A Mamba mixer's saved bytes as the fused kernel keeps them (Gu & Dao 2023, §3.3.2; ``MambaInnerFn``),
    with ``d`` the inner width (expand·h) and ``N`` the state size:

    ``in_proj_input`` e·T·h, ``in_proj_output`` e·T·2d (``xz``: the convolution's input and the gate z),
    ``conv_output`` e·T·d (the scan's input u), ``x_dbl`` e·T·(R + 2N) (the time-step rank R and B, C),
    ``delta`` e·T·d, ``scan_output`` e·T·d and ``out_proj_input`` e·T·d. The states (T·d·N) are never
    stored: the kernel recomputes them in backward.
    """
    t, h, d, n, r, e = (as_count(name, v) for name, v in (
        ("tokens", tokens), ("hidden", hidden), ("inner", inner), ("state", state), ("dt_rank", dt_rank),
        ("bytes_per_element", bytes_per_element)))
    return {
        "in_proj_input": Fraction(e * t * h),
        "in_proj_output": Fraction(e * t * 2 * d),
        "conv_output": Fraction(e * t * d),
        "x_dbl": Fraction(e * t * (r + 2 * n)),
        "delta": Fraction(e * t * d),
        "scan_output": Fraction(e * t * d),
        "out_proj_input": Fraction(e * t * d),
    }


@dataclass(frozen=True)
class LayerFormula:
    """A recognised layer of a recorded forward: its module path, kind (``"moe_router"``,
    ``"moe_experts"``, ``"mamba"``), formula terms and what the formula assumes about it."""

    path: str
    kind: str
    terms: tuple[tuple[str, int], ...]
    assumes: str
    config: tuple[tuple[str, object], ...] = ()

    @property
    def bytes(self) -> int:
        return sum(v for _, v in self.terms)

    def term(self, name: str) -> int:
        return dict(self.terms).get(name, 0)


_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 4)


def _rounded(terms: dict[str, Fraction]) -> tuple[tuple[str, int], ...]:
    return tuple((name, int(v)) for name, v in terms.items())


def recognised_layers(calls: Sequence["ModuleCall"]) -> tuple[LayerFormula, ...]:
    """The MoE routers, MoE experts and Mamba mixers among the grad-enabled calls of a recorded forward,
    each with its formula. Recognised by what transformers records on them: a router by its class
    (:data:`ROUTERS`), experts by the attributes ``use_experts_implementation`` gives them (``has_gate``,
    ``num_experts``) and their three inputs (tokens, top-k indices, top-k weights), a Mamba mixer by its
    ``ssm_state_size``, ``intermediate_size`` and ``time_step_rank``."""
    out = []
    for call in calls:
        if not call.grad or not call.inputs:
            continue
        cfg = dict(call.config)
        name = call.classes[0].rpartition(".")[2] if call.classes else ""
        x = call.inputs[0]
        e = _itemsize(x.dtype)
        if name in ROUTERS and "top_k" in cfg and "num_experts" in cfg:
            family, norm, score = ROUTERS[name]
            renorm = bool(cfg.get(norm, False)) if isinstance(norm, str) else norm
            hidden = x.shape[-1]
            tokens = _numel(x.shape) // hidden
            terms = moe_router_terms(tokens, hidden, cfg["num_experts"], cfg["top_k"], family=family,
                                     renormalised=renorm, bytes_per_element=e, score_bytes=score)
            out.append(LayerFormula(call.path, "moe_router", _rounded(terms),
                                    f"{family.replace('_', ' then ')} router"
                                    + (", the k weights renormalised" if renorm else ""), call.config))
        elif "has_gate" in cfg and "num_experts" in cfg and len(call.inputs) >= 3:
            hidden = x.shape[-1]
            ffn = next((cfg[key] for key in ("intermediate_dim", "intermediate_size", "expert_dim")
                        if isinstance(cfg.get(key), int)), None)
            if ffn is None:
                continue
            tokens, top_k = _numel(x.shape) // hidden, call.inputs[1].shape[-1]
            terms = moe_experts_terms(tokens, hidden, cfg["num_experts"], top_k, ffn, gated=bool(cfg["has_gate"]),
                                      bytes_per_element=e, weight_bytes=_itemsize(call.inputs[2].dtype))
            out.append(LayerFormula(call.path, "moe_experts", _rounded(terms),
                                    "transformers' grouped_mm experts (the default experts implementation)",
                                    call.config))
        elif all(key in cfg for key in ("ssm_state_size", "intermediate_size", "time_step_rank")):
            hidden = x.shape[-1]
            terms = mamba_layer_terms(_numel(x.shape) // hidden, hidden, cfg["intermediate_size"],
                                      cfg["ssm_state_size"], cfg["time_step_rank"], bytes_per_element=e)
            out.append(LayerFormula(call.path, "mamba", _rounded(terms),
                                    "the fused selective-scan kernel, which recomputes the states in backward",
                                    call.config))
    return tuple(out)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
