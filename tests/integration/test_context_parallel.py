"""Context parallelism, simulated: torch's ring attention (``parallelize_module(attention, mesh,
_ContextParallel(...))``) run through the CUDA flash attention op's handler on fake CPU tensors. A CPU has no
kernel for it, so it is held to arithmetic on the rank's own shapes, not to a CPU run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

DIM, HEADS, SEQ = 128, 4, 1024


class Core(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.core = Core()

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        return x + self.o(self.core(q, k, v).transpose(1, 2).reshape(b, s, -1))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Attention() for _ in range(2)]).bfloat16()


def context_parallel(model, mesh):
    from torch.distributed.tensor.experimental._attention import (_ContextParallel,
                                                                  _enable_context_parallel_dispatcher)
    from torch.distributed.tensor.parallel import parallelize_module

    _enable_context_parallel_dispatcher()
    for block in model:
        parallelize_module(block.core, mesh, _ContextParallel(seq_dim=2,
                                                              attention_type=_ContextParallel.AttentionType.SDPA))
    return model


def test_each_rank_holds_its_share_of_the_sequence():
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    x = torch.randn(1, SEQ // 2, DIM, dtype=torch.bfloat16)  # the rank's half of the sequence
    est = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=x, device="cuda", world_size=2,
                           parallelize=context_parallel)
    whole = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps),
                             inputs=torch.randn(1, SEQ, DIM, dtype=torch.bfloat16), device="cuda")
    peak = est.peak
    # The batch counted is the rank's shard: 512 x 128 x 2 B = 131,072 B (not DTensor's global-shape metadata).
    assert peak[C.INPUTS] == 512 * 128 * 2 == 131_072
    # Saved activations scale with the local sequence: half of the unsplit run's, within the ring's own saves.
    assert peak[C.ACTIVATIONS] < whole.peak[C.ACTIVATIONS] * 0.6
    # The ring gathers the other ranks' keys and values: collective buffers.
    assert peak[C.COMMUNICATION] > 0
    assert any(n.startswith("context parallelism") for n in est.notes)
    # The dispatcher the function switched on is off again.
    assert DTensor._op_dispatcher._custom_op_handlers is handlers
