"""The plan's expert-parallel layouts of a mixture-of-experts config: ``fsdp-ep{E}``, the model's own EP plan
(transformers' ``apply_expert_parallelism``) under FSDP2 as torchtitan lays EP over FSDP's ranks. The function a row
runs is simulated to the byte against the same function on real tensors on torch's fake process group (routed
the balanced way the plan assumes, every peer routing alike); a row is the estimate at its answer."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import memprof
from memprof import Category as C
from memprof.errors import InvalidArgumentError

from ep_models import BalancedTopk, PeersLikeThisRank
from phases import assert_equal_everywhere, phase_records

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.distributed.expert_parallel")

from memprof.anatomy.gpus import GpuSpec  # noqa: E402
from memprof.cli import main  # noqa: E402
from memprof.report.planning import plan_grid  # noqa: E402
from memprof.simulate import hf  # noqa: E402
from memprof.simulate.hf_experts import ep_fsdp  # noqa: E402
from memprof.simulate.layouts import choose_layouts  # noqa: E402

LAYERS, EXPERTS, HIDDEN, MOE_FFN, VOCAB = 2, 8, 32, 16, 64
# A Qwen3-MoE small enough to run for real, as test_expert_parallel_hf builds it.
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=VOCAB,
                 hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=MOE_FFN, num_hidden_layers=LAYERS,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=EXPERTS,
                 num_experts_per_tok=2, max_position_embeddings=64)
MIXTRAL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=VOCAB, hidden_size=HIDDEN,
               intermediate_size=MOE_FFN, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
               num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=64)
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             max_position_embeddings=256)
IDS = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))


def _folder(tmp_path, config, name="model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _model(tmp_path, config, name):
    return hf.build_model(hf.load_config(_folder(tmp_path, config, name))).model


def test_ep_layouts_of_moe_configs(tmp_path):
    qwen, mixtral = _model(tmp_path, QWEN3_MOE, "qwen"), _model(tmp_path, MIXTRAL, "mixtral")
    # 8 experts per MoE layer: the degrees above 1 dividing both the ranks and the experts.
    assert [lay.name for lay in choose_layouts(qwen, 4, "ep")] == ["fsdp-ep2", "fsdp-ep4"]
    assert [lay.name for lay in choose_layouts(mixtral, 8, "ep")] == ["fsdp-ep2", "fsdp-ep4", "fsdp-ep8"]
    assert [lay.name for lay in choose_layouts(mixtral, 6, "ep")] == ["fsdp-ep2"]  # 3 and 6 do not divide 8
    ep4 = {lay.name: lay for lay in choose_layouts(qwen, 8, "all")}["fsdp-ep4"]
    assert ep4.options["mesh"] == {"dp": 2, "ep": 4, "tp": 1} and ep4.policy is not None  # mixed: the FSDP2 policy
    with pytest.raises(InvalidArgumentError, match=r"unknown layout 'fsdp-ep3' for 6 rank\(s\) \(expert-parallel "
                                                   r"layouts .* 6 rank\(s\) allow 2\)"):
        choose_layouts(mixtral, 6, "fsdp-ep3")
    llama = _model(tmp_path, LLAMA, "llama")
    with pytest.raises(InvalidArgumentError, match="no expert-parallel layout for 4 rank.*LlamaForCausalLM has no "
                                                   "expert-parallel plan"):
        choose_layouts(llama, 4, "ep")
    assert "fsdp-ep2" not in [lay.name for lay in choose_layouts(llama, 4, "all")]


def _real():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = {k: v for k, v in QWEN3_MOE.items() if k not in ("architectures", "model_type")}
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**config))


def _loss(out):
    return out.loss


def _measured(fn, world: int, rank: int, mesh: dict):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        model = fn(_real(), init_device_mesh("cpu", tuple(mesh.values()), mesh_dim_names=tuple(mesh)))
        opt = torch.optim.AdamW(model.parameters())
        with memprof.profile(model, opt) as prof, BalancedTopk(), PeersLikeThisRank():
            for _ in range(2):
                loss = _loss(model(input_ids=IDS, labels=IDS))
                loss.backward()
                opt.step()
                opt.zero_grad()
            del loss
        return prof.report()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mixed", [False, True])
def test_the_ep_fsdp_function_is_simulated_to_the_byte(mixed):
    mesh = {"dp": 2, "ep": 2, "tp": 1}
    est = memprof.estimate(_real(), lambda ps: torch.optim.AdamW(ps), inputs={"input_ids": IDS, "labels": IDS},
                           loss_fn=_loss, world_size=4, rank=1, mesh=mesh, parallelize=ep_fsdp(mixed),
                           precision="fp32")
    rep = _measured(ep_fsdp(mixed), 4, 1, mesh)
    assert_equal_everywhere(est, rep)
    # The rank's fp32 shards at the end of the last step: the experts split 2 ways by expert then 2 by FSDP, every
    # other parameter 4 ways by FSDP (no padding: every dim 0 here divides 4).
    #   experts per layer: 8 x (gate_up 2 x 16 x 32 + down 32 x 16) = 12,288 -> 12,288 / 4
    #   the rest: embedding and untied head 2 x 64 x 32, per layer q 32 x 32, k, v 16 x 32, o 32 x 32, q/k norms
    #   16 each, router 8 x 32, 2 norms of 32; the final norm 32
    experts = LAYERS * EXPERTS * 3 * MOE_FFN * HIDDEN
    rest = 2 * VOCAB * HIDDEN + LAYERS * (32 * 32 + 2 * 16 * 32 + 32 * 32 + 2 * 16 + EXPERTS * 32 + 2 * 32) + 32
    assert experts + rest == sum(p.numel() for p in _real().parameters())
    end = phase_records(rep.trace)[(1, "optimizer", 0)].end
    assert end[C.WEIGHTS] == (experts + rest) * 4 // 4
    # 24 tokens x 2 picks = 48 rows sent, 24 from each of the 2 EP ranks received (balanced, peers alike).
    assert any("receives 48 token rows per MoE layer (24 from each of 2 EP ranks)" in n for n in est.notes)


SMALL_GPU = GpuSpec("small", capacity_bytes=900 * 2**20, compute_capability=(9, 0), context_bytes=0)


def test_an_ep_row_is_the_estimate_at_its_answer(tmp_path):
    folder = _folder(tmp_path, {**QWEN3_MOE, "vocab_size": 4096, "max_position_embeddings": 256})
    plan = plan_grid(folder, seq_len=64, gpu=SMALL_GPU, world_size=4, layouts="fsdp-ep2", precisions=["mixed"],
                     checkpointing=[False], alloc_conf="expandable_segments:True")
    (row,) = plan.rows
    assert (row.layout, row.precision, row.verified) == ("fsdp-ep2", "bf16-params", True) and row.max_batch_size >= 1
    assert any(n.startswith("expert-parallel layouts (fsdp-ep{E}") and "balanced assumption" in n for n in plan.notes)

    def estimate(b):
        return hf.estimate_hf(folder, seq_len=64, batch_size=b, precision="fp32", gpu=SMALL_GPU, world_size=4,
                              mesh={"dp": 2, "ep": 2, "tp": 1}, parallelize=ep_fsdp(mixed=True),
                              alloc_conf="expandable_segments:True")

    at = estimate(row.max_batch_size)
    assert (at.peak_bytes, at.device_peak, at.fits) == (row.peak_bytes, row.device_peak, True)
    assert {c.value: at.peak[c] for c in at.peak} == dict(row.breakdown)
    assert estimate(row.max_batch_size + 1).fits is False


def test_cli_ep_layouts(tmp_path, capsys):
    llama = _folder(tmp_path, LLAMA, "llama")
    assert main(["plan", "--hf", str(llama), "--seq-len", "8", "--gpu", "t4", "--world-size", "4",
                 "--layouts", "ep"]) == 1
    assert "no expert-parallel layout for 4 rank(s) (no expert-parallel layout: LlamaForCausalLM has no " \
           "expert-parallel plan" in capsys.readouterr().err
