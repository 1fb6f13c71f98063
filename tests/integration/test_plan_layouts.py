"""The plan's grid on a small Llama: consistent across layouts and checkpointing, every answer confirmed against
the estimate itself (it fits, one sample more does not), and tensor-parallel layouts from the model's own TP plan
whose per-rank weights are the rank's local shards."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from memprof.anatomy.gpus import GpuSpec  # noqa: E402
from memprof.cli import main  # noqa: E402
from memprof.errors import InvalidArgumentError  # noqa: E402
from memprof.report.planning import plan_grid  # noqa: E402
from memprof.simulate import hf  # noqa: E402
from memprof.simulate.hf_layouts import tp_degrees  # noqa: E402
from memprof.simulate.layouts import choose_layouts  # noqa: E402

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=256)
WIDE = {**TINY, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 16000}
SMALL_GPU = GpuSpec("small", capacity_bytes=900 * 2**20, compute_capability=(9, 0), context_bytes=0)
LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 tie_word_embeddings=False, max_position_embeddings=8192)
ORDER = ("ddp", "zero1", "zero2")


def _folder(tmp_path, config, name="model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    folder = _folder(tmp_path_factory.mktemp("grid"), WIDE)
    # Expandable segments, as in test_plan_hf: on a 900 MiB device the default allocator's segment sizes decide
    # the fit within a sample; the consistency is about the layouts' own bytes.
    return folder, plan_grid(folder, seq_len=64, gpu=SMALL_GPU, world_size=2, layouts="dp", precisions=["bf16"],
                             alloc_conf="expandable_segments:True")


def test_the_grid_is_consistent(grid):
    _, plan = grid
    rows = {(r.layout, r.checkpointing): r for r in plan.rows}
    assert len(rows) == 10 and all(r.verified for r in plan.rows)
    for layout in ("ddp", "fsdp", *ORDER, "zero3"):  # checkpointing never lowers the largest batch
        assert rows[(layout, True)].max_batch_size >= rows[(layout, False)].max_batch_size, layout
    for ckpt in (False, True):
        assert rows[("fsdp", ckpt)].max_batch_size >= rows[("ddp", ckpt)].max_batch_size
        fits = [rows[(layout, ckpt)].max_batch_size for layout in ORDER]
        assert fits == sorted(fits), (ckpt, fits)  # zero2 >= zero1 >= ddp
    # ZeRO-3 against ZeRO-2 is not a law on 2 ranks of a model whose vocabulary weighs most: ZeRO-3's gathered
    # units cost more than its sharding saves (at batch 8, checkpointing off: 155,049,984 tensor bytes at the
    # peak against ZeRO-2's 146,857,472, both simulated), so it fits 8 samples where ZeRO-2 fits 11. Llama-3-8B
    # on 8 ranks has zero3 >= zero2 in every row (docs/benchmarks.md).


def test_every_answer_fits_and_one_more_does_not(grid):
    folder, plan = grid
    for row in plan.rows:
        if row.max_batch_size == 0:
            continue
        for b, fits in ((row.max_batch_size, True), (row.max_batch_size + 1, False)):
            est = hf.estimate_hf(folder, seq_len=64, batch_size=b, precision="bf16", checkpointing=row.checkpointing,
                                 gpu=SMALL_GPU, world_size=2, parallel=row.layout,
                                 alloc_conf="expandable_segments:True")
            assert est.fits is fits, (row.layout, row.checkpointing, b)
            if fits:
                assert (est.device_peak, est.peak_bytes) == (row.device_peak, row.peak_bytes)


def test_tp_layouts_divide_the_model(tmp_path):
    built = hf.build_model(hf.load_config(_folder(tmp_path, LLAMA3_8B)))
    # 32 heads, 8 key/value heads, MLP 14336, vocabulary 128256: 2, 4 and 8 divide them all.
    assert tp_degrees(built.model, 8) == [2, 4, 8]
    names = [lay.name for lay in choose_layouts(built.model, 8, "all")]
    assert names == ["ddp", "fsdp", "zero1", "zero2", "zero3", "fsdp4-tp2", "fsdp2-tp4", "tp8", "pp2-fsdp4",
                     "pp4-fsdp2", "pp2-fsdp2-tp2", "pp2-tp4",
                     "pp4-tp2"]  # and the pipeline layouts its 32 layers allow (test_plan_pipeline)
    # 3 ranks: no degree divides 32 heads.
    assert tp_degrees(built.model, 3) == []
    with pytest.raises(InvalidArgumentError, match="no tensor-parallel layout"):
        choose_layouts(built.model, 3, "tp3")
    # A degree that does not divide the ranks is named as the reason, not the model's sizes (8 divides them all).
    with pytest.raises(InvalidArgumentError, match="8 does not divide 3 rank"):
        choose_layouts(built.model, 3, "tp8")
    with pytest.raises(InvalidArgumentError, match="4 does not divide 6 rank"):
        choose_layouts(built.model, 6, "fsdp2-tp4")


def test_a_tp_row_holds_the_ranks_local_shards(tmp_path):
    folder = _folder(tmp_path, TINY)
    plan = plan_grid(folder, seq_len=32, gpu=SMALL_GPU, world_size=2, layouts="tp2,fsdp", precisions=["bf16"],
                     checkpointing=[False])
    rows = {r.layout: r for r in plan.rows}
    assert set(rows) == {"tp2", "fsdp"} and rows["tp2"].verified and rows["tp2"].max_batch_size >= 1
    # Rank 0's bf16 shards of TINY (hidden 64, 4 heads of 16, 2 key/value heads, MLP 128, vocab 256) over tp = 2,
    # each a CUDA block rounded up to 512 B (the caching allocator's smallest block):
    #   per layer: q 32x64 -> 4,096 B; k, v 16x64 -> 2,048 B each; o 64x32 -> 4,096 B;
    #              gate, up 64x64 -> 8,192 B each; down 64x64 -> 8,192 B; 2 norms of 64 -> 128 B, a 512 B block each
    #              = 4,096 + 2 x 2,048 + 4,096 + 3 x 8,192 + 2 x 512 = 37,888 B
    #   embedding rows 128x64 and lm_head columns 128x64 -> 16,384 B each; the final norm -> 512 B
    #   2 x 37,888 + 2 x 16,384 + 512 = 109,056 B
    #   (53,568 elements x 2 B = 107,136 B before rounding; the five norms' blocks add 5 x 384 B = 1,920 B)
    assert rows["tp2"].breakdown["weights"] == 109_056


def test_cli_layouts(tmp_path, capsys):
    # As test_plan_hf's CLI plan: long sequences of a wide vocabulary, so a T4 holds a few of them.
    folder = _folder(tmp_path, {**WIDE, "max_position_embeddings": 2048})  # a model that takes 2048 tokens
    assert main(["plan", "--hf", str(folder), "--seq-len", "2048", "--gpu", "t4", "--world-size", "2",
                 "--layouts", "tp", "--precision", "bf16", "--checkpointing", "on", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["parallel"] for r in rows] == ["tp2"] and rows[0]["verified"]
    assert main(["plan", "--hf", str(folder), "--seq-len", "8", "--gpu", "t4", "--world-size", "2",
                 "--layouts", "pp3"]) == 1
    assert "unknown layout 'pp3'" in capsys.readouterr().err


def test_a_tp_plan_that_names_no_module_is_refused(tmp_path):
    from memprof.simulate.hf_layouts import tp_parallelize

    model = hf.build_model(hf.load_config(_folder(tmp_path, TINY))).model
    model._tp_plan = {"no_such.*.proj": "colwise"}
    with pytest.raises(InvalidArgumentError, match="names no module"):
        tp_parallelize()(model, None)
    model._tp_plan = {"model.layers.*.mlp.gate_proj": "packed_colwise"}  # a style memprof does not map
    assert tp_degrees(model, 2) == []


def test_a_row_that_cannot_be_simulated_is_kept_saying_why_and_the_others_stand(tmp_path, monkeypatch, capsys):
    # One layout whose simulation fails (a pipeline stage that cannot run its cut, an op shape-only tensors cannot
    # run) used to end the whole plan with its error; it is a row saying why, and the plan answers the rest.
    from memprof.errors import SimulationError
    from memprof.render.plan import plan_data, plan_page, plan_text
    from memprof.simulate import plan as plan_module

    search = plan_module._Grid._search

    def failing_fsdp(self, ckpt, precision, layout, bar):
        if layout.name == "fsdp":
            raise SimulationError("the simulated training step 0 failed: RuntimeError: a shape\nsecond line")
        return search(self, ckpt, precision, layout, bar)

    monkeypatch.setattr(plan_module._Grid, "_search", failing_fsdp)
    folder = _folder(tmp_path, TINY)
    plan = plan_grid(folder, seq_len=32, gpu=SMALL_GPU, world_size=2, layouts="ddp,fsdp", precisions=["bf16"],
                     checkpointing=[False], processes=1)
    rows = {r.layout: r for r in plan.rows}
    assert rows["fsdp"].failed == "the simulated training step 0 failed: RuntimeError: a shape"
    assert rows["ddp"].failed is None and rows["ddp"].max_batch_size >= 1 and plan.best() is rows["ddp"]
    text = plan_text(plan)
    assert "failed: fsdp bf16 checkpointing off: the simulated training step 0 failed" in text
    data = plan_data(plan)
    failed = next(r for r in data["rows"] if r["parallel"] == "fsdp")
    assert failed["failed"].startswith("the simulated") and failed["max_batch_size"] is None
    assert failed["peak_bytes"] is None and failed["breakdown"] is None  # not measured is never 0
    frame = plan.to_frame()
    assert frame["failed"].isna().tolist() == [True, False] and frame["failed"][1] == failed["failed"]
    assert "failed: fsdp bf16" in plan_page(plan)
    # Every row failing is the plan's failure, naming the first.
    with pytest.raises(SimulationError, match="no configuration of the plan could be simulated; fsdp bf16: the"):
        plan_grid(folder, seq_len=32, gpu=SMALL_GPU, world_size=2, layouts="fsdp", precisions=["bf16"],
                  checkpointing=[False], processes=1)


def test_a_plans_optimizer_is_named():
    # The command line's --optimizer (always given, adamw by default) read "optimizer: as given".
    import functools

    import torch

    from memprof.cli.estimate import _optimizer
    from memprof.simulate import hf
    from memprof.simulate.plan import optimizer_words

    assert optimizer_words(_optimizer("adamw")) == "torch.optim.AdamW with its defaults"
    assert optimizer_words(_optimizer("sgd")) == "torch.optim.SGD with lr=0.1, momentum=0.9"
    assert optimizer_words(None) == optimizer_words(functools.partial(torch.optim.AdamW))
    assert optimizer_words(hf.adamw) == "as given (adamw)"  # plan_hf says it is AdamW's defaults itself

    def make(params):
        return torch.optim.Adam(params)

    assert optimizer_words(make) == "as given (test_a_plans_optimizer_is_named.<locals>.make)"
    assert isinstance(_optimizer("adam")([torch.nn.Parameter(torch.zeros(1))]), torch.optim.Adam)
