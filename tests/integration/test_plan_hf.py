"""Planning from a model's config: a transformers model built on the meta device from config.json, its estimate
(Python and ``memprof estimate --hf``), the plan grid (``memprof.plan``, ``memprof plan``) and its consistency,
and the what-if of a measured run confirmed by running the changed configuration for real on the CPU."""

import json
import sys
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

import memprof  # noqa: E402
from memprof.anatomy.gpus import GpuSpec  # noqa: E402
from memprof.cli import main  # noqa: E402
from memprof.errors import ConfigNotFoundError, InvalidArgumentError, MissingExtraError, UnknownNameError  # noqa: E402
from memprof.simulate import hf  # noqa: E402
from memprof.report.planning import plan_grid  # noqa: E402
from memprof.simulate.plan import Layout  # noqa: E402

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=256)

# Llama-3-8B's shape (meta-llama/Meta-Llama-3-8B config.json), written here: no download.
LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 tie_word_embeddings=False, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                 torch_dtype="bfloat16")


def _folder(tmp_path, config, name="model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_llama3_8b_builds_on_meta_with_its_parameter_count(tmp_path):
    built = hf.build_model(hf.load_config(_folder(tmp_path, LLAMA3_8B)))
    params = list(built.model.parameters())
    # Embedding and LM head 2 x 128256 x 4096; per layer q, o 4096^2, k, v 4096 x 1024, MLP 3 x 4096 x 14336 and
    # two norms of 4096; the final norm 4096: 1,050,673,152 + 32 x 218,112,000 + 4,096 = 8,030,261,248.
    assert sum(p.numel() for p in params) == 8_030_261_248
    assert all(p.is_meta and p.dtype == torch.float32 for p in params) and built.model.training
    assert built.kind == "causal-lm"


def test_estimate_hf_is_the_estimate_of_the_model_built_by_hand(tmp_path):
    folder = _folder(tmp_path, TINY)
    est = memprof.estimate_hf(folder, seq_len=16, batch_size=2, precision="mixed", device="cpu",
                              loop="plain")  # memprof's own loop, as by hand
    config = transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    by_hand = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps), inputs={"input_ids": ids, "labels": ids},
                               loss_fn=lambda out: out.loss, precision="mixed", device="cpu")
    assert est.peak == by_hand.peak and est.trace.peak_step == by_hand.trace.peak_step
    assert est.notes[0].startswith("LlamaForCausalLM built from its config on the meta device")
    # The default precision is the config's dtype.
    assert hf.estimate_hf(_folder(tmp_path, {**TINY, "torch_dtype": "bfloat16"}, "bf16"), seq_len=8, batch_size=1,
                          device="cpu").precision == "bf16"


def test_seq2seq_and_classifier_get_their_batches(tmp_path):
    t5 = _folder(tmp_path, dict(architectures=["T5ForConditionalGeneration"], model_type="t5", d_model=32, d_ff=64,
                                num_layers=1, num_heads=2, d_kv=16, vocab_size=128, decoder_start_token_id=0,
                                pad_token_id=0), "t5")
    built = hf.build_model(t5)
    batch = hf.token_batch(built, 3, 8)
    assert built.kind == "seq2seq" and set(batch) == {"input_ids", "decoder_input_ids", "labels"}
    assert all(t.shape == (3, 8) for t in batch.values())
    assert hf.estimate_hf(t5, seq_len=8, batch_size=3, device="cpu").peak_bytes > 0
    cls = _folder(tmp_path, {**TINY, "architectures": ["LlamaForSequenceClassification"], "num_labels": 3}, "cls")
    est = hf.estimate_hf(cls, seq_len=8, batch_size=2, device="cpu")
    assert est.peak["inputs"] > 0 and any("pad_token_id" in n for n in est.notes)
    assert hf.token_batch(hf.build_model(cls), 2, 8)["labels"].shape == (2,)


def test_a_causal_lm_named_otherwise_is_fed_as_one(tmp_path):
    # GPT-2's causal LM is GPT2LMHeadModel, the class transformers' own causal-LM mapping lists for it: memprof
    # feeds it token ids and labels, as any *ForCausalLM.
    gpt2 = _folder(tmp_path, dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=32, n_layer=1,
                                  n_head=2, vocab_size=128, n_positions=64), "gpt2")
    built = hf.build_model(gpt2)
    assert built.kind == "causal-lm" and set(hf.token_batch(built, 2, 8)) == {"input_ids", "labels"}
    assert hf.estimate_hf(gpt2, seq_len=8, batch_size=2, device="cpu").peak_bytes > 0


def test_errors_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ConfigNotFoundError, match="no config.json in"):
        hf.load_config(tmp_path)
    with pytest.raises(ConfigNotFoundError, match="no such file or folder"):
        hf.load_config(tmp_path / "missing")
    # A relative path mistyped beside the folder it names (configs/lama for configs/llama) is a local path, not a hub
    # id: refused at once, where transformers retried the hub for about 25 s without a network.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    started = time.perf_counter()
    with pytest.raises(ConfigNotFoundError, match="no such file or folder: configs/lama"):
        hf.load_config("configs/lama")
    with pytest.raises(ConfigNotFoundError, match="no such file or folder"):
        hf.load_config("a/b/c")  # no hub id has three parts
    assert time.perf_counter() - started < 5
    # A folder whose config.json transformers cannot read names the file, not the hub's cache.
    unknown = _folder(tmp_path, {**TINY, "model_type": "llamaXX"}, "unknown-type")
    with pytest.raises(ConfigNotFoundError, match="cannot read .*unknown-type.*config.json as a transformers config"):
        hf.load_config(unknown)
    with pytest.raises(UnknownNameError, match="set \"architectures\" in config.json"):
        hf.build_model(_folder(tmp_path, {**TINY, "architectures": ["NoSuchForCausalLM"]}))
    # Phi-3's default pad id (32000) beyond a small vocabulary: named, not torch's bare AssertionError.
    phi3 = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=128,
                max_position_embeddings=64)
    with pytest.raises(InvalidArgumentError, match="pad_token_id 32000 .* is not below its vocab_size 128"):
        hf.build_model(_folder(tmp_path, phi3, "phi3"))
    assert hf.build_model(_folder(tmp_path, {**phi3, "pad_token_id": None}, "phi3-unpadded")).kind == "causal-lm"
    # A config transformers refuses (its own validation of the values) is one error naming the cause.
    with pytest.raises(InvalidArgumentError, match=r"transformers refuses the config .*not a multiple of the number"):
        hf.build_model(_folder(tmp_path, {**TINY, "num_attention_heads": 3}, "odd-heads"))
    with pytest.raises(InvalidArgumentError, match=r"transformers refuses the config in .*config.json"):
        hf.load_config(_folder(tmp_path, {**TINY, "num_attention_heads": 3}, "odd-heads-file") / "config.json")
    # Whatever else stops transformers' constructor is one error naming the class and the fix.
    import transformers

    def refuse(*_a, **_k):
        raise AssertionError("a constructor's own check")

    with monkeypatch.context() as m:
        m.setattr(transformers.LlamaForCausalLM, "_from_config", refuse)
        with pytest.raises(InvalidArgumentError, match="transformers could not build LlamaForCausalLM .*own check"):
            hf.build_model(_folder(tmp_path, TINY, "refused"))
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingExtraError, match=r"torch-memprof\[transformers\]"):
        hf.load_config(tmp_path)


def test_cli_estimate_hf_json(tmp_path, capsys):
    folder = _folder(tmp_path, TINY)
    assert main(["estimate", "--hf", str(folder), "--seq-len", "16", "--batch-size", "2", "--precision", "mixed",
                 "--gpu", "h100-80gb", "--world-size", "2", "--parallel", "fsdp", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["breakdown"]) == {c.value for c in memprof.Category}
    assert data["peak_bytes"] == sum(v for k, v in data["breakdown"].items()
                                     if k not in ("allocator_overhead", "outside_torch"))
    assert data["fits"] is True and data["device_peak"] + data["headroom"] == data["capacity"]
    assert data["peak_phase"] and data["parallel"] == "fsdp" and data["world_size"] == 2 and data["notes"]
    assert main(["estimate", "--hf", str(tmp_path), "--seq-len", "16", "--batch-size", "2"]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert main(["estimate", "--batch-size", "2"]) == 1
    assert "give MODULE:FACTORY or --hf" in capsys.readouterr().err


# A plan small enough for the suite: a large vocabulary makes each sample's logits weigh and the model states
# matter (9.3 M parameters), and a GPU of 900 MiB (no CUDA context; the NCCL communicator's term stays) holds a
# few samples.
WIDE = {**TINY, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 16000}
SMALL_GPU = GpuSpec("small", capacity_bytes=900 * 2**20, compute_capability=(9, 0), context_bytes=0)


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    folder = _folder(tmp_path_factory.mktemp("plan"), WIDE)
    layouts = [Layout("ddp", {"world_size": 2, "parallel": "ddp"}), Layout("fsdp", {"world_size": 2, "parallel": "fsdp"})]
    # Expandable segments: on a device this small the default allocator's segment sizes (2 and 20 MiB) decide
    # the fit within a sample, and FSDP's gathers can fragment it more than DDP's whole parameters do (7 samples
    # against 8 with this model, checkpointing on); the layouts' own bytes are what the consistency is about.
    # Two processes, one per layout (the two share no simulation): test_rows_searched_in_processes_are_the_same
    # holds them to one process's.
    return folder, plan_grid(folder, seq_len=64, gpu=SMALL_GPU, layouts=layouts, precisions=["bf16"],
                             alloc_conf="expandable_segments:True", processes=2)


def test_rows_searched_in_processes_are_the_same(small_plan):
    # Every row the same, field by field (its simulations, its breakdown at the answer, its verification), in the
    # same order, whether each group of rows ran in a forked process or all in this one.
    folder, grid = small_plan
    layouts = [Layout("ddp", {"world_size": 2, "parallel": "ddp"}), Layout("fsdp", {"world_size": 2, "parallel": "fsdp"})]
    here = plan_grid(folder, seq_len=64, gpu=SMALL_GPU, layouts=layouts, precisions=["bf16"],
                     alloc_conf="expandable_segments:True", processes=1)
    assert here.rows == grid.rows
    assert [(r.layout, r.checkpointing) for r in grid.rows] == [("ddp", False), ("fsdp", False), ("ddp", True),
                                                               ("fsdp", True)]


def test_plan_rows_are_confirmed_and_consistent(small_plan):
    folder, grid = small_plan
    rows = {(r.layout, r.checkpointing): r for r in grid.rows}
    assert len(rows) == 4 and all(r.verified for r in grid.rows)
    assert all(r.max_batch_size >= 1 for r in grid.rows)
    for layout in ("ddp", "fsdp"):  # checkpointing never lowers the largest batch
        assert rows[(layout, True)].max_batch_size >= rows[(layout, False)].max_batch_size
    for ckpt in (False, True):  # FSDP never fits a smaller batch than DDP
        assert rows[("fsdp", ckpt)].max_batch_size >= rows[("ddp", ckpt)].max_batch_size
    # The answer holds against the estimate itself: it fits, one more sample does not.
    row = rows[("fsdp", True)]
    for b, fits in ((row.max_batch_size, True), (row.max_batch_size + 1, False)):
        est = hf.estimate_hf(folder, seq_len=64, batch_size=b, precision="bf16", checkpointing=True, gpu=SMALL_GPU,
                             world_size=2, parallel="fsdp", alloc_conf="expandable_segments:True")
        assert est.fits is fits
        if fits:
            assert est.device_peak == row.device_peak and est.peak_bytes == row.peak_bytes
    assert row.dominant_bytes == max(v for v in row.breakdown.values() if v is not None)


def test_plan_views(small_plan, tmp_path):
    _, grid = small_plan
    frame = grid.to_frame()
    assert list(frame["parallel"]) == [r.layout for r in grid.rows] and len(frame) == 4
    assert {"precision", "checkpointing", "max_batch_size", "peak_bytes", "device_peak", "dominant"} <= set(frame)
    text = str(grid)
    assert text.startswith("memprof plan: LlamaForCausalLM on 2 x small") and "* the largest batch" in text
    page = tmp_path / "plan.html"
    grid.export_html(page)
    assert page.read_text().startswith("<!DOCTYPE html>") and "fsdp" in page.read_text()


def test_cli_plan_json_and_html(tmp_path, capsys, monkeypatch):
    folder = _folder(tmp_path, {**WIDE, "max_position_embeddings": 2048})  # a model that takes 2048 tokens
    page = tmp_path / "grid.html"
    # A named GPU: the T4's 15 GiB hold hundreds of these samples at 8 tokens, so the grid is one row here.
    assert main(["plan", "--hf", str(folder), "--seq-len", "2048", "--gpu", "t4", "--world-size", "2",
                 "--parallel", "fsdp", "--precision", "bf16", "--checkpointing", "on", "--json",
                 "--html", str(page)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["parallel"] == "fsdp" and rows[0]["checkpointing"] is True
    assert rows[0]["max_batch_size"] >= 1 and rows[0]["verified"] and rows[0]["dominant"] in rows[0]["breakdown"]
    assert "fsdp" in page.read_text()
    assert main(["plan", "--hf", str(folder), "--seq-len", "8", "--gpu", "t4", "--world-size", "2",
                 "--parallel", "tp"]) == 1
    assert "unknown layout 'tp'" in capsys.readouterr().err


def _run(config, checkpointing, batch=2, precision=None):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    model.train()
    if checkpointing:
        hf.enable_checkpointing(model)
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, config.vocab_size, (batch, 32))
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    return model, opt, ids, prof.report()


def test_what_if_is_confirmed_by_running_the_change():
    # Eager attention: the causal mask is built in both runs (SDPA skips it when the values allow, which a
    # shape-only simulation cannot see).
    config = transformers.LlamaConfig(attn_implementation="eager", **{k: v for k, v in TINY.items()
                                                                      if k not in ("architectures", "model_type")})
    model, opt, ids, report = _run(config, False)
    batch = {"input_ids": ids, "labels": ids}
    ckpt = report.what_if(model, opt, inputs=batch, loss_fn=lambda out: out.loss, checkpointing=True)
    real = _run(config, True)[3]
    assert ckpt.peak == real.peak
    assert ckpt.saving["activations"] == report.peak["activations"] - real.peak["activations"]
    assert ckpt.saving_bytes == report.peak.total - real.peak.total > 0
    assert not any(p.is_meta for p in model.parameters()) and not model.is_gradient_checkpointing
    bigger = report.what_if(model, opt, inputs=batch, loss_fn=lambda out: out.loss, batch_size=4)
    assert bigger.peak == _run(config, False, batch=4)[3].peak
    bf16 = report.what_if(model, opt, inputs=batch, loss_fn=lambda out: out.loss, precision="bf16")
    assert bf16.peak == _run(config, False, precision="bf16")[3].peak
    assert "checkpointing=True" in str(ckpt) and "saving" in str(ckpt)
