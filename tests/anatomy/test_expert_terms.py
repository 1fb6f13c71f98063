"""A rank's share of the experts under expert parallelism (Switch Transformers §5.4, §2.2), against the arithmetic."""

from __future__ import annotations

import pytest

from memprof.anatomy.parallelism import Experts, Parallelism, expert_terms, rank_terms
from memprof.errors import InvalidArgumentError


def _by(terms):
    return {t.category: t for t in terms}


def test_experts_divided_by_ep_and_sharded_over_the_ranks_holding_the_same_experts():
    # 6.4e9 expert parameters over ep = 8, dp = 64 (8 ranks hold each expert set), mixed-precision AdamW at ZeRO
    # stage 1: weights 2 x 6.4e9 / 8 = 1.6e9 B and gradients the same, states 12 x 6.4e9 / (8 x 8) = 1.2e9 B.
    t = _by(expert_terms(Experts(6_400_000_000), Parallelism(ep=8, dp=64), zero_stage=1))
    assert (t["weights"].bytes, t["gradients"].bytes, t["optimizer_states"].bytes) == (1_600_000_000,) * 2 + (
        1_200_000_000,)
    assert t["weights"].divided_by == ("ep",) and t["weights"].not_divided_by == ("dp/ep",)
    assert t["optimizer_states"].divided_by == ("ep", "dp/ep")
    # Stage 3 and pp = 2: every state divided by 8 x 2 x 8 = 128: 16 x 6.4e9 / 128 = 8e8 B in all.
    t3 = expert_terms(Experts(6_400_000_000), Parallelism(ep=8, dp=64, pp=2))
    assert sum(x.bytes for x in t3) == 16 * 6_400_000_000 // 128 == 800_000_000


def test_the_all_to_all_buffers_of_one_dispatch():
    # T = 4096 tokens, k = 2, h = 4096, bf16, capacity factor 1.25: sends 8,192 rows, receives 1.25 x 8,192:
    # 2.25 x 8,192 x 4,096 x 2 B = 150,994,944 B.
    t = _by(expert_terms(Experts(1, top_k=2, receive_factor=1.25), Parallelism(ep=8), tokens=4096, hidden=4096))
    assert t["communication"].bytes == 150_994_944
    # Every rank's tokens on this one (ep = 8): 9 x 8,192 x 4,096 x 2 B.
    worst = _by(expert_terms(Experts(1, top_k=2, receive_factor=8), Parallelism(ep=8), tokens=4096, hidden=4096))
    assert worst["communication"].bytes == 9 * 8192 * 4096 * 2


def test_rank_terms_splits_dense_and_expert_parameters():
    # 10e9 parameters of which 8e9 in experts; dp = 16, ep = 4, stage 3, 16 B/param: dense 16 x 2e9 / 16 = 2e9 B,
    # experts 16 x 8e9 / (4 x 4) = 8e9 B.
    terms = rank_terms(10_000_000_000, Parallelism(dp=16, ep=4), experts=Experts(8_000_000_000))
    dense = [t for t in terms if not t.formula.startswith("experts")]
    experts = [t for t in terms if t.formula.startswith("experts")]
    assert sum(t.bytes for t in dense) == 2_000_000_000
    assert sum(t.bytes for t in experts) == 8_000_000_000
    # No experts: the same terms as before.
    assert rank_terms(10_000_000_000, Parallelism(dp=16)) == rank_terms(10_000_000_000, Parallelism(dp=16),
                                                                        experts=Experts(0))


def test_refusals():
    with pytest.raises(InvalidArgumentError, match="must divide dp"):
        expert_terms(Experts(1), Parallelism(ep=3, dp=8))
    with pytest.raises(InvalidArgumentError, match="receive_factor"):
        expert_terms(Experts(1, receive_factor=0.5), Parallelism(ep=2))
    with pytest.raises(InvalidArgumentError, match="Experts.params"):
        rank_terms(10, experts=Experts(11))
