"""MoE and Mamba layers held against their own formulas (:mod:`memprof.anatomy.activations_moe`).

The per-layer forms of Korthikanti et al. cover attention and a dense MLP; a mixture-of-experts block and
a Mamba mixer save other tensors. For each such layer of the recorded forward, :func:`layer_checks` gives
the formula term by term, the bytes measured under the module (itself and its submodules, each storage
once), and the gap split into named causes; what no cause names is "unexplained".
"""

from __future__ import annotations

from dataclasses import dataclass

from ...anatomy.activations_moe import INDEX_BYTES, LayerFormula, recognised_layers
from ...record.trace import Trace

__all__ = ["LayerCheck", "layer_checks"]


@dataclass(frozen=True)
class LayerCheck:
    """One recognised layer: its formula, what was measured under it, and the gap's named causes
    (``(name, bytes, sentence)``, bytes signed as measured − formula)."""

    formula: LayerFormula
    measured: "int | None"
    causes: tuple[tuple[str, int, str], ...]

    @property
    def path(self) -> str:
        return self.formula.path

    @property
    def kind(self) -> str:
        return self.formula.kind

    @property
    def gap(self) -> "int | None":
        return None if self.measured is None else self.measured - self.formula.bytes

    @property
    def unexplained(self) -> "int | None":
        gap = self.gap
        return None if gap is None else gap - sum(b for _, b, _ in self.causes)


def layer_checks(trace: Trace) -> tuple[LayerCheck, ...]:
    """Every MoE router, MoE experts module and Mamba mixer of the run's first forward, checked."""
    measured = {m.path: m.activations for m in trace.modules}
    below: dict[str, int] = {}
    for m in trace.modules:
        if m.activations is not None:
            below[m.path] = m.activations
    out = []
    for f in recognised_layers(trace.module_calls):
        got = measured.get(f.path)
        causes = [] if got is None else _causes(f, got, below)
        out.append(LayerCheck(f, got, tuple(c for c in causes if c[1])))
    return tuple(out)


def _causes(f: LayerFormula, got: int, below: dict[str, int]) -> list[tuple[str, int, str]]:
    gap = got - f.bytes
    cfg = dict(f.config)
    if f.kind == "moe_router":
        first = f.term("router_input")
        if gap == -first:
            return [("input saved first by another module", gap,
                     "the router's input is the layer's MLP input; a module called before the router (a shared "
                     "expert) saved it first, and memprof counts a storage once, where it was first saved")]
        return [("router computes otherwise", gap,
                 "this router saves other tensors than the formula's " + f.assumes)] if gap else []
    if f.kind == "moe_experts":
        out = []
        pairs = f.term("combine_indices") // INDEX_BYTES
        if cfg.get("has_bias"):
            bias = 2 * INDEX_BYTES * pairs
            out.append(("expert biases", bias,
                        "the per-pair bias gathers (bias[expert_ids]) of both projections keep their int64 indices"))
            gap -= bias
        if gap and "limit" in cfg and "alpha" in cfg:
            out.append(("clamped gate", gap,
                        "the experts' own gate (gpt-oss: clamp, gate·sigmoid(alpha·gate), (up + 1)) saves more "
                        "than SiLU(gate)·up"))
        elif gap:
            out.append(("another experts implementation", gap,
                        "the experts ran another implementation than grouped_mm (batched_mm gathers the weights "
                        "per pair; the per-expert loop saves per expert): measured, not predicted"))
        return out
    out = []
    norms = sum(v for p, v in below.items() if p.startswith(f.path + ".") and p.rpartition(".")[2] in (
        "dt_layernorm", "b_layernorm", "c_layernorm"))
    if norms:
        out.append(("time-step, B and C norms", norms,
                    "Jamba's RMSNorms of dt, B and C, which Mamba's fused kernel does not have"))
        gap -= norms
    if gap:
        out.append(("reference selective scan", gap,
                    "transformers' PyTorch selective scan (used when the mamba_ssm kernels are not installed) "
                    "keeps its intermediate products and states for backward; the fused kernel recomputes them"))
    return out
