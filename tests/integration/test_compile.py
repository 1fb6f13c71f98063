"""torch.compile and memprof: compiled code stays compiled inside and after a profile (the backend counts
its graphs' runs), is measured where memprof can see it, and says what it cannot see."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C
from memprof.errors import InvalidArgumentError

from helpers import assert_sums, hooks_left, weight_bytes
from models import MLP

MODES = ("exact", "light")


def _counting_backend():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    calls = {"forward": 0, "backward": 0}

    def compiler(kind):
        def compile_graph(gm, _inputs):
            def run(*args):
                calls[kind] += 1
                return gm(*args)
            return make_boxed_func(run)
        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward")), calls


@pytest.fixture(scope="module")
def compiled_runs():
    """The same two training steps eager, compiled (whole model) and with a compiled block; the compiled
    graphs count their own runs. Compiling costs a few seconds, so the runs are shared."""
    backend, calls = _counting_backend()
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))

    def run(profiled, called):
        opt = torch.optim.SGD(profiled.parameters(), lr=0.1)
        with memprof.profile(profiled, opt) as prof:
            for _ in range(2):
                F.cross_entropy(called(x), y).backward()
                opt.step()
                opt.zero_grad()
        return prof.report()

    torch.manual_seed(0)
    plain = MLP()
    eager = run(plain, plain)
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend=backend)
    F.cross_entropy(compiled(x), y).backward()  # compiled before the profile
    model.zero_grad(set_to_none=True)
    before = dict(calls)
    whole = run(compiled, compiled)
    inside = {k: calls[k] - before[k] for k in calls}
    before = dict(calls)
    F.cross_entropy(compiled(x), y).backward()
    after = {k: calls[k] - before[k] for k in calls}
    model.zero_grad(set_to_none=True)
    wrapped_inner = run(model, compiled)  # profiled: the inner model; called: its compiled wrapper
    torch.manual_seed(0)
    part = MLP()
    part.fc2 = torch.compile(part.fc2, backend=backend)  # a compiled block inside an eager model
    before = dict(calls)
    block = run(part, part)
    block_calls = {k: calls[k] - before[k] for k in calls}
    return {"eager": eager, "whole": whole, "inside": inside, "after": after, "block": block,
            "block_calls": block_calls, "model": model, "inner": wrapped_inner}


def test_a_compiled_model_stays_compiled_inside_and_after_the_block(compiled_runs):
    assert compiled_runs["inside"] == {"forward": 2, "backward": 2}
    assert compiled_runs["after"] == {"forward": 1, "backward": 1}
    assert compiled_runs["block_calls"] == {"forward": 2, "backward": 2}


def test_a_compiled_model_is_measured_and_says_what_it_cannot_see(compiled_runs):
    eager, whole, block = compiled_runs["eager"], compiled_runs["whole"], compiled_runs["block"]
    model = compiled_runs["model"]
    for rep in (whole, block):
        assert rep.num_steps == 2
        assert rep.breakdown(1, "forward", "end")[C.WEIGHTS] == weight_bytes(model)
        assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == weight_bytes(model)
        assert any("torch.compile'd code" in n and "lower bounds" in n for n in rep.trace.notes)
    # This backend runs aten ops, so what autograd keeps equals eager's to the byte.
    assert whole.breakdown(1, "forward", "end") == eager.breakdown(1, "forward", "end")
    assert block.breakdown(1, "forward", "end") == eager.breakdown(1, "forward", "end")
    # Modules inside compiled code have no per-module figures: not measured, not 0.
    inner = whole.modules().loc["_orig_mod.fc1"]
    assert inner["calls"] == 0 and inner["activations"] is pd_na()


def pd_na():
    import pandas as pd

    return pd.NA


def test_profiling_the_model_inside_a_compiled_wrapper_says_what_it_missed(compiled_runs):
    # The wrapper's compiled code skips the hooks memprof put on the model it wraps (they were added after
    # compilation): the forward is unseen, so what it saved is not measured (not 0), and the note names the
    # fix. Steps still end at optimizer steps, and model states are exact.
    rep = compiled_runs["inner"]
    assert rep.num_steps == 2
    assert rep.peak[C.ACTIVATIONS] is None
    assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == weight_bytes(compiled_runs["model"])
    assert any("did not see" in n and "memprof.profile(compiled_model, optimizer)" in n for n in rep.trace.notes)


def test_a_model_compiled_in_place_is_refused_with_the_fix():
    model = MLP()
    model.compile(backend="eager")
    with pytest.raises(InvalidArgumentError, match=r"torch.compile\(model\)"):
        memprof.profile(model)


def _profile(model, opt=None, mode=None):
    return memprof.profile(model, opt, mode=mode) if mode else contextlib.nullcontext()


def _graph_counting_backend():
    graphs: list[int] = []

    def backend(gm, example_inputs):
        graphs.append(0)
        index = len(graphs) - 1

        def run(*args):
            graphs[index] += 1
            return gm(*args)
        return run

    return backend, graphs


def _compiled_step_run(mode):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    backend, graphs = _graph_counting_backend()
    step = torch.compile(opt.step, backend=backend)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with _profile(model, opt, mode):
        for _ in range(2):
            F.mse_loss(model(x), y).backward()
            step()
            opt.zero_grad()
    inside = (len(graphs), sum(graphs))
    for _ in range(2):
        F.mse_loss(model(x), y).backward()
        step()
        opt.zero_grad()
    after = (len(graphs), sum(graphs), sum(counters["recompiles"].values()))
    return inside, after, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", MODES)
def test_an_optimizer_step_compiled_inside_the_block_compiles_as_without_memprof(mode):
    # A step first compiled inside the block compiles to the same graphs, run as often, and nothing
    # memprof installs makes it recompile or run eagerly after the block. (Dynamo's graph-break counter
    # may differ: torch.optim asks for a break that memprof's compiler-disabled step hooks already cause.)
    plain = _compiled_step_run(None)
    profiled = _compiled_step_run(mode)
    assert profiled[:2] == plain[:2]
    assert all(torch.equal(a, b) for a, b in zip(plain[2], profiled[2]))


def _compiled_first_inside(mode, target):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backend, graphs = _graph_counting_backend()
    compiled = torch.compile(model, backend=backend)
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    def step():
        F.mse_loss(compiled(x), y).backward()
        opt.step()
        opt.zero_grad()

    with _profile(compiled if target == "wrapper" else model, opt, mode):
        for _ in range(2):
            step()
    inside = sum(graphs)
    for _ in range(2):
        step()
    breaks = sum(counters["graph_break"].values())
    return inside, sum(graphs) - inside, breaks, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", ["wrapper", "inner"])
def test_a_model_compiled_first_inside_the_block_stays_compiled_after_it(mode, target):
    # Profiling the compiled wrapper, or the model inside it (its hooks are then traced into the graph as
    # no-ops, and dynamo recompiles once when they are gone): the whole forward runs as one compiled
    # graph inside the block and after it, with no graph break, as without memprof.
    plain = _compiled_first_inside(None, target)
    profiled = _compiled_first_inside(mode, target)
    assert profiled[:3] == plain[:3] == (2, 2, 0)  # graph runs inside, graph runs after, graph breaks
    assert all(torch.equal(a, b) for a, b in zip(plain[3], profiled[3]))


@pytest.mark.skipif(not os.environ.get("MEMPROF_SLOW"), reason="torch.compile takes ~25 s on this CPU; "
                                                                "set MEMPROF_SLOW=1 to run")
def test_torch_compile_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    F.cross_entropy(compiled(x), y).backward()  # compile outside the profile
    opt.zero_grad()
    eager = {}
    for name, m in (("eager", model), ("compiled", compiled)):
        with memprof.profile(m, opt) as prof:  # the module the loop calls: the compiled wrapper
            for _ in range(2):
                F.cross_entropy(m(x), y).backward()
                opt.step()
                opt.zero_grad()
        rep = prof.report()
        eager[name] = rep
        assert rep.num_steps == 2
        assert_sums(rep.peak)
        assert rep.breakdown(1, "forward", "end")[C.WEIGHTS] == weight_bytes(model)
        assert rep.breakdown(1, "backward", "end")[C.GRADIENTS] == weight_bytes(model)
        assert hooks_left(model) == []
    assert eager["compiled"].breakdown(1, "forward", "end")[C.ACTIVATIONS] == eager["eager"].breakdown(1, "forward", "end")[
        C.ACTIVATIONS]


def test_compiled_model_is_named_in_the_notes():
    # The "eager" backend compiles in a second or two: enough to run torch.compile's wrapper for real.
    model = torch.compile(MLP(), backend="eager")
    with memprof.profile(model) as prof:
        model(torch.randn(2, 32)).sum().backward()
    assert any("torch.compile" in n for n in prof.trace.notes)
