"""Which ZeRO set-ups the depth fast path can cut: a rank's flat shard, ceil(elements / N) of each flat buffer
(:func:`memprof.simulate.ranks.uneven_shard`), is a line in the blocks only where N divides a block's elements."""

from __future__ import annotations

import torch
from torch import nn

from memprof.simulate.ranks import uneven_shard


def test_a_zero_shard_is_a_line_in_depth_only_where_the_ranks_divide_a_block():
    block = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, bias=False))  # 8 x 8 + 8 + 8 x 8 = 136 elements
    assert uneven_shard([block], 8, "zero1") is None  # 136 = 17 x 8
    assert "adds 136 elements (torch.float32), which 3 ranks do not divide" in uneven_shard([block], 3, "zero2")
    assert uneven_shard([block], 3, "ddp") is None and uneven_shard([block], 3, None) is None  # no flat shard
    block[0].bias.requires_grad_(False)  # the trainable elements, the gradients' and states' buffer: 128
    assert uneven_shard([block], 8, "zero3") is None
    assert "adds 128 elements (trainable torch.float32), which 17 ranks" in uneven_shard([block], 17, "zero1")
    block[1].to(torch.bfloat16)  # by dtype: 72 in float32 (8 of them frozen), 64 in bfloat16, 136 in all
    assert "adds 72 elements (torch.float32), which 16 ranks" in uneven_shard([block], 16, "zero1")
