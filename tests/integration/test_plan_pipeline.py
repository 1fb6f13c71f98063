"""Pipeline layouts in the plan: a transformers decoder cut by its own pipeline plan computes what the whole model
computes (bit for bit, on the CPU with real weights), the ``pp`` layouts the model allows, a pipeline row's answer
confirmed by the estimate itself (the rank of its worst stage fits at the answer, not one sample above), and the
errors of a model memprof cannot cut."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import memprof  # noqa: E402
from memprof.anatomy.gpus import GpuSpec  # noqa: E402
from memprof.cli import main  # noqa: E402
from memprof.errors import InvalidArgumentError  # noqa: E402
from memprof.render.plan import plan_page, plan_rows, plan_text  # noqa: E402
from memprof.report.planning import plan_grid  # noqa: E402
from memprof.simulate import estimate as estimate_module  # noqa: E402
from memprof.simulate import hf  # noqa: E402
from memprof.simulate.hf_pipeline import causal_lm_loss, pp_fsdp, pp_support, split  # noqa: E402
from memprof.simulate.layouts import choose_layouts  # noqa: E402
from memprof.simulate.plan import PlanGrid, PlanRow  # noqa: E402

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=256)
# Llama; Qwen2 with sliding-window attention on its last two layers (layer_types mixes full and sliding, so a stage
# must pick each layer's mask by its own index); Mistral with a sliding window shorter than the sequence; Qwen3.
MODELS = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config,
              dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, dict(sliding_window=4)),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, dict(head_dim=16)),
    # Gemma 2: alternating sliding layers, attention soft-capping, and a final logit soft-cap that the causal LM
    # applies after its head (the last stage runs the causal LM's own forward, so it is applied there too).
    "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config, dict(head_dim=16, sliding_window=4)),
    # Granite scales the embeddings in the base model's forward (embedding_multiplier), not in the embedding: only
    # the first stage may apply it.
    "granite": (transformers.GraniteForCausalLM, transformers.GraniteConfig, dict(embedding_multiplier=3.0)),
}
WIDE = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=16000,
            max_position_embeddings=256)
LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 tie_word_embeddings=False, max_position_embeddings=8192)
# 688 MiB of it outside torch (4 ranks' communicators); the tensors and segments of 4 micro-batches of 4 sequences
# of WIDE's stage 1 fill the rest to the byte (the plan answers 4 there: 840 MiB at the device level, headroom 0).
GPU = GpuSpec("small", capacity_bytes=840 * 2**20, compute_capability=(9, 0), context_bytes=0)
SEQ = 32


def _folder(tmp_path, config, name="model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("stages", [2, 4])
def test_the_stages_chained_are_the_whole_model(arch, stages):
    cls, config_cls, extra = MODELS[arch]
    torch.manual_seed(0)
    model = cls(config_cls(**SHAPE, **extra)).eval()
    assert pp_support(model) == (True, "")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(input_ids=ids, labels=ids)
        x = ids
        for k in range(stages):
            stage = split(model, k, stages)
            assert len(stage.layers) == 4 // stages
            x = stage(x)
        loss = causal_lm_loss(model)(x, ids)
    assert torch.equal(x, whole.logits) and torch.equal(loss, whole.loss)
    # Cutting left the model as it was: every layer, its embedding and norm, its config's depth.
    assert len(model.model.layers) == 4 and model.config.num_hidden_layers == 4
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding) and not isinstance(model.model.norm,
                                                                                      torch.nn.Identity)


def test_pp_layouts_divide_the_world_and_the_layers(tmp_path):
    big = hf.build_model(hf.load_config(_folder(tmp_path, LLAMA3_8B, "8b"))).model
    # 8 ranks, 32 layers: 2 and 4 stages, FSDP over the other 4 and 2 ranks; then tensor parallelism inside the
    # stages over the degrees that divide the ranks left and the model (32 heads, 8 key/value heads, ...): 2 and 4
    # for 2 stages, 2 for 4 stages.
    pp = ["pp2-fsdp4", "pp4-fsdp2", "pp2-fsdp2-tp2", "pp2-tp4", "pp4-tp2"]
    assert [lay.name for lay in choose_layouts(big, 8, "pp")] == pp
    names = [lay.name for lay in choose_layouts(big, 8, "all")]
    assert names[:5] == ["ddp", "fsdp", "zero1", "zero2", "zero3"] and names[-5:] == pp
    assert [lay.name for lay in choose_layouts(big, 8, "dp")] == names[:5]  # the default grid: data-parallel only
    small = hf.build_model(hf.load_config(_folder(tmp_path, WIDE, "wide"))).model
    lays = {lay.name: lay for lay in choose_layouts(small, 4, "pp")}
    assert list(lays) == ["pp2-fsdp2", "pp4", "pp2-tp2"]
    assert lays["pp2-tp2"].options["mesh"] == {"pp": 2, "tp": 2} and "mixed" not in lays["pp2-tp2"].precisions
    assert (lays["pp2-fsdp2"].microbatches, lays["pp4"].microbatches) == (4, 8)  # 2 x P
    assert "mixed" not in lays["pp4"].precisions  # no FSDP inside the stages: no mixed precision policy to run
    three = hf.build_model(hf.load_config(_folder(tmp_path, {**WIDE, "num_hidden_layers": 3}, "three"))).model
    with pytest.raises(InvalidArgumentError, match="divides both the world size and the model's 3 decoder layers"):
        choose_layouts(three, 4, "pp")
    six = hf.build_model(hf.load_config(_folder(tmp_path, {**WIDE, "num_hidden_layers": 6}, "six"))).model
    with pytest.raises(InvalidArgumentError, match="unknown layout 'pp4' .*: 4 stages do not divide 6 layers"):
        choose_layouts(six, 4, "pp4")
    with pytest.raises(InvalidArgumentError, match="8 stages is not one of them"):
        choose_layouts(small, 8, "pp8")


def test_a_model_without_a_pipeline_plan_has_no_pp_layouts(tmp_path, capsys):
    opt = _folder(tmp_path, dict(architectures=["OPTForCausalLM"], model_type="opt", hidden_size=32, ffn_dim=64,
                                 num_hidden_layers=2, num_attention_heads=2, word_embed_proj_dim=32, vocab_size=128,
                                 max_position_embeddings=64), "opt")
    model = hf.build_model(hf.load_config(opt)).model
    ok, why = pp_support(model)
    assert not ok and "no pipeline plan" in why
    with pytest.raises(InvalidArgumentError, match="no pipeline plan"):
        split(model, 0, 2)
    with pytest.raises(InvalidArgumentError, match="no pipeline-parallel layout: OPTForCausalLM has no pipeline"):
        choose_layouts(model, 4, "pp")
    with pytest.raises(InvalidArgumentError, match="unknown layout 'pp2-fsdp2'.*no pipeline plan"):
        choose_layouts(model, 4, "pp2-fsdp2")
    # OPT has neither a pipeline nor a TP plan: "all" is the data-parallel layouts.
    assert [lay.name for lay in choose_layouts(model, 4, "all")] == ["ddp", "fsdp", "zero1", "zero2", "zero3"]
    assert main(["plan", "--hf", str(opt), "--seq-len", "8", "--gpu", "t4", "--world-size", "4",
                 "--layouts", "pp"]) == 1
    assert "OPTForCausalLM has no pipeline plan" in capsys.readouterr().err


@pytest.fixture(scope="module")
def pp_plan(tmp_path_factory):
    folder = _folder(tmp_path_factory.mktemp("pp"), WIDE)
    with pytest.MonkeyPatch.context() as patch:  # each stage's estimate the search asks for: (micro-batch, rank)
        asked.clear()
        patch.setattr(estimate_module, "estimate", _counted(estimate_module.estimate))
        return folder, plan_grid(folder, seq_len=SEQ, gpu=GPU, world_size=4, layouts="pp2-fsdp2",
                                 precisions=["bf16"], checkpointing=[False], alloc_conf="expandable_segments:True")


asked: "list[tuple[int, int, bool]]" = []


def _counted(estimate):
    def counted(*args, **kwargs):
        est = estimate(*args, **kwargs)
        asked.append((kwargs["inputs"].shape[0] // 4, kwargs["rank"], est.fits))
        return est

    return counted


def _direct(folder, b, rank):
    """memprof.estimate of pp2-fsdp2 at micro-batch ``b``, called by hand: 4 micro-batches of ``b`` sequences."""
    built = hf.build_model(hf.load_config(folder))
    ids = torch.zeros(4 * b, SEQ, dtype=torch.long, device="meta")
    return memprof.estimate(built.model, hf.adamw, inputs=ids, targets=ids, loss_fn=causal_lm_loss(built.model),
                            precision="bf16", world_size=4, mesh={"pp": 2, "dp": 2}, parallelize=pp_fsdp(False),
                            pipeline=memprof.Pipeline(split, "1f1b", 4), rank=rank, gpu=GPU,
                            alloc_conf="expandable_segments:True")


def test_a_pipeline_row_is_the_estimate_of_its_worst_stage(pp_plan):
    folder, plan = pp_plan
    (row,) = plan.rows
    assert (row.layout, row.microbatches, row.stages) == ("pp2-fsdp2", 4, 2)
    assert row.verified and row.max_batch_size == row.batch >= 2
    # The last stage is the fuller: its 16,000-word logits and their fp32 loss outweigh stage 0's embedding.
    assert row.worst_stage == 1
    # Stage 1's rank (mesh pp x dp = 2 x 2, row-major: rank 2 holds stage 1 with dp coordinate 0) at the answer is
    # the row, every category to the byte; one sample more per micro-batch does not fit.
    at = _direct(folder, row.max_batch_size, rank=2)
    assert (at.peak_bytes, at.device_peak, at.fits) == (row.peak_bytes, row.device_peak, True)
    assert {c.value: at.peak[c] for c in at.peak} == dict(row.breakdown)
    assert _direct(folder, row.max_batch_size + 1, rank=2).fits is False
    # The batch the rank's step takes is micro-batch x micro-batches: token ids of 4 x b sequences of 32 tokens, int64
    # (the labels are the same tensor): 4 x b x 32 x 8 B.
    assert row.breakdown["inputs"] == 4 * row.max_batch_size * SEQ * 8
    # Stage 1's bf16 weights under FSDP over 2 ranks with reshard_after_forward=False: the unsharded units whole
    # and every parameter's shard, each storage rounded to 512 B.
    #   per layer: q, o 256x256; k, v 128x256; gate, up, down 512x256; 2 norms of 256 = 590,336 elements
    #   units: layers 2 and 3 (2 x 590,336) and the root (final norm 256 + lm_head 16,000 x 256 = 4,096,256)
    #   unsharded: (2 x 590,336 + 4,096,256) x 2 B = 10,553,856 B (each unit's buffer a multiple of 512 B)
    #   shards: half of it, 5,276,928 B, plus the 5 norms' 256 B shards rounded up to 512 B: + 5 x 256 B
    #   10,553,856 + 5,276,928 + 1,280 = 15,832,064 B
    assert row.breakdown["weights"] == 15_832_064


def test_a_batch_one_stage_cannot_fit_does_not_simulate_the_others(pp_plan):
    # The search asks of a batch only whether it fits: once the stage that was the worst at the nearest batch
    # (stage 1, rank 2) does not, no other is simulated. A batch that fits has every stage simulated, and so has
    # batch 1 (a row that fits nothing shows it).
    _, plan = pp_plan
    (row,) = plan.rows
    batches = sorted({b for b, _, _ in asked})
    assert len(batches) == row.simulations and {1, row.max_batch_size, row.max_batch_size + 1} <= set(batches)
    for b in batches:
        ranks = [(r, fits) for b_, r, fits in asked if b_ == b]
        if b == 1 or all(fits for _, fits in ranks):
            assert sorted(r for r, _ in ranks) == [0, 2], (b, ranks)
        else:
            assert ranks == [(2, False)], (b, ranks)


def test_pipeline_rows_render_their_micro_batches(pp_plan):
    _, plan = pp_plan
    (data,) = plan_rows(plan)
    assert (data["microbatches"], data["stages"], data["worst_stage"]) == (4, 2, 1)
    frame = plan.to_frame()
    assert (list(frame["microbatches"]), list(frame["stages"]), list(frame["worst_stage"])) == ([4], [2], [1])
    text, page = plan_text(plan), plan_page(plan)
    assert "micro-batches" in text and "worst stage" in text and "per micro-batch x 4 micro-batches" in text
    assert "<th>micro-batches</th>" in page and "<th>worst stage</th>" in page
    assert any("the batch is one micro-batch's sequences" in n for n in plan.notes)
    # A grid without a pipeline row prints as it always has: no such columns.
    row = PlanRow("fsdp", "bf16", False, 3, 3, 1, 2, 3, "weights", 1, 1, "forward", {"weights": 1}, 2, True)
    plain = PlanGrid((row,), "m", "small", 1, 2, SEQ, 0.0)
    assert "micro-batches" not in plan_text(plain) and "micro-batches" not in plan_page(plain)
    assert plan_rows(plain)[0]["microbatches"] is None and plan.best() is plan.rows[0]


def test_a_pp_tp_stage_holds_its_tp_shards():
    # pp2-tp2 of a tiny Llama (hidden 64, 4 heads of 16, 2 key/value heads, MLP 128, vocabulary 256, 4 layers):
    # stage 0's rank (rank 0 of the mesh pp x tp = 2 x 2) holds the embedding's vocabulary rows and its 2 layers'
    # TP shards, in bf16 on the CPU (no 512 B rounding):
    #   embedding 128 x 64 x 2 B = 16,384 B
    #   per layer: q 32x64 -> 4,096 B; k, v 16x64 -> 2,048 B each; o 64x32 -> 4,096 B; gate, up 64x64 and down
    #              64x64 -> 8,192 B each; 2 norms of 64 -> 128 B each: 37,120 B
    #   16,384 + 2 x 37,120 = 90,624 B
    from memprof.simulate.hf_pipeline import pp_fsdp

    config = transformers.LlamaConfig(**SHAPE)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(4, 16, dtype=torch.long, device="meta")
    est = memprof.estimate(model, hf.adamw, inputs=ids, targets=ids, loss_fn=causal_lm_loss(model), precision="bf16",
                           world_size=4, mesh={"pp": 2, "tp": 2}, parallelize=pp_fsdp(False, tp=True, fsdp=False),
                           pipeline=memprof.Pipeline(split, "1f1b", 4), rank=0, device="cpu")
    assert est.peak["weights"] == 90_624


def test_a_model_whose_layers_need_more_than_the_hidden_states_is_refused_with_the_reason():
    # Gemma 3n feeds every layer a per-layer embedding of the token ids, sized for all the model's layers: its
    # pipeline plan names embed_tokens, layers and norm, but a stage cannot run on the hidden states alone.
    from memprof.errors import InvalidArgumentError
    from memprof.simulate.estimate import estimate

    cfg = transformers.Gemma3nTextConfig(
        vocab_size=128, vocab_size_per_layer_input=128, hidden_size=64, hidden_size_per_layer_input=8,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2, sliding_window=4,
        altup_num_inputs=2, laurel_rank=8, activation_sparsity_pattern=[0.0] * 4, architectures=["Gemma3nForCausalLM"])
    built = hf.build_model(cfg)
    layout = choose_layouts(built.model, 2, "pp2")[0]
    with pytest.raises(InvalidArgumentError, match="pipeline stage 0 of 2 could not run on the inputs"):
        layout.simulate(estimate, built.model, hf.adamw, lambda n: hf.token_batch(built, n, 16), 1, precision="bf16",
                        gpu="h100-80gb", loss_fn=hf.hf_loss)


def test_the_pipelines_loss_takes_a_whole_models_output_and_refuses_anything_else():
    # causal_lm_loss(model) is the last stage's loss of logits; handed the whole model's output (an estimate of the
    # model without pipeline=, as docs/distributed.md's readers try first) it raised AttributeError from inside
    # transformers ("'CausalLMOutputWithPast' object has no attribute 'float'"). It takes the output's logits now:
    # the same figures as a loss that reads them itself.
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(2, 8, dtype=torch.long)
    loss = causal_lm_loss(model)
    given = memprof.estimate(model, torch.optim.AdamW, inputs=ids, targets=ids, loss_fn=loss)
    read = memprof.estimate(model, torch.optim.AdamW, inputs=ids, targets=ids,
                            loss_fn=lambda out, labels: loss(out.logits, labels))
    assert given.peak_bytes == read.peak_bytes and dict(given.trace.peak) == dict(read.trace.peak)
    with pytest.raises(InvalidArgumentError, match=r"causal_lm_loss\(model\) takes the logits .* got dict"):
        loss({"hidden": ids}, ids)
