"""The plan's device-peak prediction from two simulated allocation streams (``memprof.simulate.plan_search``): on a
small Llama the stream interpolated between two simulated batches is, event by event, the stream a simulation of
the batch between makes, and its replay gives the same device-level peak, the allocator's segments included."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from memprof.anatomy.gpus import GpuSpec  # noqa: E402
from memprof.simulate import hf  # noqa: E402
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
    streams = {b: est.device_memory.replay.stream() for b, est in runs.items()}
    shapes = {b: stream_shape(s) for b, s in streams.items()}
    assert shapes[2][0] == shapes[5][0] == shapes[9][0]  # the same storages, made and freed in the same order
    between = stream_between(2, streams[2], shapes[9][1], 9, 5)
    # Every event's bytes at batch 5 are on the line through batches 2 and 9: the interpolation rounds nothing.
    assert [n for _seq, _key, n in between] == shapes[5][1]
    # So its replay is batch 5's: the device-level peak and the verdict, segments and workspaces included.
    replay = runs[2].device_memory.replay
    assert replay.figures(between) == (runs[5].device_peak, runs[5].device_memory.oom)
    assert replay.figures() == (runs[2].device_peak, runs[2].device_memory.oom)  # its own stream, as simulated
    # The search's probe predicts it from the two simulated batches nearest it, as judging a simulation of it would.
    probe = Probe(runs.__getitem__, SMALL_GPU.allocatable_bytes, 64)
    probe.judged(2), probe.judged(9)
    assert probe.predicted(5) == Probe(runs.__getitem__, SMALL_GPU.allocatable_bytes, 64).judged(5)
