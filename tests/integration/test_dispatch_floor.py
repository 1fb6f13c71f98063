"""Exact mode's handler at the floor: no wrapper frame around it, and still never traced by dynamo."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memprof
from memprof.collect.dispatch import DispatchMode
from memprof.collect.torch_compat import SKIPS_DYNAMO

MEMPROF_DIR = os.path.dirname(os.path.abspath(memprof.__file__))


def _counting_backend():
    graphs: list[int] = []

    def backend(gm, example_inputs):
        graphs.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"))
        return gm.forward

    return backend, graphs


@pytest.mark.skipif(not SKIPS_DYNAMO, reason="this torch has no per-code dynamo skip: torch's wrapper stays")
def test_the_handler_is_not_wrapped_and_its_code_is_skipped_by_dynamo():
    # torch wraps a mode's handler in torch._disable_dynamo unless the class opts out; memprof opts out
    # and marks the handler's code instead.
    assert DispatchMode.__dict__["__torch_dispatch__"].__code__.co_filename.startswith(MEMPROF_DIR)


def _graph_break_run(profiled: bool):
    torch._dynamo.reset()
    backend, graphs = _counting_backend()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)

    def loss_fn(x):
        h = model[0](x)
        # A graph break at an op: .item() runs eagerly in the compiled frame, under dynamo's frame callback,
        # so the op reaches memprof's handler while dynamo looks at every new frame.
        scale = 1.0 + 0.0 * h.sum().item()
        return F.mse_loss(model[2](model[1](h)) * scale, y)

    compiled = torch.compile(loss_fn, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if profiled:
        with memprof.profile(model, opt, mode="exact") as prof:
            for _ in range(2):
                compiled(x).backward()
                opt.step()
                opt.zero_grad()
        trace = prof.trace
    else:
        for _ in range(2):
            compiled(x).backward()
            opt.step()
            opt.zero_grad()
        trace = None
    from torch._dynamo import convert_frame

    seen = [c() for c in convert_frame.input_codes.seen]
    traced_ours = [c.co_name for c in seen if c is not None and c.co_filename.startswith(MEMPROF_DIR)]
    return graphs, traced_ours, [p.detach().clone() for p in model.parameters()], trace


def test_a_function_compiled_first_inside_the_block_with_a_graph_break_compiles_as_without_memprof():
    plain_graphs, _, plain_params, _ = _graph_break_run(False)
    graphs, traced_ours, params, trace = _graph_break_run(True)
    assert graphs == plain_graphs  # the same graphs, compiled as often
    assert traced_ours == []  # dynamo never looked at a frame of memprof's
    assert all(torch.equal(a, b) for a, b in zip(plain_params, params))  # training unchanged
    assert trace is not None and trace.steps
