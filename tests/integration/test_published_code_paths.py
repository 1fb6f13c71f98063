"""The code paths ``benchmarks/published.py`` reproduces for rows whose run used other library versions: torch
1.10's softmax, which kept its input for backward beside its output (pytorch/pytorch#49600, until torch 1.11),
and litgpt's GPT as its fine-tuning table ran it. Each keeps what its source kept and computes what it computed,
checked here on real CPU tensors and measured by memprof."""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.nn.functional as F

import memprof

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

from published import litgpt_gpt, torch110_softmax


def test_torch110_softmax_keeps_its_input_and_computes_the_same_gradient():
    x = torch.randn(3, 5, 7, requires_grad=True)
    weights = torch.randn(7)
    native = F.softmax
    with torch110_softmax():
        y = F.softmax(x * 2, dim=-1)
        saved = y.grad_fn.saved_tensors
        (y * weights).sum().backward()
    assert F.softmax is native  # put back after the block
    assert [t.shape for t in saved] == [x.shape, x.shape]  # the input (x * 2) and the output
    grad, x.grad = x.grad, None
    (F.softmax(x * 2, dim=-1) * weights).sum().backward()
    assert torch.allclose(grad, x.grad)


def test_torch110_softmax_keeps_one_more_score_tensor_per_call_as_memprof_measures_it():
    # Two softmaxes over (4, 16, 16) fp32 scores: torch 2.13 keeps each output (4 * 16 * 16 * 4 = 4,096 B);
    # torch 1.10 kept each input as well: 2 x 4,096 = 8,192 B more saved for backward at the end of forward.
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Softmax(dim=-1), torch.nn.Linear(16, 16),
                                torch.nn.Softmax(dim=-1))

    def activations(ctx) -> int:
        x = torch.randn(4, 16, 16)
        with memprof.profile(model) as prof:
            with ctx:
                model(x).sum().backward()
        forward = next(p for p in prof.report().trace.phases if p.phase.value == "forward")
        return forward.end[memprof.Category.ACTIVATIONS]

    import contextlib
    assert activations(torch110_softmax()) - activations(contextlib.nullcontext()) == 8_192


def test_litgpt_gpt_runs_forward_and_backward_with_its_shapes():
    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=96, vocab_size=128)
    model = litgpt_gpt(dims).to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    # fused q/k/v: (8 + 2 * 2) heads x 8 = 96 outputs; two RMSNorms per block and one at the end
    assert model.h[0].attn.attn.weight.shape == (96, 64)
    ids = torch.randint(0, 128, (2, 10))
    logits = model(ids)
    assert logits.shape == (2, 10, 128) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
