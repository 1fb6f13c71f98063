"""The pipeline stages of tests/integration/test_depth_pipeline_stream.py at the sizes each defect was found at:
4 micro-batches, both schedules, the GPU target, a 48-layer model. The suite runs each mechanism at the smallest
size that still runs it."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from test_depth_pipeline_stream import (
    deep_stage_statistics,
    first_fsdp2_stage,
    fsdp2_tp_stages,
    shallow,  # noqa: F401  (the fixture that cuts a stage of 8 blocks, used by every case here)
    stage_whose_peak_moves,
)

pytestmark = pytest.mark.usefixtures("shallow")


def test_a_pipeline_stage_under_fsdp2_and_tp_over_four_micro_batches():
    fsdp2_tp_stages(4)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_first_stage_of_fsdp2_stages_over_four_micro_batches_of_two(tmp_path, schedule):
    first_fsdp2_stage(tmp_path, schedule, batch=4, micro=4)


@pytest.mark.parametrize("gpu", ["h100-80gb", None])
def test_a_phase_whose_peak_moves_over_four_micro_batches(tmp_path, gpu):
    stage_whose_peak_moves(tmp_path, gpu, batch=4, micro=4)


def test_the_per_phase_statistics_of_a_48_layer_stage(tmp_path):
    deep_stage_statistics(tmp_path, layers=48, batch=8, micro=4)
