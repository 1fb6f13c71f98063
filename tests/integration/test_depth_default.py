"""The default fast path of ``estimate`` (``extrapolate=None``): a deep stack of blocks is simulated cut to 2, 3 and
4 units and extended, its allocation stream with it, to figures identical to the whole model's, to the byte: every
category (the allocator's overhead and the memory outside torch included) at every phase's start, peak and end,
the run's start, peak and end, the per-phase statistics and the device replay's own figures. Checked on a dense
decoder under the HF Trainer's step (whose gradient clipping stacks one norm per parameter: a storage whose bytes
grow with the depth, which the allocator's 512-byte rounding takes out of any line), a mixture-of-experts decoder,
and one whose layers alternate sliding-window and full attention around experts; and where the checks say no, or a
model cut short cannot run, the whole model is simulated instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memprof
from memprof.simulate import depth, hf
from memprof.vocabulary import TENSOR_CATEGORIES

transformers = pytest.importorskip("transformers")
T = transformers

_SMALL = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _identical(fast, whole) -> None:
    """Every figure of the two estimates, to the byte (the per-module tables aside: the cut model's)."""
    assert fast.device_memory == whole.device_memory
    assert (fast.device_peak, fast.fits, fast.peak_bytes) == (whole.device_peak, whole.fits, whole.peak_bytes)
    assert fast.trace.device == whole.trace.device
    assert [(p.step, p.phase, p.occurrence) for p in fast.trace.phases] == \
        [(p.step, p.phase, p.occurrence) for p in whole.trace.phases]
    for a, b in zip(fast.trace.phases, whole.trace.phases):
        assert (a.start, a.peak, a.end) == (b.start, b.peak, b.end), (a.step, a.phase)
    assert (fast.trace.start, fast.trace.peak, fast.trace.end) == (whole.trace.start, whole.trace.peak,
                                                                  whole.trace.end)
    assert (fast.trace.peak_step, fast.trace.peak_phase) == (whole.trace.peak_step, whole.trace.peak_phase)
    assert fast.trace.phase_stats == whole.trace.phase_stats
    assert fast.trace.facts.num_params == whole.trace.facts.num_params
    # What the reconciliation holds the figures against: the formulas, which read the cut model's records and are
    # extended from the cuts' (memprof.simulate.depth_formulas), and the literature's line beside them.
    assert (fast.formula, fast.textbook) == (whole.formula, whole.textbook)


def _tensors(b) -> int:
    return sum(b.counts[:len(TENSOR_CATEGORIES)])


def _fast(est) -> bool:
    return any(n.startswith("depth: simulated with") for n in est.notes) and \
        any(n.startswith("depth: the device-level figures are the allocator replay") for n in est.notes)


@pytest.fixture
def shallow(monkeypatch):
    # The default's threshold is 16 units; these small models have 6 to 8, so that the three architectures run in
    # seconds. The path is the default's all the same (extrapolate=None); test_llama_at_the_threshold runs it as is.
    monkeypatch.setattr(depth, "AUTO_UNITS", 6)


def test_llama_under_the_hf_trainer_with_clipping():
    # 16 layers: the default's own threshold. The clipping's stack of norms is 4 B per parameter tensor, 9 per layer
    # and 3 besides. Cut to 2, 3 and 4 layers it holds 4 x 21, 4 x 30 and 4 x 39 B, rounded to 512, 512 and 512 B:
    # a line of slope 0, where the whole model's 4 x 147 = 588 B round to 1,024 B: the figures' line misses 512 B
    # (Llama-3-8B's 291 tensors, 1,164 B -> 1,536 B, miss 1,024 B). The stream knows each storage's bytes and the
    # category it was made in (temporaries, never moved): what the line misses is added there, at every moment the
    # stack is live.
    cfg = T.LlamaConfig(**_SMALL, intermediate_size=64, num_hidden_layers=depth.AUTO_UNITS)
    kw = dict(seq_len=16, batch_size=2, precision="mixed", gpu="h100-80gb")
    fast = memprof.estimate_hf(cfg, **kw)
    whole = memprof.estimate_hf(cfg, extrapolate=False, **kw)
    assert _fast(fast), fast.notes
    assert not any(n.startswith("depth:") for n in whole.notes)
    _identical(fast, whole)
    # The fast path's per-module table is the cut model's (4 of the 16 layers), which its note says, and so is what
    # is read off it (the advice on checkpointing "the 4 blocks", found by this stop's review).
    assert any("the per-module tables are the cut model's" in n and "the advice on checkpointing the blocks" in n
               for n in fast.notes)
    # The formula column and the textbook line read the run's module calls and optimizer, the cut model's: they
    # showed its optimizer states (428,444 B against the whole model's 1,022,652 B), said in a note. The cuts'
    # formulas are extended as the figures are (_identical holds them to the whole model's), and the note says so.
    assert any("so are the formulas (the per-module rules' activations, the optimizer's states and temporaries)" in n
               for n in fast.notes)
    # One layer fewer than the threshold: the whole model, with no note.
    shallower = T.LlamaConfig(**_SMALL, intermediate_size=64, num_hidden_layers=depth.AUTO_UNITS - 1)
    assert not any(n.startswith("depth:") for n in memprof.estimate_hf(shallower, **kw).notes)


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_mixture_of_experts_and_alternating_attention(shallow, name):
    # gpt-oss's layers alternate sliding-window and full attention: a unit of depth is one of each (the stack's
    # period of kinds, 2), so the cuts hold 4, 6 and 8 of its 12 layers; Mixtral's unit is one layer (8 of them).
    if name == "gpt_oss":
        cfg = T.GptOssConfig(**_SMALL, num_hidden_layers=12, intermediate_size=32, num_local_experts=4,
                             num_experts_per_tok=2, head_dim=8, layer_types=["sliding_attention", "full_attention"] * 6,
                             sliding_window=4)
    else:
        cfg = T.MixtralConfig(**_SMALL, num_hidden_layers=8, intermediate_size=64, num_local_experts=4,
                              num_experts_per_tok=2)
    kw = dict(seq_len=64, batch_size=4, precision="bf16", gpu="h100-80gb")  # activations over the states from 2 on
    fast = memprof.estimate_hf(cfg, **kw)
    whole = memprof.estimate_hf(cfg, extrapolate=False, **kw)
    assert _fast(fast), fast.notes
    if name == "gpt_oss":
        assert any("cut to 2, 3 and 4 blocks per stage" in n and "(12 x GptOssDecoderLayer)" in n for n in fast.notes)
    _identical(fast, whole)


class _Growing(nn.Module):
    """Block ``i`` makes a temporary of ``i + 1`` KiB: the same class, unlike bytes per block."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.i = i
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.ones(256 * (self.i + 1) * self.i, device=x.device)  # 0, 1, 2, ... KiB per block, and more
        return self.lin(x) + scratch.sum()


class _Counting(nn.Module):
    """Refuses to run short of its 8 blocks (a model that reads its own depth)."""

    def __init__(self, block: type, n: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block(i) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.layers) != 8:
            raise RuntimeError(f"this model has 8 blocks, not {len(self.layers)}")
        for layer in self.layers:
            x = layer(x)
        return x


class _Plain(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def test_what_does_not_check_is_simulated_whole(monkeypatch):
    monkeypatch.setattr(depth, "AUTO_UNITS", 6)
    x = torch.randn(4, 16)
    model = nn.Sequential(*(_Growing(i) for i in range(8)))
    fast = memprof.estimate(model, inputs=x, device="cuda", gpu="h100-80gb")
    whole = memprof.estimate(model, inputs=x, device="cuda", gpu="h100-80gb", extrapolate=False)
    assert any(n.startswith("depth: the model (8 x _Growing) was simulated whole") for n in fast.notes), fast.notes
    _identical(fast, whole)
    # The same run again (a plan's next batch): no cut is tried, the whole model is simulated at once.
    cuts = []
    real_cut = depth._cut
    monkeypatch.setattr(depth, "_cut", lambda *a: cuts.append(a) or real_cut(*a))
    again = memprof.estimate(model, inputs=torch.randn(8, 16), device="cuda", gpu="h100-80gb")
    assert cuts == [] and any(n.startswith("depth: simulated whole: the cuts of this model did not check")
                              for n in again.notes), again.notes
    # Another run of it (another optimizer) tries its cuts.
    memprof.estimate(model, torch.optim.SGD(model.parameters()), inputs=x, device="cuda", gpu="h100-80gb")
    assert len(cuts) >= 3  # 3, and one more where the peak moved between them
    # A model cut short that fails is no error of the default's: the whole model runs.
    counting = _Counting(_Plain)
    fast = memprof.estimate(counting, inputs=x, device="cuda", gpu="h100-80gb")
    assert any("a model cut short of it failed (SimulationError)" in n for n in fast.notes), fast.notes
    _identical(fast, memprof.estimate(counting, inputs=x, device="cuda", gpu="h100-80gb", extrapolate=False))
    # Asked for, a cut's failure is the error it is.
    with pytest.raises(Exception, match="this model has 8 blocks, not 3"):
        memprof.estimate(counting, inputs=x, device="cuda", gpu="h100-80gb", extrapolate=3)


def test_the_peak_the_extended_figures_put_elsewhere_is_taken_there():
    # Llama-3-70B under the HF Trainer's step: cut to 2, 3 and 4 layers its peak is step 1's optimizer step
    # (1,137,264,758,272 B extended), which the whole model's step 1 forward outgrows (1,149,838,824,448 B: the
    # 80 layers' activations against the optimizer's states of the 128,256-token embedding and head). The
    # extended phase records are exact; the run's peak is the largest of them, the first such in time, as the
    # ledger keeps it (benchmarks/depth_default.py --configs 70b checks it to the byte against the whole model).
    # Here a small model's record, its peak pointed at a smaller phase's, as the cuts would point it.
    cfg = T.LlamaConfig(**_SMALL, intermediate_size=64, num_hidden_layers=2)
    whole = memprof.estimate_hf(cfg, seq_len=16, batch_size=2, precision="mixed", gpu="h100-80gb")
    trace = whole.trace
    smaller = next(r for r in trace.phases if _tensors(r.peak) < _tensors(trace.peak))
    import dataclasses

    pointed = dataclasses.replace(trace, peak=smaller.peak, peak_step=smaller.step, peak_phase=smaller.phase,
                                  peak_tags=smaller.tags_peak)
    moved, note = depth._peak_moved(dataclasses.replace(whole, trace=pointed))
    assert (moved.trace.peak, moved.trace.peak_step, moved.trace.peak_phase, moved.trace.peak_tags) == \
        (trace.peak, trace.peak_step, trace.peak_phase, trace.peak_tags)
    assert moved.trace.peak_module is None
    assert note.startswith(f"depth: at full depth the peak is step {trace.peak_step} {trace.peak_phase.value}'s")
    assert depth._peak_moved(whole) == (whole, None)


def test_a_stack_whose_last_blocks_differ_is_simulated_whole(shallow):
    # The last 2 of 8 layers frozen: the cuts hold the first blocks, all trainable, and their line stood for the
    # frozen ones too (found by this change's review: peak 1,714,260 B where the whole model's is 1,516,556 B,
    # gradients 362,624 B against 288,384 B, with a note that the figures were exact). A block unlike the cuts'
    # (requires_grad, a hook of its own, another dtype ...) sends the model to a whole simulation, with the reason.
    cfg = T.LlamaConfig(**_SMALL, intermediate_size=64, num_hidden_layers=8)
    model = hf.build_model(hf.load_config(cfg)).model
    for layer in model.model.layers[6:]:
        layer.requires_grad_(False)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    kw = dict(inputs=ids, loss_fn=lambda out: out.logits.float().sum(), device="cpu")

    def opt(ps):
        return torch.optim.AdamW([p for p in ps if p.requires_grad])

    fast = memprof.estimate(model, opt, **kw)
    assert any(n.startswith("depth: model.layers (8 x LlamaDecoderLayer) was simulated whole, since its blocks are "
                            "not alike (block 6 has parameter ") and "requires_grad=False" in n for n in fast.notes)
    _identical(fast, memprof.estimate(model, opt, extrapolate=False, **kw))
    # Every block alike again: the fast path.
    model.model.layers[6:].requires_grad_(True)
    assert _fast_cpu(memprof.estimate(model, opt, **kw))


def test_the_step_temporaries_of_two_parameter_groups_are_the_whole_models(shallow):
    # AdamW (foreach, fp32) over two groups, the embedding and head (2 x 768 x 32 x 4 B = 196,608 B of temporaries
    # in its step) and the blocks (37,120 B a block): in the cuts (2, 3, 4 blocks: at most 148,480 B) the first
    # group's are the largest, at 8 blocks (297,088 B) the blocks'. A line through the cuts' largest stayed
    # 196,608 B (found by this stop's review, at 24 layers: 524,288 B against 891,008 B); each group's line is
    # extended, then the largest taken.
    V = 768
    cfg = T.LlamaConfig(**{**_SMALL, "vocab_size": V}, intermediate_size=64, num_hidden_layers=8,
                        tie_word_embeddings=False)

    def grouped(ps):
        ps = list(ps)
        return torch.optim.AdamW([{"params": [p for p in ps if p.shape[0] == V]},
                                  {"params": [p for p in ps if p.shape[0] != V]}], foreach=True)

    kw = dict(optimizer=grouped, seq_len=4, batch_size=1, precision="fp32", device="cpu")
    fast = memprof.estimate_hf(cfg, **kw)
    assert _fast_cpu(fast), fast.notes
    whole = memprof.estimate_hf(cfg, extrapolate=False, **kw)
    assert whole.formula["temporaries"] > 196_608  # the blocks' group, at full depth
    _identical(fast, whole)


def _fast_cpu(est) -> bool:
    return any(n.startswith("depth: simulated with") for n in est.notes)


def test_a_peak_that_moves_between_the_cuts_is_extended_record_by_record(shallow, monkeypatch):
    # A small Mixtral at 16 tokens holds its peak in the optimizer step at 2 layers and in the backward from 3 on
    # (a checkpointed Llama-3-8B under ZeRO-1 at one sample: a forward of 4 layers, the optimizer step of 5 and 6):
    # two records' lines crossing. Every record's figures are affine in the three cuts, so each extends in its own
    # line, exact, and the whole model's peak is the largest of them: the cuts of 2, 3 and 4 layers are enough
    # (before, the default dropped the cut to 2 and simulated 5, and 6 where the peak moved again, then the whole).
    cfg = T.MixtralConfig(**_SMALL, num_hidden_layers=8, intermediate_size=64, num_local_experts=4,
                          num_experts_per_tok=2)
    # AdamW's for-loop step, whose temporaries are one parameter's at a time: CUDA's default, the foreach step, holds
    # a square root of every state at once and keeps the peak in the optimizer step at every cut.
    kw = dict(seq_len=16, batch_size=2, precision="bf16", gpu="h100-80gb", optimizer=_for_loop_adamw)
    cuts = []
    real_cut = depth._cut
    monkeypatch.setattr(depth, "_cut", lambda *a: cuts.append(a[-1]) or real_cut(*a))
    fast = memprof.estimate_hf(cfg, **kw)
    assert _fast(fast), fast.notes
    assert any("cut to 2, 3 and 4 blocks per stage" in n for n in fast.notes) and cuts == [2, 3, 4]
    _identical(fast, memprof.estimate_hf(cfg, extrapolate=False, **kw))
    # The cuts as simulated: the peak in another record at 2 layers than at 3 and 4.
    ests = [memprof.estimate_hf(T.MixtralConfig(**_SMALL, num_hidden_layers=n, intermediate_size=64,
                                                num_local_experts=4, num_experts_per_tok=2), extrapolate=False, **kw)
            for n in (2, 3, 4)]
    places = [(e.trace.peak_step, e.trace.peak_phase) for e in ests]
    assert places[0] != places[1] == places[2], places


def _for_loop_adamw(params):
    return torch.optim.AdamW(params, foreach=False)


def _offloaded(model, mesh):
    """FSDP2 with CPUOffloadPolicy on every decoder layer and the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    policy = CPUOffloadPolicy(pin_memory=False)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    return fully_shard(model, mesh=mesh, offload_policy=policy)


def test_cpu_offloads_device_peak_is_the_whole_models_where_the_peak_moves_between_the_cuts(shallow):
    # Under CPUOffloadPolicy the device peak is read off each cut's peak (ParallelRun.host_split), outside the
    # trace. Here the peak is step 1's forward at 2 layers and its backward at 3 and 4 (found by this change's
    # review): taken at the backward's record, the 2-layer cut's device figure was still its forward's, the three
    # were no line, and the lenient extension kept the 4-layer cut's: 37,120 B under the whole model's. A figure
    # read off a cut's own peak is never re-based, and extends only in a line (else more cuts, then the whole).
    cfg = T.LlamaConfig(**{**_SMALL, "vocab_size": 8000}, intermediate_size=64, num_hidden_layers=8)
    kw = dict(seq_len=8, batch_size=1, precision="bf16", device="cpu", world_size=2, checkpointing=True,
              parallelize=_offloaded)
    fast, whole = memprof.estimate_hf(cfg, **kw), memprof.estimate_hf(cfg, extrapolate=False, **kw)
    assert (fast.device_peak_bytes, fast.host_bytes) == (whole.device_peak_bytes, whole.host_bytes)
    assert any(n.startswith("depth: simulated with") for n in fast.notes), fast.notes
    # The split's note gives the figures at full depth, not the largest cut's.
    said = [n for n in fast.notes if n.startswith("CPUOffloadPolicy: host memory ")]
    assert len(said) == 1 and f"host memory {whole.host_bytes:,} B and device peak {whole.device_peak_bytes:,} B" \
        in said[0], said


def test_a_record_as_large_as_the_peaks_and_earlier_holds_it():
    # At full depth two records can hold the same peak to the byte (a 26-layer Llama's step 1 forward and backward,
    # found by this change's review): the whole model's peak is the first moment of the largest total, the earlier
    # record's; the extended run kept the later one, where its cuts had it. Here a small model's record, an earlier
    # phase made to hold the peak's bytes.
    import dataclasses

    cfg = T.LlamaConfig(**_SMALL, intermediate_size=64, num_hidden_layers=2)
    whole = memprof.estimate_hf(cfg, seq_len=16, batch_size=2, precision="mixed", gpu="h100-80gb")
    trace = whole.trace
    at = trace.phases.index(trace.peak_record())
    assert at > 0
    phases = list(trace.phases)
    phases[0] = dataclasses.replace(phases[0], peak=trace.peak, tags_peak=())
    steps = tuple(dataclasses.replace(s, phases=tuple(p for p in phases if p.step == s.index)) for s in trace.steps)
    tied = dataclasses.replace(whole, trace=dataclasses.replace(trace, steps=steps))
    moved, note = depth._peak_moved(tied)
    first = tied.trace.phases[0]
    assert (moved.trace.peak_step, moved.trace.peak_phase, moved.trace.peak_tags) == (first.step, first.phase, ())
    assert note is not None and moved.trace.peak_module is None


def _streams_of_storages(replay) -> list[int]:
    """The stream each storage of a replay's stream is made on, in the order made (the switches' rule:
    :class:`memprof.collect.streams.StreamUse`)."""
    from bisect import bisect_left

    at = [seq for seq, _stream in replay.streams.switches]
    out = []
    for seq, _key, nbytes in replay.stream():
        if nbytes >= 0:
            i = bisect_left(at, seq)
            out.append(replay.streams.switches[i - 1][1] if i else 0)
    return out


def test_an_fsdp2_rank_on_a_gpu_keeps_its_side_streams_in_the_extended_stream(shallow):
    # FSDP2 makes its all-gather outputs on a copy-in stream and its reduce-scatter outputs on another
    # (tests/integration/test_side_streams.py); the switches are tokens of the stream like the moments, so each
    # block's run of events carries its own, and the whole model's stream places every storage on the stream the
    # whole model's run made it on. Before, a run that switched streams was simulated whole.
    from memprof.simulate.device_memory import replay_of
    from memprof.simulate.plan_precision import fsdp_parallelize

    cfg = T.LlamaConfig(num_hidden_layers=6, intermediate_size=64, **_SMALL)
    kw = dict(seq_len=32, batch_size=2, precision="bf16", gpu="h100-80gb", world_size=4,
              parallelize=fsdp_parallelize())
    fast, whole = memprof.estimate_hf(cfg, **kw), memprof.estimate_hf(cfg, extrapolate=False, **kw)
    assert _fast(fast), fast.notes
    _identical(fast, whole)
    ours, theirs = replay_of(fast.device_memory), replay_of(whole.device_memory)
    placed = _streams_of_storages(ours)
    assert placed == _streams_of_storages(theirs)
    assert len(set(placed) - {0}) >= 2  # the copy-in and reduce-scatter streams at least



def test_a_stream_the_first_cuts_do_not_align_settles_with_more_blocks(shallow, monkeypatch):
    # Llama-3-8B under memprof's FSDP with checkpointing at batch 7: the first block the backward meets frees the
    # logits' gradient where every other block frees the previous block's gathered parameters, and with only one
    # other block in the cut to 2 the tokens' alignment took the wrong one ("did not grow by the same events per
    # block"); from 3 blocks on it aligns (benchmarks/plan_scale.py's grid fell back to the whole model there).
    # Here the refusal is made to happen at the first cuts of a small model: the default takes one block more,
    # and its figures are the whole model's. It does so once: a stream that does not settle at the next cuts (a
    # pipeline stage's under 1F1B) is simulated whole after one cut more.
    from memprof.simulate import depth_stream

    real = depth_stream.extended_stream
    starts = []

    def refusing_the_first(cuts, more, rounding):
        starts.append(more)
        if len(starts) == 1:
            return "its allocation stream did not grow by the same events per block"
        return real(cuts, more, rounding)

    monkeypatch.setattr(depth, "extended_stream", refusing_the_first)
    cfg = T.LlamaConfig(num_hidden_layers=8, intermediate_size=64, **_SMALL)
    kw = dict(seq_len=16, batch_size=2, precision="bf16", gpu="h100-80gb", world_size=4, parallel="fsdp")
    fast = memprof.estimate_hf(cfg, **kw)
    # Blocks left to add after the largest cut, each time the stream was extended: after the cut to 4, then to 5.
    assert starts == [8 - 4, 8 - 5], starts
    k = 3
    assert any(n.startswith(f"depth: simulated with model.layers (8 x LlamaDecoderLayer) cut to {k}, {k + 1} and "
                            f"{k + 2}") for n in fast.notes), fast.notes
    assert _fast(fast)
    monkeypatch.setattr(depth, "extended_stream", real)
    _identical(fast, memprof.estimate_hf(cfg, extrapolate=False, **kw))


def test_a_growing_storage_that_moves_category_under_fsdp2():
    # Under FSDP2 the HF Trainer's clipping stacks one norm per parameter (4 B x 147 tensors here, 16 layers: 588 B,
    # 1,024 B on the device, where the line through the cuts' 512, 512, 512 B says 512) and the stack, made a
    # temporary, then goes into the all-reduce of the total norm: it moves category while it lives. What the line
    # misses goes to the category it is in at each moment (the ledger records where each storage moved to); before,
    # such a storage stopped the fast path and the whole model was simulated (Llama-3-8B's bf16-params rows).
    from memprof.simulate.plan_precision import fsdp_parallelize

    cfg = T.LlamaConfig(**_SMALL, intermediate_size=64, num_hidden_layers=depth.AUTO_UNITS)
    kw = dict(seq_len=16, batch_size=2, precision="fp32", gpu="h100-80gb", world_size=4,
              parallelize=fsdp_parallelize())
    fast, whole = memprof.estimate_hf(cfg, **kw), memprof.estimate_hf(cfg, extrapolate=False, **kw)
    assert _fast(fast), fast.notes
    _identical(fast, whole)


def test_figures_the_first_cuts_do_not_make_affine_settle_with_more_blocks(shallow):
    # memprof's FSDP with checkpointing on a small Llama: cut to 2, 3 and 4 layers the figures grow unevenly (the
    # units next to the embeddings and the head gather apart while there are few others); from 3, 4 and 5 they are
    # affine and the stream extends, to the whole model's figures. Before, it was simulated whole.
    cfg = T.LlamaConfig(num_hidden_layers=8, intermediate_size=64, **_SMALL)
    kw = dict(seq_len=16, batch_size=2, precision="bf16", gpu="h100-80gb", world_size=4, parallel="fsdp",
              checkpointing=True)
    fast = memprof.estimate_hf(cfg, **kw)
    assert any(n.startswith("depth: simulated with model.layers (8 x LlamaDecoderLayer) cut to 3, 4 and 5")
               for n in fast.notes), fast.notes
    assert _fast(fast)
    _identical(fast, memprof.estimate_hf(cfg, extrapolate=False, **kw))


def test_figures_that_settle_from_4_blocks_take_a_third_set_of_cuts(shallow, monkeypatch):
    # GPT-2 XL on an FSDP rank of 8 peaks in backward at its end (the gradients, the logits' temporaries) with 2 and
    # 3 blocks and at its start (the activations) from 4 on, so its figures are a line from 4, 5 and 6 blocks only
    # (benchmarks/cases/test_depth_at_scale.py). No model small enough for the suite does that; here the check of
    # the first two sets of cuts is made to fail as GPT-2 XL's did, the third checked as it is. Before, figures
    # took one set more and then the whole model.
    seen: list[int] = []
    check = depth._not_affine

    def uneven_twice(ests):
        n = ests[0].trace.facts.num_params  # which set of cuts: its smallest cut's parameters
        seen.extend([] if n in seen else [n])
        return "1, 2, 4 bytes grow unevenly" if seen.index(n) < 2 else check(ests)

    monkeypatch.setattr(depth, "_not_affine", uneven_twice)
    cfg = T.LlamaConfig(num_hidden_layers=8, intermediate_size=64, **_SMALL)
    kw = dict(seq_len=16, batch_size=2, precision="bf16", gpu="h100-80gb", world_size=4, parallel="fsdp")
    fast = memprof.estimate_hf(cfg, **kw)
    assert any(n.startswith("depth: simulated with model.layers (8 x LlamaDecoderLayer) cut to 4, 5 and 6")
               for n in fast.notes), fast.notes
    assert len(seen) == 3 and _fast(fast)
    _identical(fast, memprof.estimate_hf(cfg, extrapolate=False, **kw))


@pytest.mark.parametrize("parallel", ["zero1", "zero2"])
def test_a_rank_whose_communication_is_not_measured_is_cut_and_extended(shallow, parallel):
    # DeepSpeed's ZeRO-1/2 buckets are not estimated: their ranks' records leave communication unmeasured (None),
    # and the per-phase statistics' total is the sum of the measured categories. The extended records' statistics
    # were made again with a total of None wherever a tensor category was unmeasured, which the statistics' total
    # series did not match: every such estimate was simulated whole after its cuts (18 of the 48 estimates of the
    # 20-row Llama-3-8B plan, found by timing it).
    cfg = T.LlamaConfig(num_hidden_layers=8, intermediate_size=64, **_SMALL)
    kw = dict(seq_len=16, batch_size=2, precision="bf16", gpu="h100-80gb", world_size=4, parallel=parallel)
    fast, whole = memprof.estimate_hf(cfg, **kw), memprof.estimate_hf(cfg, extrapolate=False, **kw)
    assert fast.trace.peak["communication"] is None  # what the case is about: a tensor category not measured
    assert _fast(fast), fast.notes
    _identical(fast, whole)


def test_bytes_the_line_misses_at_a_zero_ranks_step_peak_are_not_placed_there(shallow):
    # On 2 ranks the same model's ZeRO-1 states end step 0 at 46,080, 64,512 and 82,944 B with 2, 3 and 4 layers
    # (18,432 B a layer) and at 157,696 B with 8, 1,024 B above the line: a storage that grows with the depth
    # rounds to the allocator's 512 B. The stream places such bytes at each moment, but a ZeRO rank's step peak is
    # no moment of its stream: it is the rank's share of the replica's (LayoutPlan.finish), and the bytes went to
    # the temporaries there (8,192 B against the whole model's 7,168 B, the states 1,024 B short). The whole model
    # is simulated instead, with a note.
    cfg = T.LlamaConfig(num_hidden_layers=8, intermediate_size=64, **_SMALL)
    kw = dict(seq_len=16, batch_size=2, precision="bf16", gpu="h100-80gb", world_size=2, parallel="zero1")
    fast, whole = memprof.estimate_hf(cfg, **kw), memprof.estimate_hf(cfg, extrapolate=False, **kw)
    assert any("since the line through the cuts missed bytes at step 0 optimizer's peak" in n for n in fast.notes)
    _identical(fast, whole)


def test_a_zero_ranks_phase_peak_that_moves_at_full_depth_keeps_communication_unmeasured(shallow):
    # Mixtral on 3 ZeRO-2 ranks: each backward's peak is another moment at full depth, taken from the extended
    # stream, whose counts said 0 for the communication the rank's records leave unmeasured; with every tensor
    # category then measured the replay added its device terms to those records (2,247,098,368 B against the whole
    # model's 28,452,352 B at step 0's backward peak; found by this stop's review).
    cfg = T.MixtralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=12, num_attention_heads=4,
                          num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
                          max_position_embeddings=64)
    # The for-loop step, as in test_a_peak_that_moves_between_the_cuts_is_extended_record_by_record: CUDA's foreach
    # step would hold each step's peak.
    kw = dict(seq_len=16, batch_size=2, precision="fp32", gpu="h100-80gb", world_size=3, parallel="zero2",
              optimizer=_for_loop_adamw)
    fast, whole = memprof.estimate_hf(cfg, **kw), memprof.estimate_hf(cfg, extrapolate=False, **kw)
    assert _fast(fast) and any("peak is another moment than the cuts'" in n for n in fast.notes), fast.notes
    assert all(p.peak["communication"] is None for p in fast.trace.phases)
    _identical(fast, whole)
