"""ZeRO's Table I per rank: what each layout divides by the world size (memprof.analyse.reconciler.sharding)."""

from __future__ import annotations

import pytest

from memprof import Category as C
from memprof.record.parts import RankInfo
from memprof.analyse.reconciler.sharding import shard_formula, zero_stage


def _values():
    # A model of 1,001 fp32 parameters under AdamW: weights 4,004, gradients 4,004, states 8,008 + 4 step bytes,
    # the step's temporaries 12,012; activations are per rank already.
    return {C.WEIGHTS: 4_004, C.GRADIENTS: 4_004, C.OPTIMIZER_STATES: 8_012, C.TEMPORARIES: 12_012,
            C.ACTIVATIONS: 777, C.INPUTS: None}


@pytest.mark.parametrize("layout, world, expect", [
    # 1 shards the states (and the step working on them), 2 also the gradients, 3 (FSDP) also the weights;
    # each x / N rounded half up: 8,012 / 3 = 2,670.67 -> 2,671; 4,004 / 3 = 1,334.67 -> 1,335; 12,012 / 3 = 4,004.
    ("ddp", 3, (4_004, 4_004, 8_012, 12_012)),
    ("zero1", 3, (4_004, 4_004, 2_671, 4_004)),
    ("zero2", 3, (4_004, 1_335, 2_671, 4_004)),
    ("zero3", 3, (1_335, 1_335, 2_671, 4_004)),
    ("fsdp2", 8, (501, 501, 1_002, 1_502)),  # 500.5 -> 501, 1,001.5 -> 1,002, 1,501.5 -> 1,502
    ("fsdp1", 1, (4_004, 4_004, 8_012, 12_012)),
])
def test_each_layout_divides_what_it_shards(layout, world, expect):
    values = _values()
    shard_formula(values, RankInfo(rank=0, world_size=world, layout=layout))
    assert (values[C.WEIGHTS], values[C.GRADIENTS], values[C.OPTIMIZER_STATES], values[C.TEMPORARIES]) == expect
    assert values[C.ACTIVATIONS] == 777 and values[C.INPUTS] is None  # per rank already; no formula stays none


def test_layouts_memprof_cannot_read_shard_nothing():
    assert zero_stage(None) is None
    assert zero_stage(RankInfo(rank=0, world_size=4, layout="deepspeed")) is None
    assert zero_stage(RankInfo(rank=0, world_size=4, layout=None)) is None
    values = _values()
    shard_formula(values, RankInfo(rank=0, world_size=4, layout="deepspeed"))
    assert values == _values()
