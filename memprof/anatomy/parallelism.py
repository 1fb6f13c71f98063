"""One rank's memory under data, tensor, sequence and pipeline parallelism, term by term, each saying which degree
divides it.

Sources:

- Model states: ZeRO's Table I (Rajbhandari et al. 2019, "ZeRO", §5, arXiv 1910.02054): over ``N_d`` data-parallel
  ranks, stage 1 divides the optimizer states ``KΨ``, stage 2 also the gradients ``2Ψ``, stage 3 also the
  parameters ``2Ψ``. Tensor parallelism divides every state of the layers it splits by ``t`` (Shoeybi et al. 2019,
  "Megatron-LM", §3), and a pipeline of ``p`` stages holds ``1/p`` of the layers (Narayanan et al. 2021,
  "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §2.2), so ``Ψ`` below is
  ``Ψ / (t p)`` where the model's layers dominate its parameters.
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4,
  per layer: ``sbh(34 + 5as/h)`` unsplit (eq. 1); with tensor parallelism ``sbh(10 + 24/t + 5as/(ht))`` (eq. 2:
  the layer norms' inputs, the dropouts' masks and the attention and MLP inputs, ``10sbh``, are not divided);
  with sequence parallelism as well ``sbh(34/t + 5as/(ht))`` (eq. 3: every term divided by ``t``). Under 1F1B
  the first stage keeps ``p`` micro-batches in flight, each of ``L/p`` layers: ``L`` layers' worth (§4.2.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..errors import InvalidArgumentError
from ..units import round_half_away

__all__ = ["RankTerm", "rank_terms"]


@dataclass(frozen=True)
class RankTerm:
    """One term of a rank's memory: its category, bytes, formula, and the parallel degrees that divide it and those
    that do not."""

    category: str
    bytes: int
    formula: str
    divided_by: tuple[str, ...]
    not_divided_by: tuple[str, ...]


def rank_terms(num_params: int, *, dp: int = 1, tp: int = 1, pp: int = 1, zero_stage: int = 3,
               sequence_parallel: bool = False, param_bytes: int = 2, grad_bytes: int = 2, optimizer_bytes: int = 12,
               seq: "int | None" = None, batch: "int | None" = None, hidden: "int | None" = None,
               heads: "int | None" = None, layers: "int | None" = None, in_flight: "int | None" = None,
               flash: bool = False) -> tuple[RankTerm, ...]:
    """The model states of one rank (Table I over ``dp``, divided by ``tp * pp``) and, given the transformer's
    shape, its activations (Korthikanti et al. 2022, §4, 16-bit): ``in_flight`` micro-batches of ``layers / pp``
    layers (default ``pp``: 1F1B's first stage). ``flash`` drops the ``5as/h`` attention-score term, which fused
    attention does not keep."""
    for name, v in (("num_params", num_params), ("dp", dp), ("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "num_params" else 1):
            raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise InvalidArgumentError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    model = Fraction(num_params, tp * pp)
    terms = []
    for cat, per, stage, sym in (("weights", param_bytes, 3, "2Ψ"), ("gradients", grad_bytes, 2, "2Ψ"),
                                 ("optimizer_states", optimizer_bytes, 1, "KΨ")):
        sharded = zero_stage >= stage and dp > 1
        by = ("tp", "pp") + (("dp",) if sharded else ())
        terms.append(RankTerm(cat, round_half_away(model * per / (dp if sharded else 1)),
                              f"{sym} / ({' · '.join(by)})".replace("2Ψ", f"{per}Ψ").replace("KΨ", f"{per}Ψ"),
                              tuple(d for d in by if _degree(d, dp, tp, pp) > 1),
                              () if sharded or dp == 1 else ("dp",)))
    if None not in (seq, batch, hidden, heads, layers):
        assert seq is not None and batch is not None and hidden is not None and heads is not None and layers is not None
        s, b, h, a, t = seq, batch, hidden, heads, tp
        undivided: tuple[str, ...]
        scores = Fraction(0) if flash else Fraction(5 * a * s, h * t)
        if t == 1:
            per_layer, text, undivided = s * b * h * (34 + scores), "sbh(34 + 5as/h)", ()
        elif sequence_parallel:
            per_layer, text, undivided = s * b * h * (Fraction(34, t) + scores), "sbh(34/t + 5as/(ht))", ()
        else:
            per_layer, text, undivided = (s * b * h * (10 + Fraction(24, t) + scores), "sbh(10 + 24/t + 5as/(ht))",
                                          ("tp: the 10sbh of the norms' and blocks' inputs and dropout masks",))
        if flash:
            text = text.replace(" + 5as/h)", ")").replace(" + 5as/(ht))", ")")
        n = pp if in_flight is None else in_flight
        total = per_layer * Fraction(layers, pp) * n
        terms.append(RankTerm("activations", round_half_away(total),
                              f"{text} × L/p layers × {n} micro-batch(es) in flight",
                              (("tp",) if t > 1 else ()) + (("pp",) if pp > 1 else ()), undivided))
    return tuple(terms)


def _degree(name: str, dp: int, tp: int, pp: int) -> int:
    return {"dp": dp, "tp": tp, "pp": pp}[name]
