"""A rank's terms under data, tensor, sequence and pipeline parallelism, against the papers' arithmetic."""

from __future__ import annotations

from memprof.anatomy.parallelism import LayerShape, Parallelism, rank_terms


def _by(terms):
    return {t.category: t for t in terms}


def test_table_one_over_dp_then_tp_and_pp():
    # 7.5B parameters, N_d = 64, stage 3, K = 12: (2 + 2 + 12) x 7.5e9 / 64 = 1.875e9 B (ZeRO Table I, 7.5B row).
    t = _by(rank_terms(7_500_000_000, Parallelism(dp=64)))
    assert t["weights"].bytes + t["gradients"].bytes + t["optimizer_states"].bytes == 16 * 7_500_000_000 // 64
    # Stage 1 divides only the states: 4 x 7.5e9 + 12 x 7.5e9 / 64.
    t1 = _by(rank_terms(7_500_000_000, Parallelism(dp=64), zero_stage=1))
    assert t1["weights"].not_divided_by == ("dp",) and t1["optimizer_states"].divided_by == ("dp",)
    assert sum(x.bytes for x in t1.values()) == 4 * 7_500_000_000 + 12 * 7_500_000_000 // 64
    # t = 8, p = 4 divide every state once more: 16 x 8.192e9 / (64 x 8 x 4) = 64,000,000 B.
    t2 = _by(rank_terms(8_192_000_000, Parallelism(dp=64, tp=8, pp=4)))
    assert sum(x.bytes for x in t2.values()) == 16 * 8_192_000_000 // (64 * 8 * 4) == 64_000_000
    assert t2["weights"].divided_by == ("tp", "pp", "dp")


def test_korthikanti_activations_with_and_without_sequence_parallelism():
    # GPT-3 175B's layer (Korthikanti et al. 2022, Table 3): s = 2048, b = 1, h = 12288, a = 96, t = 8, one layer.
    shape = dict(shape=LayerShape(2048, 1, 12288, 96), layers=1, in_flight=1)
    sbh = 2048 * 12288
    five_as_h = 5 * 96 * 2048 / 12288  # = 80
    plain = _by(rank_terms(1, **shape))["activations"]
    assert plain.bytes == sbh * (34 + 80) and five_as_h == 80
    tp = _by(rank_terms(1, Parallelism(tp=8), **shape))["activations"]
    assert tp.bytes == sbh * (10 + 3) + sbh * 10  # sbh(10 + 24/8 + 80/8)
    assert tp.not_divided_by and tp.not_divided_by[0].startswith("tp")
    sp = _by(rank_terms(1, Parallelism(tp=8, sequence_parallel=True), **shape))["activations"]
    assert sp.bytes * 8 == plain.bytes  # every term divided by t (eq. 3)
    assert sp.not_divided_by == ()
    # Fused attention keeps no s x s scores: the 5as/h term goes.
    assert _by(rank_terms(1, flash=True, **shape))["activations"].bytes == sbh * 34


def test_the_first_stage_of_1f1b_holds_p_micro_batches():
    # L = 8 layers over p = 4 stages, 1F1B: p micro-batches of L/p layers = L layers' worth (§4.2.3).
    one = _by(rank_terms(1, shape=LayerShape(64, 1, 64, 4), layers=8, in_flight=1))["activations"].bytes
    first = _by(rank_terms(1, Parallelism(pp=4), shape=LayerShape(64, 1, 64, 4), layers=8))["activations"].bytes
    assert first == one
