"""The caching allocator's pools are per stream, and the replay places each storage on the stream the run made it
on: FSDP2 makes its all-gather outputs on a copy-in stream and its reduce-scatter outputs (the sharded gradients'
storage) on a reduce-scatter stream (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), and a block freed
on one stream is taken again only by a request on the same stream (c10/cuda/CUDACachingAllocator.cpp,
``get_free_block``). Published FSDP2 peaks (torchtitan, Llama 3.1 8B on 8 and 128 H100s) came out 7.1 % and
2.2 % low when the replay held every storage on one stream."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import memprof
from memprof.anatomy.alloc_config import AllocatorConfig
from memprof.collect.streams import StreamUse
from memprof.simulate.alloc_stream import FREE, replay_stream
from memprof.simulate.device_memory import replay_of

from test_parallelize import IDS, build, loss_fn

MiB = 2**20


def test_a_block_freed_on_a_side_stream_is_not_taken_by_the_current_stream():
    # 20 MiB made on stream 1 and freed, then 20 MiB asked on stream 0. Both are large requests of a size that
    # rounds to itself (a multiple of 2 MiB, over 10 MiB: its own segment), so on one stream the second takes the
    # first's cached block (20 MiB reserved); on two, the first stays in stream 1's pool and the second maps a
    # segment of its own: 20 + 20 = 40 MiB reserved.
    stream = [(1, 100, 20 * MiB), (2, 100, FREE), (3, 200, 20 * MiB)]
    one_pool = replay_stream(stream, [3], AllocatorConfig())[1]
    switches = ((0, 1), (1, 0))  # stream 1 current before seq 1 was made, stream 0 again before seq 2
    two_pools = replay_stream(stream, [3], AllocatorConfig(), streams=StreamUse(switches=switches))[1]
    assert (one_pool.peak_reserved, two_pools.peak_reserved) == (20 * MiB, 40 * MiB)
    assert one_pool.peak_allocated == two_pools.peak_allocated == 20 * MiB


def test_a_switch_places_only_storages_made_after_it():
    # Switches are noted at the ledger's event count: a storage is on the stream of the last switch noted at a
    # smaller seq. With switches at 4 (to 1), 5 (to 0) and 8 (to 1): the storage made at seq 4 is stream 0's, at
    # 5 stream 1's, at 8 stream 0's, at 9 stream 1's. 12 MiB each (own segments), the first two freed before the
    # last two are made: each of those finds the freed block of its own stream, so two segments serve all four:
    # 2 x 12 = 24 MiB. A switch applied to the storage made at its own seq would put seq 4 (or 8) on stream 1, and
    # one of the later requests would find no block of its stream: 36 MiB.
    stream = [(4, 1, 12 * MiB), (5, 2, 12 * MiB), (6, 1, FREE), (7, 2, FREE), (8, 3, 12 * MiB), (9, 4, 12 * MiB)]
    alloc = replay_stream(stream, [9], AllocatorConfig(), streams=StreamUse(switches=((4, 1), (5, 0), (8, 1))))[1]
    assert alloc.peak_reserved == 24 * MiB
    moved = replay_stream(stream, [9], AllocatorConfig(), streams=StreamUse(switches=((3, 1), (5, 0), (8, 1))))[1]
    assert moved.peak_reserved == 36 * MiB  # seq 4 now made after the switch to stream 1


def _fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def test_an_fsdp2_rank_replays_its_collectives_on_their_streams_and_reserves_more():
    native = torch.cpu.stream
    est = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                           world_size=2, rank=0, parallelize=_fsdp, gpu="h100")
    assert torch.cpu.stream is native  # the noting context is gone after the estimate
    replay = replay_of(est.device_memory)
    assert replay is not None
    sides = {stream for _seq, stream in replay.streams.switches if stream}
    assert len(sides) >= 2  # the all-gather copy-in stream and the reduce-scatter stream at least
    one_pool = dataclasses.replace(replay, streams=StreamUse())
    with_streams, without = replay.figures()[0], one_pool.figures()[0]
    # The same storages at the same moments: allocated is the same; reserved only grows with more pools.
    assert with_streams > without
    assert with_streams - replay.outside == est.device_memory.peak_reserved


def test_the_noting_context_is_gone_when_the_step_raises():
    native = torch.cpu.stream

    def failing(model, opt, inputs, targets):
        model(inputs).sum().backward()
        raise KeyError("the user's step fails")

    with pytest.raises(KeyError, match="the user's step fails"):  # the user's error, as it was raised
        memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, train_step=failing,
                         world_size=2, rank=0, parallelize=_fsdp, gpu="h100")
    assert torch.cpu.stream is native


def test_held_storages_wait_for_their_events_as_a_rate_limiter_allows():
    # FSDP1's gathered flat parameters, three units of 20 MiB gathered (resized up) and freed (resized to 0) in
    # turn. Each free waits for its events; the limiter (2) lets two wait, and a gather while two wait releases the
    # oldest first. Gather A; free A (A waits); gather B: a new segment (A is not reusable), free B (A, B wait);
    # gather C: two wait, A released first and reused: reserved 40 MiB. Unheld, every gather reuses one block:
    # 20 MiB. Unlimited (the CPU ahead of every unit), all three wait: 60 MiB.
    stream = [(1, 10, 20 * MiB), (2, 10, 0), (3, 11, 20 * MiB), (4, 11, 0), (5, 12, 20 * MiB), (6, 12, 0)]
    held = StreamUse(held=((10, 2), (11, 2), (12, 2)))
    assert replay_stream(stream, [6], AllocatorConfig())[1].peak_reserved == 20 * MiB
    limited = replay_stream(stream, [6], AllocatorConfig(), streams=held)[1]
    assert (limited.peak_reserved, limited.peak_allocated) == (40 * MiB, 20 * MiB)
    assert limited.peak_active == 40 * MiB  # A awaiting while B was made
    unlimited = StreamUse(held=((10, 3), (11, 3), (12, 3)))
    assert replay_stream(stream, [6], AllocatorConfig(), streams=unlimited)[1].peak_reserved == 60 * MiB
