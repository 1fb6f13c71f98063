"""The plan's precisions: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (``bf16-params``) as a
row of its own, the default for ``mixed`` on a layout with FSDP2, autocast (``autocast``) its own row; a
``bf16-params`` row is the estimate of the user's ``fully_shard`` with that policy, to the byte."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from memprof.cli import main  # noqa: E402
from memprof.errors import InvalidArgumentError, UnknownNameError  # noqa: E402
from memprof.report.planning import plan_grid  # noqa: E402
from memprof.simulate import hf  # noqa: E402
from memprof.simulate.layouts import choose_layouts  # noqa: E402
from memprof.simulate.plan import configurations  # noqa: E402

from test_plan_hf import LLAMA3_8B, _folder  # noqa: E402  # Llama-3-8B's shape, written there: no download
from test_plan_layouts import SMALL_GPU, WIDE  # noqa: E402


def _names(model, world, layouts, precisions=("bf16", "mixed"), checkpointing=(False,)):
    configs, skipped = configurations(choose_layouts(model, world, layouts), precisions, checkpointing)
    return [(lay.name, p) for _, p, lay in configs], skipped


def test_the_8b_plan_rows_name_their_precision(tmp_path):
    model = hf.build_model(hf.load_config(_folder(tmp_path, LLAMA3_8B))).model
    # The default grid (dp layouts, bf16 and mixed): mixed is FSDP2's policy on fsdp, autocast on DDP and ZeRO.
    names, skipped = _names(model, 8, "dp")
    assert names == [("ddp", "bf16"), ("fsdp", "bf16"), ("zero1", "bf16"), ("zero2", "bf16"), ("zero3", "bf16"),
                     ("ddp", "autocast"), ("fsdp", "bf16-params"), ("zero1", "autocast"), ("zero2", "autocast"),
                     ("zero3", "autocast")] and skipped == []
    # Every layout: the FSDP x TP and pipeline-with-FSDP layouts take the policy; TP and pipeline alone do not
    # (TP has autocast; a pipeline's schedule runs none, so pp2-tp4 and pp4-tp2 have no mixed row, and say why).
    names, skipped = _names(model, 8, "fsdp,tp8,fsdp4-tp2,pp2-fsdp4,pp2-tp4", precisions=("mixed",))
    assert names == [("fsdp", "bf16-params"), ("tp8", "autocast"), ("fsdp4-tp2", "bf16-params"),
                     ("pp2-fsdp4", "bf16-params")]
    assert skipped == ["pp2-tp4 is planned in bf16, fp16, fp32 only, not in mixed: a pipeline's schedule runs no "
                       "autocast, and its mixed precision is FSDP2's MixedPrecisionPolicy (bf16-params), which needs "
                       "FSDP inside the stages"]
    # Asked by name: both on fsdp, each once however it is spelled; bf16-params is not planned where nothing
    # carries it.
    names, skipped = _names(model, 8, "ddp,fsdp", precisions=("bf16-params", "autocast", "mixed", "amp"))
    assert names == [("fsdp", "bf16-params"), ("ddp", "autocast"), ("fsdp", "autocast")]
    assert skipped == ["ddp is not planned in bf16-params: bf16-params is FSDP2's MixedPrecisionPolicy, which needs "
                       "fully_shard in the layout (its mixed row is autocast)"]
    with pytest.raises(InvalidArgumentError, match="no layout asked for is planned in bf16-params: ddp is not"):
        _names(model, 8, "ddp,zero3", precisions=("bf16-params",))
    with pytest.raises(UnknownNameError, match=r"unknown precision 'bf16-param' for a plan; use bf16, .*bf16-params"):
        _names(model, 8, "fsdp", precisions=("bf16-param",))


def _policy_fsdp(model, mesh):
    """The user's FSDP2 as torchtitan applies it: each decoder layer, then the root, under its default policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


@pytest.mark.parametrize("ckpt", [False, True])
def test_a_policy_row_is_the_estimate_of_fully_shard_with_the_policy(tmp_path, ckpt):
    folder = _folder(tmp_path, WIDE)
    plan = plan_grid(folder, seq_len=64, gpu=SMALL_GPU, world_size=2, layouts="fsdp", precisions=["mixed"],
                     checkpointing=[ckpt], alloc_conf="expandable_segments:True")
    (row,) = plan.rows
    assert (row.layout, row.precision, row.checkpointing) == ("fsdp", "bf16-params", ckpt)
    assert row.verified and row.max_batch_size >= 1
    assert any(n.startswith("precisions: bf16-params: FSDP2's MixedPrecisionPolicy(param_dtype=bf16, "
                            "reduce_dtype=fp32)") for n in plan.notes)

    def estimate(b):
        return hf.estimate_hf(folder, seq_len=64, batch_size=b, precision="fp32", checkpointing=ckpt, gpu=SMALL_GPU,
                              world_size=2, parallelize=_policy_fsdp, alloc_conf="expandable_segments:True")

    at = estimate(row.max_batch_size)
    assert (at.peak_bytes, at.device_peak, at.fits) == (row.peak_bytes, row.device_peak, True)
    assert {c.value: at.peak[c] for c in at.peak} == dict(row.breakdown)
    assert estimate(row.max_batch_size + 1).fits is False
    # The policy is the one FSDP2 ran: fp32 shards, bf16 gathers. WIDE's parameters: per layer q, o 256 x 256,
    # k, v 128 x 256, gate, up, down 512 x 256, 2 norms of 256 = 590,336; embedding and untied head 16,000 x 256
    # each, the final norm 256: 2 x 590,336 + 2 x 4,096,000 + 256 = 9,372,928, every dim 0 even (no padding).
    d = at.trace.distributed
    assert (d.world_size, d.layout) == (2, "fsdp2")
    assert d.sharded_bytes == 9_372_928 * 4 // 2  # fp32, half on each rank
    assert d.unsharded_bytes == 9_372_928 * 2  # gathered in bf16


def test_cli_precision_spellings(tmp_path, capsys):
    folder = _folder(tmp_path, {**WIDE, "max_position_embeddings": 2048})
    # The T4's 15 GiB hold many of these samples; one row each, its precision as the plan names it.
    base = ["plan", "--hf", str(folder), "--seq-len", "2048", "--gpu", "t4", "--world-size", "2", "--layouts", "fsdp",
            "--checkpointing", "on", "--json"]
    assert main([*base, "--precision", "bf16-params"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["parallel"], row["precision"]) == ("fsdp", "bf16-params") and row["verified"]
    assert main(["plan", "--hf", str(folder), "--seq-len", "2048", "--gpu", "t4", "--world-size", "2",
                 "--layouts", "ddp", "--precision", "bf16-params"]) == 1
    assert "ddp is not planned in bf16-params" in capsys.readouterr().err
    assert main([*base, "--precision", "banana"]) == 1
    err = capsys.readouterr().err
    assert "unknown precision 'banana'" in err and "bf16-params" in err and "autocast" in err


def test_a_layout_limited_to_some_precisions_says_which():
    from memprof.simulate.plan import Layout

    mine = Layout("mine", {"world_size": 2, "parallel": "ddp"}, precisions=("bf16",))
    configs, skipped = configurations([mine], ["bf16", "mixed-fp16", "bf16-params"], [False])
    assert [(lay.name, p) for _, p, lay in configs] == [("mine", "bf16")]
    assert skipped == ["mine is not planned in mixed-fp16, bf16-params: bf16-params is FSDP2's MixedPrecisionPolicy, "
                       "which needs fully_shard in the layout (its mixed row is autocast); it is planned in bf16 only"]
