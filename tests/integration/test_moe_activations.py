"""MoE routers, MoE experts and Mamba mixers against their activation formulas
(memprof.anatomy.activations_moe), on real CPU training steps of tiny configurations (tests/moe_models.py).

The grouped_mm experts and the softmax/top-k routers are exact to the byte; where an implementation saves
more (gpt-oss's clamped gate, transformers' PyTorch selective scan) the gap is split into named causes that
add up to it, and nothing is left unexplained.
"""

import pytest
import torch

import memprof
from memprof.anatomy.activations_moe import mamba_layer_terms, moe_experts_terms, moe_router_terms

from tests.moe_models import build, train_steps

TOKENS, HIDDEN, EXPERTS, TOP_K = 16, 32, 4, 2  # batch 2 x sequence 8; hidden 32; 4 experts, top-2
PAIRS = TOKENS * TOP_K  # 32 token-expert pairs


def checks(name):
    model = build(name)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt) as prof:
        train_steps(model, ids, steps=1, opt=opt)
    rec = memprof.reconcile(prof.report(), at=(0, "forward", "end"))
    return {c.path.rsplit(".", 1)[-1] if c.kind == "mamba" else c.kind: c for c in rec.layers}, rec


def test_the_formulas_term_by_term():
    # Router, softmax then top-k, renormalised, fp32: input 4*16*32 = 2048, probabilities 4*16*4 = 256,
    # indices 8*16*2 = 256, the k weights 4*16*2 = 128 and their sums 4*16 = 64.
    assert moe_router_terms(TOKENS, HIDDEN, EXPERTS, TOP_K, bytes_per_element=4) == {
        "router_input": 2048, "router_probs": 256, "topk_indices": 256, "topk_weights": 128, "topk_weight_sums": 64}
    # Experts, S = 32 pairs, F = 64: 16*32 = 512 indices, 4*32*32 = 4096 dispatched tokens, 4*4 = 16 offsets,
    # 4*32*4*64 = 32768 hidden (gate/up 2F, SiLU F, product F), 4096 output, 4*32 = 128 weights, 8*32 = 256.
    assert sum(moe_experts_terms(TOKENS, HIDDEN, EXPERTS, TOP_K, 64, bytes_per_element=4).values()) == (
        512 + 4096 + 16 + 32768 + 4096 + 128 + 256)
    # Mamba, d = 64, N = 4, R = 4, fp32: 4*16*(32 + 128 + 64 + 12 + 64 + 64 + 64) = 27392.
    assert sum(mamba_layer_terms(TOKENS, HIDDEN, 64, 4, 4, bytes_per_element=4).values()) == 4 * 16 * 428


@pytest.mark.parametrize("name, ffn", [("mixtral", 64), ("qwen3_moe", 32), ("olmoe", 32), ("granitemoe", 32)])
def test_grouped_mm_experts_and_routers_are_exact(name, ffn):
    found, rec = checks(name)
    experts, router = found["moe_experts"], found["moe_router"]
    # The independent figure: the formula written out for this configuration (fp32, S = 32 pairs).
    assert experts.measured == 16 * PAIRS + 4 * PAIRS * HIDDEN + 4 * EXPERTS + 4 * PAIRS * 4 * ffn \
        + 4 * PAIRS * HIDDEN + 4 * PAIRS + 8 * PAIRS
    assert experts.gap == 0 and router.gap == 0 and not experts.causes and not router.causes
    assert "MoE and Mamba layers" in str(rec)


def test_a_router_whose_input_a_shared_expert_saved_first_names_it():
    found, _ = checks("qwen2_moe")
    router = found["moe_router"]
    # Qwen2-MoE's shared expert runs before the router and saves the MLP input (4*16*32 = 2048 B) first.
    assert router.gap == -2048 and router.causes[0][0] == "input saved first by another module"
    assert router.unexplained == 0 and found["moe_experts"].gap == 0


def test_gpt_oss_and_jamba_gaps_are_named_to_the_byte():
    found, _ = checks("gpt_oss")
    experts = found["moe_experts"]
    assert experts.gap > 0 and experts.unexplained == 0
    # Both projections gather a bias per pair: 2 x 8 B x 32 pairs = 512 B of int64 indices.
    assert dict((n, b) for n, b, _ in experts.causes)["expert biases"] == 512
    found, _ = checks("jamba")
    mamba = found["mamba"]
    assert mamba.formula.bytes == 4 * 16 * 428 and mamba.unexplained == 0
    named = dict((n, b) for n, b, _ in mamba.causes)
    # Jamba's dt, B and C RMSNorms (measured per module) and the reference scan's saves make up the gap.
    assert named["time-step, B and C norms"] > 0 and named["reference selective scan"] > 0
    assert found["moe_router"].gap == 0 and found["moe_experts"].gap == 0
