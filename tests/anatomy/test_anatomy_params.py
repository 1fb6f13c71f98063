"""bytes_per_param against the HF "Model training anatomy" and ZeRO (Rajbhandari et al. 2019, §3.1) figures and
the mixed-precision regimes of docs/anatomy.md#mixed-precision-regimes."""

from __future__ import annotations

import pytest

from memprof.anatomy.params import OPTIMIZERS, PRECISIONS, bytes_per_param, bytes_per_param_breakdown
from memprof.errors import UnknownNameError


@pytest.mark.parametrize(
    "precision,optimizer,training,expected",
    [
        ("mixed", "adamw", True, 18),  # HF: 6 weights + 4 grads + 8 AdamW
        ("fp32", "adamw", True, 16),  # 4 + 4 + 8
        ("mixed", "adamw_8bit", True, 12),  # 6 + 4 + 2
        ("fp32", "sgd_momentum", True, 12),  # 4 + 4 + 4
        ("mixed", None, False, 6),  # HF mixed-precision inference
        ("fp32", None, False, 4),
        ("mixed", "adamw", False, 6),  # inference ignores the optimizer
        ("zero", "adam", True, 16),  # ZeRO: 2 + 2 + K=12
        ("zero", "adamw", True, 16),
        ("bf16", "adamw", True, 8),  # 2 + 2 + 2x2 bf16 states (measured with torch 2.13, see docs/anatomy.md)
        ("fp16", "adam", True, 8),
        ("amp", "adamw", True, 16),  # steady 16, peak 18 with the 2 B/param casts
        ("fp32", "sgd", True, 8),
        ("fp32", "adagrad", True, 12),
        ("fp32", "rmsprop", True, 12),
        ("fp32", "lion", True, 12),
        ("bf16", "lion", True, 6),  # 2 + 2 + one bf16 state
        ("fp32", "adafactor", True, 8),  # factored states ~0 per parameter
        ("fp32", None, True, 8),
    ],
)
def test_bytes_per_param(precision, optimizer, training, expected):
    assert bytes_per_param(precision, optimizer, training=training) == expected


def test_breakdowns():
    mixed = bytes_per_param_breakdown("mixed", "adamw")
    assert (mixed.weights, mixed.gradients, mixed.optimizer_states) == (6, 4, 8)
    amp = bytes_per_param_breakdown("amp", "adamw")
    # "16 steady, 18 peak" (docs/anatomy.md#mixed-precision-regimes)
    assert amp.total == 16 and amp.transient_weights == 2 and amp.peak == 18
    # state bytes scale with the state dtype: bf16 AdamW states 2 x 2 B, fp32 2 x 4 B
    assert bytes_per_param_breakdown("bf16", "adamw").optimizer_states == 4
    assert bytes_per_param_breakdown("fp32", "adamw").optimizer_states == 8
    assert bytes_per_param_breakdown("zero", "adamw").optimizer_states == 12
    inference = bytes_per_param_breakdown("fp32", "adamw", training=False)
    assert (inference.gradients, inference.optimizer_states) == (0, 0)


def test_every_combination_is_defined():
    for precision in PRECISIONS:
        for optimizer in OPTIMIZERS:
            assert bytes_per_param(precision, optimizer) > 0


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(UnknownNameError, match="'adamw'"):
        bytes_per_param("fp32", "adamx")
    with pytest.raises(UnknownNameError, match="'mixed'"):
        bytes_per_param("fp8", "adamw")
