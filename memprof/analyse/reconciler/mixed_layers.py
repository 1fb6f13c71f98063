"""A dense transformer layer under torch.autocast held against Korthikanti et al.'s per-layer figure, the gap named.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.1, Eq. 1) count
``34sbh + 5as²b`` bytes per layer: 16-bit activations (2 B), a 4h GELU MLP, 1-byte dropout masks, layer norms
whose 16-bit inputs are all they keep. A Llama-style layer (HF ``modeling_llama.py``) under ``torch.autocast``
over fp32 weights saves other tensors; each difference, from the trace's facts (``trace.module_calls``: the
norms' and linears' input dtypes and shapes, which linears of one parent take one input, the rotary table):

========================================  =====================================================================
cause                                     bytes (each tensor rounded as the device's allocator rounds: R)
========================================  =====================================================================
autocast weight copies                    Σ R(2·in·out) over the layer's linears: autocast casts each fp32
                                          weight to 16 bits and the matmul saves the cast
                                          (``aten/src/ATen/autocast_mode.cpp``)
fp32 norm inputs and outputs              per norm with an fp32 input: R(4sbh) input + R(4sbh) normalised
                                          output + R(4sb) rstd, less the textbook's 2sbh (``LlamaRMSNorm``
                                          upcasts to float32 and multiplies the weight by the fp32 result)
separate 16-bit casts of one input        per group of linears of one parent on one fp32 input (q/k/v,
                                          gate/up): (n − 1)·R(2sbh); autocast's cache keeps weight casts, not
                                          activation casts, so each linear casts the input again
softmax in fp32                           R(4as²b) − 2as²b: ``softmax(..., dtype=float32)`` saves its fp32
                                          output; its 16-bit cast is saved by ·V (the textbook's dropout output)
no dropout                                − 2sbh, and − as²b with eager attention: the textbook's 1-byte masks,
                                          absent with p = 0
fused attention                           − 5as²b + R(4asb) + 2·R(8), in place of the softmax's and the
                                          probabilities' mask terms: a flash kernel keeps no s×s tensor, only
                                          an fp32 logsumexp and its philox seed and offset; its output is
                                          o_proj's input; with fewer key/value heads than heads the
                                          kernel takes K and V unexpanded: − 2·(2sbh − R(2sb·kv·d))
rotary embeddings                         2·R(4·numel(cos)): ``q * cos`` and ``rotate_half(q) * sin`` save the
                                          fp32 cos and sin tables (q needs no saving: the tables need no grad)
gated MLP                                 4·R(2sbF) − 16sbh: gate output (SiLU input), SiLU output, up output
                                          and their product (down's input), width F, against the textbook's GELU
                                          input and fc2 input of width 4h
allocator rounding                        R(x) − x of the tensors the textbook counts as they are (the q/k/v
                                          and gate/up inputs, Q, K, V, the 16-bit probabilities, o_proj's input)
========================================  =====================================================================

Whatever these do not name is ``unexplained``. :func:`mixed_layer_gap` recognises a layer with a norm over an fp32
input, a parent with three or more linears on one input (attention) and a parent with two linears on one input
and a third (a gated MLP), under autocast; other layers give None.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, NamedTuple

from ...anatomy.activations import transformer_layer_activations
from ...anatomy.shapes import LayerShape
from ...record.specs import ModuleCall
from ...record.trace import Trace, parent_path

__all__ = ["MixedLayerGap", "mixed_layer_gap", "TEXTBOOK_FORM"]

#: The textbook's per-layer form, as the table prints it.
TEXTBOOK_FORM = "34sbh + 5as²b (Korthikanti et al. 2022 §4.1, 16-bit)"


@dataclass(frozen=True)
class MixedLayerGap:
    """One layer's saved bytes, measured (or simulated) and the textbook's, and the gap's named causes
    (``(name, bytes, sentence)``, bytes signed as measured − textbook)."""

    path: str
    measured: "int | None"
    textbook: int
    causes: tuple[tuple[str, int, str], ...]
    #: s, b, h, a and the MLP width F the figures use.
    shape: tuple[tuple[str, int], ...]

    @property
    def gap(self) -> "int | None":
        return None if self.measured is None else self.measured - self.textbook

    @property
    def unexplained(self) -> "int | None":
        gap = self.gap
        return None if gap is None else gap - sum(b for _, b, _ in self.causes)


def _is(call: ModuleCall, name: str) -> bool:
    return any(c.rpartition(".")[2] == name for c in call.classes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _groups(linears: list[ModuleCall]) -> dict[tuple[str, tuple[tuple[int, ...], str]], list[ModuleCall]]:
    """Linears of one parent on one input (same shape and dtype): one tensor handed to each."""
    out: dict[tuple[str, tuple[tuple[int, ...], str]], list[ModuleCall]] = {}
    for c in linears:
        if c.inputs:
            out.setdefault((parent_path(c.path), (c.inputs[0].shape, c.inputs[0].dtype)), []).append(c)
    return out


def _fused(trace: Trace) -> bool:
    """Did attention run a fused kernel (its logsumexp saved, memprof's tag) rather than the eager softmax?"""
    forward = next((p for p in trace.phases if p.phase.value == "forward"), None)
    return forward is not None and dict(forward.tags_end).get("attention_logsumexp", 0) > 0


class _Layer(NamedTuple):
    """A Llama-style layer recognised in a run's module calls: its path, the calls inside it, its attention
    projections (q, k, v ...), its MLP's two input projections, its fp32 norms, the rotary embedding's call,
    and the dimensions b, s, h, a (heads), d (head dim) and f (the MLP's width)."""

    path: str
    inside: "list[ModuleCall]"
    linears: "list[ModuleCall]"
    attn: "list[ModuleCall]"
    mlp: "list[ModuleCall]"
    norms: "list[ModuleCall]"
    rot: "ModuleCall | None"
    b: int
    s: int
    h: int
    a: int
    d: int
    f: int
    q_out: int


def _recognise(trace: Trace) -> "_Layer | None":
    """The first Llama-style layer of the run whose inputs are fp32 (autocast above fp32 weights), or None."""
    calls = list(trace.module_calls)
    linears = [c for c in calls if _is(c, "Linear") and c.grad]
    groups = _groups(linears)
    attn = next((g for g in groups.values() if len(g) >= 3 and g[0].inputs[0].dtype == "float32"), None)
    if attn is None:
        return None
    layer = parent_path(parent_path(attn[0].path))
    inside = [c for c in calls if c.path.startswith(layer + ".")]
    norms = [c for c in inside if c.leaf and c.inputs and "norm" in c.path.rpartition(".")[2].lower()
             and c.inputs[0].dtype == "float32" and not _is(c, "Linear")]
    mlp = next((g for (parent, _), g in groups.items() if len(g) == 2 and parent.startswith(layer + ".")
                and g is not attn and g[0].inputs[0].dtype == "float32"), None)
    if not norms or mlp is None:
        return None
    shape = norms[0].inputs[0].shape
    if len(shape) != 3:
        return None
    b, s, h = shape
    rot = next((c for c in calls if "rotary" in c.path.rpartition(".")[2].lower() and c.output is not None), None)
    d = rot.output.shape[-1] if rot is not None and rot.output is not None else None
    q_out = dict(attn[0].config).get("out_features")
    if not isinstance(q_out, int) or not d:
        return None
    f = dict(mlp[0].config).get("out_features")
    if not isinstance(f, int):
        return None
    layer_linears = [c for c in linears if c.path.startswith(layer + ".")]
    return _Layer(layer, inside, layer_linears, attn, mlp, norms, rot, b, s, h, q_out // d, d, f, q_out)


def _attention_causes(trace: Trace, L: _Layer, R: "Callable[[int], int]",
                      dropped: bool) -> "list[tuple[str, int, str]]":
    """What the layer's attention keeps beside the textbook's 5as²b: a fused kernel's logsumexp (and grouped
    key/value heads), or the eager path's fp32 softmax (and no dropout mask)."""
    s, b, h, a, d = L.s, L.b, L.h, L.a, L.d
    sbh, as2b = s * b * h, a * s * s * b
    causes = []
    if _fused(trace):
        # A fused kernel (flash: aten._scaled_dot_product_flash_attention) saves its output, which is o_proj's
        # input (the textbook's out_proj_input), a logsumexp and its philox seed and offset: no s x s tensor.
        causes.append(("fused attention", -5 * as2b + R(4 * a * s * b) + 2 * R(8),
                       "the fused attention kernel keeps no s×s scores, masks or probabilities (the textbook's "
                       "5as²b); it saves an fp32 logsumexp per head and position and its 8-byte philox seed and "
                       "offset"))
        kv = dict(L.attn[1].config).get("out_features")
        if isinstance(kv, int) and kv < L.q_out:
            # The kernel takes the key/value heads as they are (enable_gqa): K and V of kv_heads, not a heads.
            causes.append(("grouped-query attention", -2 * (2 * sbh - R(2 * s * b * kv)),
                           f"the fused kernel reads {kv // d} key/value heads as they are (enable_gqa), where the "
                           f"textbook's K and V have all {a} heads"))
    else:
        causes.append(("softmax in fp32", R(4 * as2b) - 2 * as2b,
                       "the attention softmax runs in float32 (dtype=torch.float32) and saves its fp32 output; its "
                       "16-bit cast, saved by the product with V, is the textbook's dropout output"))
        if dropped:
            causes.append(("no dropout: attention mask", -as2b,
                           "no attention dropout: the textbook's 1-byte mask of the probabilities is not kept"))
    return causes


def mixed_layer_gap(trace: Trace) -> "MixedLayerGap | None":
    """The first Llama-style layer of a run under autocast, held against ``34sbh + 5as²b``; None when the run
    is not under autocast or no layer of that form is recognised."""
    if trace.autocast_dtype is None:
        return None
    L = _recognise(trace)
    if L is None:
        return None
    s, b, h, a, f = L.s, L.b, L.h, L.a, L.f
    r = trace.device.rounding or 1

    def R(x: int) -> int:
        return -(-x // r) * r

    sbh, sb, as2b = s * b * h, s * b, a * s * s * b
    textbook = transformer_layer_activations(LayerShape(s, b, h, a))
    copies = sum(R(2 * dict(c.config)["in_features"] * dict(c.config)["out_features"]) for c in L.linears)
    causes = [("autocast weight copies", copies,
               "torch.autocast casts each fp32 weight to 16 bits per use and the matmul saves the cast for backward "
               f"(2 B per parameter of the layer's {len(L.linears)} linears)")]
    causes.append(("fp32 norm inputs and outputs",
                   sum(2 * R(4 * _numel(n.inputs[0].shape)) + R(4 * _numel(n.inputs[0].shape[:-1])) - 2 * sbh
                       for n in L.norms),
                   f"{len(L.norms)} RMSNorms upcast to float32 (transformers' LlamaRMSNorm): each saves its fp32 "
                   "input, its fp32 normalised output and the rstd, where the textbook keeps a 16-bit input"))
    extra = len(L.attn) - 1 + len(L.mlp) - 1
    causes.append(("separate 16-bit casts of one input", extra * R(2 * sbh),
                   f"{', '.join(c.path.rpartition('.')[2] for c in L.attn + L.mlp)} each cast their fp32 input to 16 "
                   "bits and save the cast: autocast caches weight casts, not activation casts, so q/k/v keep 3 "
                   "copies and gate/up 2 where the textbook counts one each"))
    dropped = not any(_is(c, "Dropout") and dict(c.config).get("p") for c in L.inside)
    causes += _attention_causes(trace, L, R, dropped)
    if dropped:
        causes.append(("no dropout", -2 * sbh,
                       "no dropout: the textbook's 1-byte masks of the attention and MLP outputs (sbh each) are "
                       "not kept"))
    rot = L.rot
    if rot is not None and rot.output is not None:
        causes.append(("rotary embeddings", 2 * R(4 * _numel(rot.output.shape)),
                       "q·cos and rotate_half(q)·sin save the fp32 cos and sin tables (the rotary factors of the "
                       "queries and keys are shared)"))
    causes.append(("gated MLP", 4 * R(2 * sb * f) - 16 * sbh,
                   f"a gated MLP of width {f} saves the gate's output, SiLU's output, the up projection's output "
                   f"and their product; the textbook's 4h GELU MLP saves the GELU input and fc2 input (8sbh each)"))
    rounding = 5 * (R(2 * sbh) - 2 * sbh) + (0 if _fused(trace) else R(2 * as2b) - 2 * as2b)
    if rounding:
        causes.append(("allocator rounding", rounding,
                       f"tensors the textbook counts as they are, each rounded up to {r} B by the allocator"))
    measured = next((m.activations for m in trace.modules if m.path == L.path), None)
    return MixedLayerGap(L.path, measured, int(Fraction(textbook)), tuple(c for c in causes if c[1]),
                         (("s", s), ("b", b), ("h", h), ("a", a), ("F", f)))
