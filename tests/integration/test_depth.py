"""``estimate(..., extrapolate=k)``: the repeated stack cut to k, k + 1, k + 2 blocks and the figures extended to the
model's depth, against the whole model simulated: every category at every phase's start, peak and end, to the
byte; and under a pipeline, per stage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memprof
from memprof.errors import InvalidArgumentError
from memprof.simulate.depth import find_stack

from test_parallelize import IDS, Tiny, loss_fn


def _build(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return Tiny(layers=layers)


def _same(a, b) -> None:
    pa = {(p.step, p.phase, p.occurrence): p for p in a.trace.phases}
    pb = {(p.step, p.phase, p.occurrence): p for p in b.trace.phases}
    assert sorted(pa, key=str) == sorted(pb, key=str)
    for key, rec in pa.items():
        assert (rec.start, rec.peak, rec.end) == (pb[key].start, pb[key].peak, pb[key].end), key
    assert (a.peak_bytes, a.trace.peak_step, a.trace.peak_phase) == (b.peak_bytes, b.trace.peak_step,
                                                                    b.trace.peak_phase)


def test_eight_blocks_from_three_four_and_five():
    model = _build(8)
    opt = torch.optim.AdamW(model.parameters())
    whole = memprof.estimate(model, opt, inputs=IDS, targets=IDS, loss_fn=loss_fn)
    cut = memprof.estimate(model, opt, inputs=IDS, targets=IDS, loss_fn=loss_fn, extrapolate=3)
    _same(whole, cut)
    # Parameter counts grow by a block's 4,128 parameters (32 + 32*64 + 64*32) each: extended too.
    assert cut.trace.facts.num_params == whole.trace.facts.num_params == 96 * 32 * 2 + 32 + 8 * 4_128 == 39_200
    assert any(n.startswith("depth: simulated with layers (8 x Block) cut to 3, 4 and 5") for n in cut.notes)
    # A CPU target has no replay, but its cuts' streams are extended all the same and checked against the figures
    # (a phase's peak that moves at full depth: test_depth_pipeline_stream.py).
    assert any(n.startswith("depth: the whole model's allocation stream, the cuts' extended") and
               n.endswith("holds the extended figures at every phase's start, peak and end, and no moment of a "
                          "phase above its peak") for n in cut.notes), cut.notes
    assert cut.device_memory is None and whole.device_memory is None


def test_the_stack_and_the_refusals():
    assert find_stack(_build(4)) == ("layers", 4, "Block")
    with pytest.raises(InvalidArgumentError, match="repeated stack"):
        memprof.estimate(nn.Linear(4, 4), inputs=torch.randn(2, 4), extrapolate=3)
    with pytest.raises(InvalidArgumentError, match="positive int"):
        memprof.estimate(_build(8), inputs=IDS, extrapolate=0)


class _MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class _Stack(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_MLPBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("n,d,batch", [(9, 1000, 100), (21, 512, 1)])
def test_a_cuda_target_replays_the_extended_stream_to_the_byte(n, d, batch):
    # The allocator's cache is no line in depth (the 9 x 1000 stack's reserved peak grows by 96, 96, 104, 96, 98,
    # 96 MiB per block from 3 blocks on), and no rule read off the cuts' figures bounds the whole model's replay
    # from above (the 21 x 512 stack's reserved peak, extended by its larger growth per block, came out 1.9 % under
    # the whole model's). So the stream is extended, not the figures: the whole model's allocation stream made
    # from the cuts' and replayed, which gives the whole model's device figures to the byte, every moment's
    # allocator overhead and outside-torch bytes included.
    with torch.device("meta"):
        model = _Stack(n, d)
    opt = torch.optim.AdamW(model.parameters())
    kw = dict(inputs=torch.empty(batch, d, device="meta"), device="cuda", gpu="h100-80gb")
    whole = memprof.estimate(model, opt, **kw)
    cut = memprof.estimate(model, opt, extrapolate=3, **kw)
    assert any(note.startswith(f"depth: simulated with layers ({n} x _MLPBlock) cut to 3, 4 and 5")
               for note in cut.notes)
    assert any(note.startswith("depth: the device-level figures are the allocator replay of the whole model's")
               for note in cut.notes)
    assert whole.device_memory is not None and whole.fits is True
    assert cut.device_memory == whole.device_memory
    assert (cut.device_peak, cut.fits) == (whole.device_peak, whole.fits)
    assert cut.trace.device == whole.trace.device
    pa = {(p.step, p.phase, p.occurrence): p for p in whole.trace.phases}
    pb = {(p.step, p.phase, p.occurrence): p for p in cut.trace.phases}
    assert pa.keys() == pb.keys()
    for key, rec in pa.items():
        for which in ("start", "peak", "end"):
            exact, extended = getattr(rec, which), getattr(pb[key], which)
            assert exact == extended, (key, which)  # every category, the device's two included, and the total
            assert extended[memprof.Category.ALLOCATOR_OVERHEAD] is not None
    assert (cut.trace.start, cut.trace.peak, cut.trace.end) == (whole.trace.start, whole.trace.peak, whole.trace.end)
    assert cut.peak_bytes == whole.peak_bytes
