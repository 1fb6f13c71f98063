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
- Experts: Fedus et al. 2021, "Switch Transformers" (arXiv 2101.03961). §5.4 (expert and data parallelism): the
  ``E`` experts of a layer are split over ``ep`` ranks, ``E/ep`` whole experts each, and the tokens travel to their
  expert's rank and back by all-to-all; the dense layers stay data-parallel. So the experts' parameters ``Ψ_e``,
  their gradients and optimizer states are divided by ``ep`` (and by ``pp``), and ZeRO shards them over the ranks
  that hold the same experts, ``dp/ep`` of them, where the expert ranks are carved out of the data-parallel ones
  (DeepSpeed-MoE and torchtitan do so). §2.2: expert capacity = tokens per batch / experts x capacity factor
  ``c``, so a rank receives ``c`` times its even share of token rows, ``T k / ep`` from each rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..errors import InvalidArgumentError
from ..units import round_half_away
from .shapes import LayerShape, Parallelism

__all__ = ["RankTerm", "Parallelism", "Precision", "Experts", "LayerShape", "rank_terms", "expert_terms"]


@dataclass(frozen=True)
class RankTerm:
    """One term of a rank's memory: its category, bytes, formula, and the parallel degrees that divide it and those
    that do not."""

    category: str
    bytes: int
    formula: str
    divided_by: tuple[str, ...]
    not_divided_by: tuple[str, ...]


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each state: ``param_bytes``, ``grad_bytes`` and ``optimizer_bytes`` per parameter (ZeRO's
    2, 2 and K = 12 of mixed-precision Adam), and ``act_bytes`` per element of the activations an all-to-all moves."""

    param_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes: int = 12
    act_bytes: int = 2


@dataclass(frozen=True)
class Experts:
    """A model's experts (Switch Transformers): ``params`` parameters in experts, each token routed to ``top_k`` of
    them, ``moe_layers`` MoE layers' all-to-all buffers held at once per stage (None: one), and the
    ``receive_factor`` c of the rows a rank receives over its even share (1 under balanced routing)."""

    params: int
    top_k: "int | None" = None
    moe_layers: "int | None" = None
    receive_factor: float = 1.0


_ONE = Parallelism()
_MIXED = Precision()


def rank_terms(num_params: int, parallel: Parallelism = _ONE, *, zero_stage: int = 3, precision: Precision = _MIXED,
               shape: "LayerShape | None" = None, layers: "int | None" = None, in_flight: "int | None" = None,
               flash: bool = False, experts: "Experts | None" = None) -> tuple[RankTerm, ...]:
    """The model states of one rank (Table I over ``dp``, divided by ``tp * pp``) and, given the transformer's
    layer ``shape`` and ``layers``, its activations (Korthikanti et al. 2022, §4, eq. 1-3: multi-head attention, a
    4h MLP, 16-bit): ``in_flight`` micro-batches of ``layers / pp`` layers (default ``pp``: 1F1B's first stage).
    ``flash`` drops the ``5as/h`` attention-score term, which fused attention does not keep. With ``experts`` (their
    parameters a share of ``num_params``), the dense terms hold the rest and :func:`expert_terms` follows them (the
    all-to-all term needs the shape and ``top_k``)."""
    if experts is not None:
        expert_params = experts.params
        if (isinstance(expert_params, bool) or not isinstance(expert_params, int)
                or not 0 <= expert_params <= num_params):
            raise InvalidArgumentError(f"Experts.params must be an int in [0, num_params], got {expert_params!r}")
        if expert_params:
            dense = rank_terms(num_params - expert_params, parallel, zero_stage=zero_stage, precision=precision,
                               shape=shape, layers=layers, in_flight=in_flight, flash=flash)
            tokens = shape.seq_len * shape.batch if shape is not None else None
            return dense + expert_terms(experts, parallel, zero_stage=zero_stage, precision=precision, tokens=tokens,
                                        hidden=shape.hidden if shape is not None else None)
    dp, tp, pp = parallel.dp, parallel.tp, parallel.pp
    for name, v in (("num_params", num_params), ("dp", dp), ("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "num_params" else 1):
            raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
    _check_stage(zero_stage)
    model = Fraction(num_params, tp * pp)
    terms = []
    for cat, per, stage, sym in (("weights", precision.param_bytes, 3, "2Ψ"),
                                 ("gradients", precision.grad_bytes, 2, "2Ψ"),
                                 ("optimizer_states", precision.optimizer_bytes, 1, "KΨ")):
        sharded = zero_stage >= stage and dp > 1
        by = ("tp", "pp") + (("dp",) if sharded else ())
        terms.append(RankTerm(cat, round_half_away(model * per / (dp if sharded else 1)),
                              f"{sym} / ({' · '.join(by)})".replace("2Ψ", f"{per}Ψ").replace("KΨ", f"{per}Ψ"),
                              tuple(d for d in by if _degree(d, dp, tp, pp) > 1),
                              () if sharded or dp == 1 else ("dp",)))
    if shape is not None and layers is not None:
        if shape.ffn_hidden is not None or shape.kv_heads is not None:
            raise InvalidArgumentError("rank_terms' activations are Korthikanti et al.'s eq. 1-3 (multi-head "
                                       "attention, a 4h MLP): for ffn_hidden or kv_heads use "
                                       "transformer_layer_activations")
        terms.append(_activations(shape, layers, in_flight, flash, parallel))
    return tuple(terms)


def _check_stage(zero_stage: int) -> None:
    if zero_stage not in (0, 1, 2, 3):
        raise InvalidArgumentError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")


def _activations(shape: LayerShape, layers: int, in_flight: "int | None", flash: bool,
                 parallel: Parallelism) -> RankTerm:
    """Korthikanti et al. 2022, §4: eq. 1 unsplit, eq. 2 under tensor parallelism, eq. 3 with sequence parallelism."""
    s, b, h, a, t, pp = shape.seq_len, shape.batch, shape.hidden, shape.heads, parallel.tp, parallel.pp
    undivided: tuple[str, ...]
    scores = Fraction(0) if flash else Fraction(5 * a * s, h * t)
    if t == 1:
        per_layer, text, undivided = s * b * h * (34 + scores), "sbh(34 + 5as/h)", ()
    elif parallel.sequence_parallel:
        per_layer, text, undivided = s * b * h * (Fraction(34, t) + scores), "sbh(34/t + 5as/(ht))", ()
    else:
        per_layer, text, undivided = (s * b * h * (10 + Fraction(24, t) + scores), "sbh(10 + 24/t + 5as/(ht))",
                                      ("tp: the 10sbh of the norms' and blocks' inputs and dropout masks",))
    if flash:
        text = text.replace(" + 5as/h)", ")").replace(" + 5as/(ht))", ")")
    n = pp if in_flight is None else in_flight
    total = per_layer * Fraction(layers, pp) * n
    return RankTerm("activations", round_half_away(total), f"{text} × L/p layers × {n} micro-batch(es) in flight",
                    (("tp",) if t > 1 else ()) + (("pp",) if pp > 1 else ()), undivided)


def _degree(name: str, dp: int, tp: int, pp: int) -> int:
    return {"dp": dp, "tp": tp, "pp": pp}[name]


def expert_terms(experts: Experts, parallel: Parallelism, *, zero_stage: int = 3, precision: Precision = _MIXED,
                 tokens: "int | None" = None, hidden: "int | None" = None) -> tuple[RankTerm, ...]:
    """One rank's share of the experts (Switch Transformers §5.4): their weights, gradients and optimizer states
    divided by ``ep * pp``, and under ZeRO by the ``dp / ep`` ranks holding the same experts (``ep`` divides ``dp``:
    the expert ranks are carved out of the data-parallel ones). Given this rank's ``tokens`` (``seq * batch``),
    the experts' ``top_k`` and ``hidden``, the all-to-all buffers of one MoE layer's dispatch at ``act_bytes`` per
    element: the ``T k`` rows it sends and the ``c T k`` rows it receives, ``c`` the ``receive_factor`` (1 under
    balanced routing; a capacity factor, §2.2; ``ep`` when every rank's tokens reach this one), ``moe_layers`` such
    layers per stage held at once (default 1: one layer's buffers are freed before the next layer's)."""
    expert_params, ep, dp, pp = experts.params, parallel.ep, parallel.dp, parallel.pp
    for name, v in (("expert_params", expert_params), ("ep", ep), ("dp", dp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "expert_params" else 1):
            raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
    _check_stage(zero_stage)
    if dp > 1 and dp % ep:
        raise InvalidArgumentError(f"ep = {ep} must divide dp = {dp}: the expert ranks are carved out of the "
                                   "data-parallel ones, dp/ep of them holding the same experts")
    receive_factor = experts.receive_factor
    if not receive_factor >= 1:
        raise InvalidArgumentError(f"receive_factor must be at least 1 (an even share), got {receive_factor!r}")
    edp = max(dp // ep, 1)
    share = Fraction(expert_params, ep * pp)
    terms = []
    for cat, per, stage in (("weights", precision.param_bytes, 3), ("gradients", precision.grad_bytes, 2),
                            ("optimizer_states", precision.optimizer_bytes, 1)):
        sharded = zero_stage >= stage and edp > 1
        by = ("ep", "pp") + (("dp/ep",) if sharded else ())
        terms.append(RankTerm(cat, round_half_away(share * per / (edp if sharded else 1)),
                              f"experts: {per}Ψ_e / ({' · '.join(by)})",
                              tuple(d for d, n in (("ep", ep), ("pp", pp), ("dp/ep", edp if sharded else 1)) if n > 1),
                              () if sharded or edp == 1 else ("dp/ep",)))
    top_k = experts.top_k
    if tokens is not None and top_k is not None and hidden is not None:
        rows = tokens * top_k
        n = 1 if experts.moe_layers is None else experts.moe_layers
        c = Fraction(receive_factor).limit_denominator(10_000)
        terms.append(RankTerm("communication", round_half_away((1 + c) * rows * hidden * precision.act_bytes * n),
                              f"all-to-all dispatch: (1 + c)·T·k·h·b, c = {float(c):g}, × {n} MoE layer(s)",
                              (), ("ep: each rank sends its T·k rows and receives c·T·k whatever ep is",)))
    return tuple(terms)
