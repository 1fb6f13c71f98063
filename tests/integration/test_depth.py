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


def test_the_stack_and_the_refusals():
    assert find_stack(_build(4)) == ("layers", 4, "Block")
    with pytest.raises(InvalidArgumentError, match="repeated stack"):
        memprof.estimate(nn.Linear(4, 4), inputs=torch.randn(2, 4), extrapolate=3)
    with pytest.raises(InvalidArgumentError, match="positive int"):
        memprof.estimate(_build(8), inputs=IDS, extrapolate=0)
