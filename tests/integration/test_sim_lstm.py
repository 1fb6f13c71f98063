"""``nn.LSTM`` on a CPU target: the workspace oneDNN's training kernel keeps for backward
(memprof/simulate/onednn_rnn.py) and the two bias gradients its backward returns (memprof/simulate/cpu_kernels.py),
held to the real kernel and to real training runs at every phase's peak and end. Before, the simulation had no
workspace: a 64-step LSTM's CPU estimate was 10.0 MB where the run peaked at 42.5 MB."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memprof
from memprof.simulate.onednn_rnn import PAGE, lstm_workspace_bytes

from phases import assert_equal_everywhere


class _Workspaces(TorchDispatchMode):
    """Each real ``mkldnn_rnn_layer`` call: its input's shape and dtype, and the bytes of the workspace it returned
    (None: none)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[int, ...], torch.dtype, "int | None"]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mkldnn_rnn_layer.default:
            workspace = out[3]
            self.calls.append((tuple(args[0].shape), args[0].dtype,
                               None if workspace is None else workspace.untyped_storage().nbytes()))
        return out


def _real_workspaces(lstm: nn.LSTM, x: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype, "int | None"]]:
    with _Workspaces() as seen:
        lstm(x)
    if not seen.calls:
        pytest.skip(f"torch runs no oneDNN LSTM for {x.dtype} on this CPU (its native kernel keeps no workspace)")
    return seen.calls


def test_a_small_layers_workspace_is_seven_pages():
    # 5 steps, batch 3, 8 inputs, 16 hidden units, fp32. Rows: the gates' 4 x 16 = 64 floats (64-byte aligned, not a
    # multiple of 256 elements), the states' max(8, 16) = 16. Regions: the gates 5 * 3 * 64 * 4 = 3,840 B, the hidden
    # states 5 * 3 * 16 * 4 = 960 B, and five of 2 * (5 + 1) * 3 * 16 * 4 = 2,304 B (the layer's states, the cell
    # states, the three differences). Each starts on a page and none fills one: 7 pages.
    assert lstm_workspace_bytes(5, 3, 8, 16, torch.float32, torch.float32) == 7 * PAGE == 28_672
    assert _real_workspaces(nn.LSTM(8, 16), torch.randn(5, 3, 8, requires_grad=True)) == [
        ((5, 3, 8), torch.float32, 28_672)]


def test_a_row_of_a_multiple_of_256_elements_is_padded_by_64_bytes():
    # 64 steps, batch 32, 128 inputs, 256 hidden units, fp32. The gates' row, 1,024 floats, and the states' rows,
    # 256, are multiples of 256: each takes 16 floats more (1,040 and 272); the cell states' rows are not padded.
    gates = 64 * 32 * 1040 * 4  # 8,519,680 B = 2,080 pages
    hidden = 64 * 32 * 272 * 4  # 2,228,224 B = 544 pages
    states = 2 * 65 * 32 * 272 * 4  # 4,526,080 B = 1,105 pages: the layer's states and the two differences
    cells = 2 * 65 * 32 * 256 * 4  # 4,259,840 B = 1,040 pages: the cell states and their difference
    expected = gates + hidden + 3 * states + 2 * cells  # every region a whole number of pages: 8,019 pages
    assert expected == 8019 * PAGE == 32_845_824
    assert lstm_workspace_bytes(64, 32, 128, 256, torch.float32, torch.float32) == expected
    assert _real_workspaces(nn.LSTM(128, 256), torch.randn(64, 32, 128, requires_grad=True))[0][2] == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_shapes_have_the_real_kernels_workspace(dtype):
    rng = random.Random(7)
    for _ in range(6):
        steps, batch, inputs, hidden = rng.randint(1, 40), rng.randint(1, 24), rng.randint(1, 200), rng.randint(1, 200)
        layers = rng.randint(1, 2)
        lstm = nn.LSTM(inputs, hidden, num_layers=layers, bidirectional=rng.random() < 0.5).to(dtype)
        for (s, b, features), cell, real in _real_workspaces(lstm, torch.randn(steps, batch, inputs, dtype=dtype)):
            assert lstm_workspace_bytes(s, b, features, hidden, dtype, cell) == real, (steps, batch, inputs, hidden)


def test_without_grad_mode_the_kernel_keeps_no_workspace():
    with torch.no_grad():
        assert _real_workspaces(nn.LSTM(8, 16), torch.randn(5, 3, 8)) == [((5, 3, 8), torch.float32, None)]


class _Tagger(nn.Module):
    def __init__(self, frozen: bool = False, dtype: torch.dtype = torch.float32, **lstm) -> None:
        super().__init__()
        self.frozen = frozen
        self.lstm = nn.LSTM(16, 24, **lstm)
        self.head = nn.Linear(24 * (2 if lstm.get("bidirectional") else 1), 5)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.frozen:  # a frozen encoder run without grad under a trained head: its kernel keeps no workspace
            with torch.no_grad():
                features = self.lstm(x)[0]
            return self.head(features)
        return self.head(self.lstm(x)[0])


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


@pytest.mark.parametrize("make, shape", [
    (lambda: _Tagger(), (12, 4, 16)),
    (lambda: _Tagger(num_layers=2, bidirectional=True, batch_first=True, dropout=0.25), (3, 9, 16)),
    (lambda: _Tagger(dtype=torch.bfloat16), (12, 4, 16)),
    (lambda: _Tagger(frozen=True), (12, 4, 16)),
], ids=["fp32", "two_bidirectional_layers_batch_first_dropout", "bf16", "frozen_without_grad"])
def test_an_lstms_estimate_is_its_cpu_run_at_every_phase(make, shape):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(*shape, dtype=next(model.parameters()).dtype)
    est = memprof.estimate(model, torch.optim.AdamW, inputs=x, targets=x, loss_fn=_loss, steps=2)
    opt = torch.optim.AdamW([p for p in model.parameters()])
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            loss = _loss(model(x), x)
            loss.backward()
            opt.step()
            opt.zero_grad()
        del loss
    assert_equal_everywhere(est, prof.report())
