"""Expert parallelism of a transformers MoE, simulated: a tiny Qwen3-MoE from its config, its experts split by
transformers' own expert-parallel plan (``config.base_model_ep_plan``, applied with
``transformers.distributed.expert_parallel.apply_expert_parallelism``: ``Shard(0)`` expert weights and
``AllToAllEP``'s dispatch, whose counts travel by ``dist.all_to_all_single``). Against the same function on real
tensors on torch's fake process group, routed the same way and handed the counts peers that route alike send
(``ep_models``); every category at the peak and the end of every phase of both steps, to the byte."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import memprof
from memprof import Category as C

from ep_models import BalancedTopk, PeersLikeThisRank
from phases import assert_same_phases, phase_records

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.distributed.expert_parallel")

LAYERS, EXPERTS, HIDDEN, MOE_FFN = 2, 8, 32, 16
IDS = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))


def build():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=MOE_FFN,
        num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=EXPERTS,
        num_experts_per_tok=2, max_position_embeddings=64))


def expert_parallel(model, mesh):
    """transformers' own plan for the model, its wildcards expanded per layer."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    plan = {f"model.{key.replace('*', str(i))}": style
            for key, style in model.config.base_model_ep_plan.items() for i in range(LAYERS)}
    return apply_expert_parallelism(model, mesh["ep"], mesh["tp"], plan)


def loss_of(out):
    return out.loss


def measured(world: int, rank: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        model = expert_parallel(build(), init_device_mesh("cpu", (1, world), mesh_dim_names=("tp", "ep")))
        opt = torch.optim.AdamW(model.parameters())
        with memprof.profile(model, opt) as prof, BalancedTopk(), PeersLikeThisRank():
            for _ in range(2):
                loss = loss_of(model(input_ids=IDS, labels=IDS))
                loss.backward()
                opt.step()
                opt.zero_grad()
            del loss
        return prof.report()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("world", "rank"), [(2, 1), (4, 2)])
def test_transformers_expert_parallel_plan_is_simulated_to_the_byte(world, rank):
    est = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs={"input_ids": IDS, "labels": IDS},
                           loss_fn=loss_of, world_size=world, rank=rank, mesh={"tp": 1, "ep": world},
                           parallelize=expert_parallel)
    rep = measured(world, rank)
    assert_same_phases(est.trace, rep.trace)
    assert est.peak_bytes == rep.peak.total
    # The rank's experts: E/EP of each layer's gate_up (2 x 16 x 32) and down (32 x 16) projections, fp32:
    # 2 layers x (8/EP) x (1,024 + 512) x 4 B.
    experts = LAYERS * (EXPERTS // world) * (2 * MOE_FFN * HIDDEN + HIDDEN * MOE_FFN) * 4
    whole = sum(p.numel() * 4 for p in build().parameters())
    expert_whole = LAYERS * EXPERTS * 3 * MOE_FFN * HIDDEN * 4
    end = phase_records(rep.trace)[(1, "optimizer", 0)].end
    assert end[C.WEIGHTS] == whole - expert_whole + experts
    # 24 tokens x 2 picks = 48 rows sent, 48 / EP from each rank received.
    assert any(f"receives 48 token rows per MoE layer ({48 // world} from each of {world} EP ranks)" in n
               for n in est.notes)
