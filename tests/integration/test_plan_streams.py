"""The plan's device-peak prediction from two simulated allocation streams (``memprof.simulate.plan_search``): on a
small Llama the stream interpolated between two simulated batches is, event by event, the stream a simulation of
the batch between makes, and its replay gives the same device-level peak, the allocator's segments included."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from memprof.anatomy.gpus import GpuSpec  # noqa: E402
from memprof.simulate import hf  # noqa: E402
from memprof.simulate.device_memory import replay_of  # noqa: E402
from memprof.simulate.plan_search import Probe, stream_between, stream_shape  # noqa: E402

WIDE = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=16000,
            max_position_embeddings=256)
SMALL_GPU = GpuSpec("small", capacity_bytes=900 * 2**20, compute_capability=(9, 0), context_bytes=0)


@pytest.mark.parametrize("conf", ["expandable_segments:True", ""])
def test_an_interpolated_stream_is_the_simulated_one_and_predicts_its_device_peak(tmp_path, conf):
    (tmp_path / "config.json").write_text(json.dumps(WIDE))

    def simulate(b):
        return hf.estimate_hf(tmp_path, seq_len=64, batch_size=b, precision="bf16", gpu=SMALL_GPU, world_size=2,
                              parallel="zero1", alloc_conf=conf)

    runs = {b: simulate(b) for b in (2, 5, 9)}
    streams = {b: replay_of(est.device_memory).stream() for b, est in runs.items()}
    shapes = {b: stream_shape(s) for b, s in streams.items()}
    assert shapes[2][0] == shapes[5][0] == shapes[9][0]  # the same storages, made and freed in the same order
    between = stream_between(2, streams[2], shapes[9][1], 9, 5)
    # Every event's bytes at batch 5 are on the line through batches 2 and 9: the interpolation rounds nothing.
    assert [n for _seq, _key, n in between] == list(shapes[5][1])
    # So its replay is batch 5's: the device-level peak and the verdict, segments and workspaces included.
    replay = replay_of(runs[2].device_memory)
    def figures(est):  # the device peak, the out-of-memory error, whether memory was pressed
        memory = est.device_memory
        return est.device_peak, memory.oom, memory.oom is not None or memory.num_alloc_retries > 0

    assert replay.figures(between) == figures(runs[5])
    assert replay.figures() == figures(runs[2])  # its own stream, as simulated
    # The search's probe predicts it from the two simulated batches nearest it, as judging a simulation of it would.
    probe = Probe(runs.__getitem__, SMALL_GPU.allocatable_bytes, 64)
    probe.judged(2), probe.judged(9)
    assert probe.predicted(5) == Probe(runs.__getitem__, SMALL_GPU.allocatable_bytes, 64).judged(5)


GEMMA2 = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=128, intermediate_size=256,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=4000, head_dim=32,
              max_position_embeddings=512, sliding_window=48, query_pre_attn_scalar=32, final_logit_softcapping=30.0,
              attn_logit_softcapping=50.0)


def test_the_plan_answers_the_edge_below_an_out_of_memory_band(tmp_path):
    # A small Gemma-2 on a 1100 MiB device, FSDP on 2 ranks, bf16, checkpointing: near the limit the allocator
    # frees its cache and retries, and 24 and 25 samples run out of memory where 26 fit again (simulated below). The
    # plan answers 23, the edge below which every batch fits, not 26.
    from memprof.report.planning import plan_grid

    (tmp_path / "config.json").write_text(json.dumps(GEMMA2))
    gpu = GpuSpec("small", capacity_bytes=1100 * 2**20, compute_capability=(9, 0), context_bytes=0)
    plan = plan_grid(tmp_path, seq_len=256, gpu=gpu, world_size=2, layouts="fsdp", precisions=["bf16"],
                     checkpointing=[True], alloc_conf="")
    (row,) = plan.rows
    assert (row.max_batch_size, row.verified) == (23, True)

    def fits(b):
        return hf.estimate_hf(tmp_path, seq_len=256, batch_size=b, precision="bf16", checkpointing=True, gpu=gpu,
                              world_size=2, parallel="fsdp", alloc_conf="").fits

    assert (fits(23), fits(24), fits(25), fits(26)) == (True, False, False, True)
