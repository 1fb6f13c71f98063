"""Operator anatomy: Ivanov et al.'s classes, torch's flop formulas, bytes moved."""

import pytest
import torch
import torch.nn.functional as F

import memprof
from memprof.errors import NotMeasuredError
from memprof.collect.operations import CONTRACTION, ELEMENTWISE, NORMALIZATION, classify


def test_linear_flops_and_bytes_by_hand():
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True)
    with memprof.profile(lin, operations=True) as prof:
        lin(x).sum().backward()
    ops = prof.report().operations()
    fwd = ops[(ops.phase == "forward") & (ops.op == "aten.addmm")].iloc[0]
    assert fwd["class"] == CONTRACTION
    assert fwd["count"] == 1
    # addmm(b, x, W^T): 2 * m * k * n = 2 * 16 * 64 * 32 = 65,536 flops
    assert fwd["flops"] == 65_536
    # reads bias 32*4 + x 16*64*4 + W^T 64*32*4 = 128 + 4,096 + 8,192; writes 16*32*4 = 2,048
    assert fwd["bytes_read"] == 12_416
    assert fwd["bytes_written"] == 2_048
    bwd = ops[(ops.phase == "backward") & (ops["class"] == CONTRACTION)]
    # grad_input (16x32 @ 32x64) and grad_weight (32x16 @ 16x64): 2 * 65,536 flops = twice the forward
    assert bwd.flops.sum() == 2 * 65_536
    by_class = prof.report().operations(by="class")
    assert set(by_class.columns) >= {"phase", "class", "count", "flops", "bytes_read", "bytes_written"}


def test_classes():
    aten = torch.ops.aten
    assert classify(aten.mm.default) == CONTRACTION
    assert classify(aten.convolution_backward.default) == CONTRACTION
    assert classify(aten._softmax.default) == NORMALIZATION
    assert classify(aten.native_layer_norm_backward.default) == NORMALIZATION
    assert classify(aten.add.Tensor) == ELEMENTWISE
    assert classify(aten.gelu_backward.default) == ELEMENTWISE


def test_operations_need_exact_mode_and_the_flag():
    model = torch.nn.Linear(4, 4)
    with memprof.profile(model) as prof:
        model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(NotMeasuredError, match="operations=True"):
        prof.report().operations()
    with memprof.profile(model, mode="light", operations=True) as prof:
        F.relu(model(torch.randn(2, 4))).sum().backward()
    assert any("operations=True needs mode='exact'" in n for n in prof.trace.notes)


def test_operations_round_trip_through_json(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    with memprof.profile(model, operations=True) as prof:
        model(torch.randn(3, 8)).sum().backward()
    path = tmp_path / "ops.json"
    prof.report().save(path)
    assert memprof.load(path).trace.operations == prof.trace.operations
