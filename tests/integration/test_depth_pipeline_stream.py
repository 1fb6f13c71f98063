"""A pipeline rank's default estimate on a GPU target is cut and extended, its allocation stream with it, to the
whole stage's figures, to the byte.

Under 1F1B several micro-batches are in flight: a block's backward frees what its micro-batch's forward made, named
from the newest of its size, after the live storages of the later blocks of every micro-batch still held, whose
number grows with the blocks in every copy of the run at once. The stream extension measures that growth on a copy
of the run the cut before kept (:func:`memprof.simulate.depth_stream._per_copy`), checks it in every copy of the
next cut, and grows every copy again with each block added. Before, the check failed, the cuts were simulated for
nothing and the whole stage after them (``... was simulated whole, since its figures were not affine in depth ...
(its allocation stream did not grow by the same events per block)``)."""

from __future__ import annotations

import pytest
import torch

import memprof
from memprof.simulate import depth

transformers = pytest.importorskip("transformers")
T = transformers

from memprof.simulate.hf_pipeline import causal_lm_loss, split  # noqa: E402

from test_depth_default import _identical  # noqa: E402  (every figure, to the byte)


@pytest.fixture
def shallow(monkeypatch):
    # The default cuts a stage of 16 blocks or more; 8 per stage keep this test to seconds on the same path
    # (extrapolate=None): the first cuts (2, 3, 4 blocks) do not settle, the next (3, 4, 5) are extended by 3.
    monkeypatch.setattr(depth, "AUTO_UNITS", 8)


def test_a_1f1b_stage_is_cut_and_extended_to_the_whole_stage(shallow):
    # The first stage: its backward of the first micro-batch frees what that micro-batch's forward made while the
    # second's forward is held (the last stage holds one micro-batch at a time: the next test extends it too).
    rank = 0
    cfg = T.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=16,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg)
    ids = torch.zeros(4, 16, dtype=torch.long, device="meta")  # two micro-batches of 2 sequences
    kw = dict(inputs=ids, targets=ids, loss_fn=causal_lm_loss(model), world_size=2, rank=rank,
              pipeline=memprof.Pipeline(split, "1f1b", 2), gpu="h100-80gb")
    fast = memprof.estimate(model, torch.optim.AdamW, **kw)
    whole = memprof.estimate(model, torch.optim.AdamW, extrapolate=False, **kw)
    notes = [n for n in fast.notes if n.startswith("depth:")]
    assert any(n.startswith("depth: simulated with model.layers (16 x LlamaDecoderLayer) cut to 3, 4 and 5 blocks")
               for n in notes), notes
    assert any(n.startswith("depth: the device-level figures are the allocator replay") for n in notes), notes
    assert not any("simulated whole" in n for n in notes), notes
    _identical(fast, whole)


def test_a_pipeline_stage_under_fsdp2_and_tp_is_cut_and_extended(shallow):
    fsdp2_tp_stages(2)  # 4 micro-batches: benchmarks/cases/test_depth_at_scale.py


def fsdp2_tp_stages(micro):
    # Each stage parallelised inside by tensor and sequence parallelism, then FSDP2 with bf16 gathers: FSDP2 resizes
    # the parameters it gathered to 0 after each block, named from the oldest of their bytes in the newest copy of
    # a run and from the newest in the older ones, each copy one step further along (depth_stream._per_step).
    # Over two micro-batches the first stage's backward of a block frees a storage of the block before it after its
    # own events: aligned in full, that free falls apart from the run a block adds, so the tokens are aligned by
    # their shapes (depth_stream._aligned); the copy that measures a free's growth is counted without the backward's
    # peak marker, which falls in one copy only (depth_stream._beside). Before, that stage was simulated whole.
    from test_parallelize import Tiny, loss_fn
    from test_pipeline import IDS, Stage
    from test_pipeline_fsdp_tp import MESH, WORLD, stage_fn

    def estimate(**kw):
        torch.manual_seed(0)
        return memprof.estimate(Tiny(layers=16), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS,
                                loss_fn=loss_fn, world_size=WORLD, mesh=MESH, parallelize=stage_fn, gpu="h100-80gb",
                                pipeline=memprof.Pipeline(Stage, schedule="1f1b", microbatches=micro), **kw)

    fast, whole = estimate(), estimate(extrapolate=False)
    assert [c.stages for c in fast.ranks] == [c.stages for c in whole.ranks] == [(0,), (1,)]
    for a, b in zip(fast.ranks, whole.ranks):
        assert (a.peak_bytes, a.peak_step, a.peak_phase) == (b.peak_bytes, b.peak_step, b.peak_phase)
    notes = [n for n in fast.notes if n.startswith("depth:")]
    assert any(n.startswith("depth: the device-level figures are the allocator replay") for n in notes), notes
    assert not any("simulated whole" in n for n in notes), notes
    _identical(fast, whole)


def _llama_stages(tmp_path, seq, schedule, extrapolate=None, batch=4, layers=16, arch=("LlamaForCausalLM", "llama"),
                  gpu="h100-80gb", micro=4, **extra):
    """Rank 0 of a model built from its config (by default a 16-layer Llama), in bf16 on 8 ranks: 2 pipeline stages,
    FSDP2 over the 4 ranks of each (the plan's pp2-fsdp4 layout, memprof.simulate.hf_pipeline.pp_fsdp), a batch of
    ``batch`` sequences of ``seq`` tokens over ``micro`` micro-batches (by default 4 of one sequence each), on the
    ``gpu`` target (None: the CPU)."""
    import json

    from memprof.simulate import hf
    from memprof.simulate.hf_pipeline import pp_fsdp

    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=[arch[0]], model_type=arch[1], hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
        tie_word_embeddings=False, max_position_embeddings=256, **extra)))
    built = hf.build_model(hf.load_config(tmp_path))
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    kw = {} if extrapolate is None else dict(extrapolate=extrapolate)
    return memprof.estimate(built.model, hf.adamw, inputs=ids, targets=ids, loss_fn=causal_lm_loss(built.model),
                            precision="bf16", world_size=8, mesh={"pp": 2, "dp": 4}, parallelize=pp_fsdp(False),
                            pipeline=memprof.Pipeline(split, schedule, micro), rank=0, gpu=gpu, **kw)


def test_the_first_stage_of_fsdp2_stages_is_cut_and_extended(shallow, tmp_path):
    # 2 micro-batches of 1 sequence: every line of the stream extension the 1F1B schedule and 4 micro-batches of
    # 2 sequences ran, this case runs too (measured with coverage.py); those are in
    # benchmarks/cases/test_depth_at_scale.py.
    first_fsdp2_stage(tmp_path, "gpipe", batch=2, micro=2)


def first_fsdp2_stage(tmp_path, schedule, batch, micro):
    # The first stage holds several micro-batches' activations: aligned by shape, the run a block adds falls on the
    # stage's first block in the forward, which frees what the others do not, unless slid to where the tokens
    # agree in full (depth_stream._slid); in the backward, which visits the blocks from the last, the copy a block
    # adds comes before those it repeats: each copy kept moves in one list, the new one a step from the next
    # (depth_stream._agreed's g - h). Before, that stage was simulated whole.
    kw = dict(batch=batch, micro=micro)
    fast = _llama_stages(tmp_path, 16, schedule, **kw)
    whole = _llama_stages(tmp_path, 16, schedule, extrapolate=False, **kw)
    notes = [n for n in fast.notes if n.startswith("depth:")]
    assert any(n.startswith("depth: the device-level figures are the allocator replay") for n in notes), notes
    assert not any("simulated whole" in n for n in notes), notes
    _identical(fast, whole)
    # The module at the peak: the whole stage's is in its last block (body.layers.7...), the cut's in the cut's
    # last (body.layers.4...), which the estimate named before (found by this stop's review); now it names none.
    assert whole.trace.peak_module.startswith("body.layers.7."), whole.trace.peak_module
    assert fast.trace.peak_module is None
    assert any(n.startswith("depth: the module at the peak is not known from the cuts") for n in notes), notes


def test_a_phase_whose_peak_moves_at_full_depth_takes_it_from_the_extended_stream(shallow, tmp_path):
    # On the CPU target, 2 micro-batches of 1 sequence: the GPU target's case and 4 micro-batches are in
    # benchmarks/cases/test_depth_at_scale.py.
    stage_whose_peak_moves(tmp_path, None, batch=2, micro=2)


def stage_whose_peak_moves(tmp_path, gpu, batch, micro):
    # Sequences of 8 tokens: the cuts (2, 3 and 4 blocks) grow alike, but at 8 blocks each step's first forward
    # peaks at another moment, whose tensors the cuts' line does not reach: extended in a line, its records fell
    # 68,608 B short on the GPU target (activations 165,888 B, not 378,880), 43,840 B on the CPU (1,081,440 B and
    # 1,394,052 B, not 1,125,280 and 1,437,892), unchecked there (only a CUDA target's cuts kept their streams).
    # The extended stream holds every event, each storage's category and every move of one to another
    # (memprof.simulate.stream_peaks): each phase's peak is the first moment of its largest total there, with the
    # composition the ledger keeps (the retroactive moves of the phase's storages applied), checked at every
    # phase's start, peak and end against its record. Before, the stage was simulated whole on the GPU target.
    fast = _llama_stages(tmp_path, 8, "1f1b", gpu=gpu, batch=batch, micro=micro)
    whole = _llama_stages(tmp_path, 8, "1f1b", extrapolate=False, gpu=gpu, batch=batch, micro=micro)
    moved = [n for n in fast.notes if n.startswith("depth: at full depth step ")]
    assert [n.split("'s peak")[0] for n in moved] == ["depth: at full depth step 0 forward",
                                                      "depth: at full depth step 1 forward"], fast.notes
    assert not any("simulated whole" in n for n in fast.notes), fast.notes
    _identical(fast, whole)


def test_a_cpu_stage_whose_stream_does_not_extend_is_simulated_whole(shallow, tmp_path):
    # A 16-layer Qwen3's first stage, 2 micro-batches of 1 sequence of 8 tokens, on the CPU: the cuts' streams do
    # not extend ("lost events with a block more"). The line through the cuts' figures stood there, with a note
    # that nothing was checked, and step 0's forward peak record fell 86,912 B short (activations 179,712 B where
    # the whole stage's are 410,624 B; found by this change's review). Unchecked, a line can miss a phase's peak:
    # the next cuts are tried, then the whole stage, as on a CUDA target.
    kw = dict(batch=2, micro=2, arch=("Qwen3ForCausalLM", "qwen3"), head_dim=16, gpu=None)
    fast = _llama_stages(tmp_path, 8, "1f1b", **kw)
    whole = _llama_stages(tmp_path, 8, "1f1b", extrapolate=False, **kw)
    assert any("was simulated whole" in n for n in fast.notes), fast.notes
    _identical(fast, whole)


def test_the_per_phase_statistics_of_a_deep_stage_are_the_whole_stages(shallow, tmp_path):
    # 16 layers, 2 micro-batches of 2 sequences: without the statistics made again from the records
    # (depth._stats_of_records) this case differs from the whole stage too; the 48-layer case the review found is
    # in benchmarks/cases/test_depth_at_scale.py.
    deep_stage_statistics(tmp_path, layers=16, batch=4, micro=2)


def deep_stage_statistics(tmp_path, layers, batch, micro):
    # A 48-layer Qwen3, 24 layers a stage, 4 micro-batches of 2 sequences of 8 tokens (found by this stop's review):
    # the statistics' total series of the optimizer's "other" phases did not grow alike in the cuts (2, 3 and 4
    # blocks), and extended in a line it stayed the 4-block cut's, 985,088 B where the whole stage's is 5,357,568 B,
    # below its own weights. They are now made again from the extended records (tensors' totals, as the ledger
    # keeps them), every figure as the whole stage's.
    kw = dict(batch=batch, micro=micro, layers=layers, arch=("Qwen3ForCausalLM", "qwen3"), head_dim=16)
    fast = _llama_stages(tmp_path, 8, "1f1b", **kw)
    whole = _llama_stages(tmp_path, 8, "1f1b", extrapolate=False, **kw)
    assert not any("simulated whole" in n for n in fast.notes), fast.notes
    _identical(fast, whole)


def test_an_input_no_depth_runs_raises_its_error_once(shallow, tmp_path):
    # 2 sequences cannot be cut into 4 micro-batches at any depth: the first cut fails, the whole stage is
    # simulated (a cut's failure is no error on the default path) and fails the same way. The user sees that error
    # alone; it was raised inside the handler of the cut's, and the traceback showed both ("During handling of the
    # above exception, another exception occurred").
    from memprof.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"must divide into Pipeline\(microbatches=4\)") as info:
        _llama_stages(tmp_path, 16, "1f1b", batch=2, micro=4)
    assert info.value.__context__ is None and info.value.__cause__ is None
