"""The parameter objects the closed forms share: a transformer layer's shape (:class:`LayerShape`) and a run's
parallel degrees (:class:`Parallelism`). Plain frozen records: each formula checks the fields it uses, as its
source defines them (Korthikanti et al. 2022 for the activations, ZeRO and Megatron-LM for a rank's states)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerShape", "Parallelism"]


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer's work (Korthikanti et al. 2022's s, b, h, a): ``seq_len`` tokens of ``batch``
    sequences through a layer of width ``hidden`` with ``heads`` attention heads; an MLP of width ``ffn_hidden``
    (None: 4 x hidden) and ``kv_heads`` key/value heads (grouped-query attention; None: ``heads``)."""

    seq_len: int
    batch: int
    hidden: int
    heads: int
    ffn_hidden: "int | None" = None
    kv_heads: "int | None" = None


@dataclass(frozen=True)
class Parallelism:
    """The parallel degrees of a run: ``dp`` data-parallel, ``tp`` tensor-parallel, ``pp`` pipeline and ``ep``
    expert-parallel ranks, and whether tensor parallelism splits the sequence too (``sequence_parallel``,
    Korthikanti et al. 2022, §4.2.2). A layer's activations depend on ``tp`` and ``sequence_parallel`` only (each
    data-parallel rank's batch is its own), the first pipeline stage's on ``pp`` too."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
