"""Every public entry point leaves the process's random generators as it found them.

A script that seeds ``random``, NumPy and torch for its data order and asks memprof first (an estimate, a plan)
must train on the order it seeded. torch's fake process group, on which a user's ``parallelize`` runs, draws
from Python's ``random`` for each collective; a user's own function may seed or draw. Each entry point is
called with every generator seeded, with a ``parallelize`` function where it takes one (FSDP2 on the fake
group, which also draws from each generator itself), and each generator's state is compared before and after:
Python's, NumPy's legacy global one, torch's CPU generator (and CUDA's, where initialised).

The list of entry points is ``memprof.__all__`` and the CLI's subcommands: a new one fails
:func:`test_every_entry_point_is_walked` until it is walked here.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

import memprof
from memprof.cli import _parser, main
from memprof.report.random_state import random_state_kept

from tests.integration.test_parallelize import IDS, build, fsdp_bf16, loss_fn

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
            max_position_embeddings=64)


def drawing_fsdp(model, mesh):
    """The user's FSDP2 function, which also draws from every generator, as user code may."""
    random.random()
    np.random.rand()
    torch.rand(1)
    return fsdp_bf16(model, mesh)


def _states() -> dict:
    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _changed(before: dict, after: dict) -> list[str]:
    changed = []
    for name in before.keys() | after.keys():
        a, b = before.get(name), after.get(name)
        if name == "numpy":
            same = a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]
        elif name in ("torch", "cuda"):
            same = a is not None and b is not None and all(
                torch.equal(x, y) for x, y in zip(a if name == "cuda" else [a], b if name == "cuda" else [b],
                                                  strict=True))
        else:
            same = a == b
        if not same:
            changed.append(name)
    return sorted(changed)


def _seed() -> None:
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """What the entry points are called on, made before any state is read: a measured run of the tiny model
    saved to a file, its optimizer and batch, a tiny Llama and its config folder, two ranks' estimates."""
    folder = tmp_path_factory.mktemp("rng") / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    model = build()
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt) as prof:
        loss_fn(model(IDS), IDS).backward()
        opt.step()
        opt.zero_grad()
    report = prof.report()
    path = folder.parent / "run.json"
    report.save(path)
    config = transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k not in ("architectures", "model_type")})
    llama = transformers.LlamaForCausalLM(config).eval()
    ranks = [memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                              world_size=2, rank=r, parallelize=fsdp_bf16) for r in (0, 1)]
    return argparse.Namespace(folder=folder, path=path, model=model, opt=opt, report=report, llama=llama, ranks=ranks)


def _profile(w, make):
    def step():
        # A step that draws nothing itself (no dropout): whatever changes a generator is memprof's.
        with make(w.model, w.opt) as prof:
            loss_fn(w.model(IDS), IDS).backward()
            w.opt.step()
            w.opt.zero_grad()
        return prof.report()
    return step


def _opt(ps):
    return torch.optim.AdamW(ps)


def _ready(call):
    """An entry point's call, its arguments made first (building a model draws from torch's generator)."""
    return lambda w: (lambda m: lambda: call(w, m))(build())


#: Each public name that runs something: how it is called (on the fixture and a fresh model ``m``, made before
#: the states are read), with parallelize= where it takes one (max_batch_size takes none).
CALLS = {
    "profile": lambda w: _profile(w, memprof.profile),
    "Profiler": lambda w: _profile(w, memprof.Profiler),
    "load": _ready(lambda w, m: memprof.load(w.path)),
    "estimate": _ready(lambda w, m: memprof.estimate(m, _opt, inputs=IDS, targets=IDS, loss_fn=loss_fn, world_size=2,
                                                     parallelize=drawing_fsdp)),
    # The case as it came: FSDP2 on torch's fake process group, which draws from Python's random.
    "estimate[fsdp2]": _ready(lambda w, m: memprof.estimate(m, _opt, inputs=IDS, targets=IDS, loss_fn=loss_fn,
                                                            world_size=2, parallelize=fsdp_bf16)),
    "estimate_generation": _ready(lambda w, m: memprof.estimate_generation(w.llama, batch_size=1, prompt_len=4,
                                                                           max_new_tokens=2, device="cpu")),
    "estimate_hf": _ready(lambda w, m: memprof.estimate_hf(w.folder, seq_len=8, batch_size=2, device="cpu",
                                                           world_size=2, parallelize=drawing_fsdp_hf)),
    "reconcile": _ready(lambda w, m: memprof.reconcile(w.report)),
    "max_batch_size": _ready(lambda w, m: memprof.max_batch_size(
        m, _opt, lambda b: IDS[:1].expand(b, -1), "400 KiB", loss_fn=lambda out: out.float().sum(), world_size=2,
        parallel="fsdp")),  # no parallelize= here: the layouts memprof simulates itself
    "max_generation_batch_size": _ready(lambda w, m: memprof.max_generation_batch_size(
        w.llama, "300 KiB", prompt_len=4, max_new_tokens=2, device="cpu")),
    "plan": _ready(lambda w, m: memprof.plan(w.folder, seq_len=8, gpu="t4", world_size=2, layouts=["fsdp"],
                                             precisions=["bf16"], checkpointing=(False,))),
    "diff": _ready(lambda w, m: memprof.diff(w.report, w.report)),
    "merge": _ready(lambda w, m: memprof.merge(w.ranks)),
    "schedule": _ready(lambda w, m: memprof.schedule(wait=1, warmup=0, active=1)),
    "check_budget": _ready(lambda w, m: memprof.check_budget(w.report, "1 GiB")),
    "format_bytes": _ready(lambda w, m: memprof.format_bytes(1 << 20)),
    "parse_size": _ready(lambda w, m: memprof.parse_size("1 MiB")),
    # Public beyond memprof.__all__: the what-if of a measured run, and a generation from a config.
    "Report.what_if": _ready(lambda w, m: w.report.what_if(m, _opt, inputs=IDS, targets=IDS, loss_fn=loss_fn,
                                                           world_size=2, parallelize=drawing_fsdp)),
    "estimate_hf_generation": _ready(lambda w, m: memprof.report.planning.estimate_hf_generation(
        w.folder, batch_size=1, prompt_len=4, max_new_tokens=2, device="cpu")),
}

#: Names in memprof.__all__ that run nothing: classes of results and records, the vocabulary, the version.
NOT_CALLED = {"Report", "Estimate", "Pipeline", "Reconciliation", "BatchSizePlan", "Diff", "Merged", "Schedule",
              "Trace", "Breakdown", "Category", "Phase", "MemprofError", "__version__"}


def drawing_fsdp_hf(model, mesh):
    """FSDP2 on each decoder layer of a transformers Llama, drawing as :func:`drawing_fsdp` does."""
    from torch.distributed.fsdp import fully_shard

    random.random()
    np.random.rand()
    torch.rand(1)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


#: The CLI's subcommands that simulate, as they are called; the others only read or print saved traces, but
#: the demo, which seeds torch for its own model as a script of its own does, and profiles rather than simulates.
CLI = {
    "estimate": lambda w: ["estimate", "--hf", str(w.folder), "--seq-len", "8", "--batch-size", "2", "--world-size",
                           "2", "--parallelize", "tests.integration.test_random_state:drawing_fsdp_hf", "--json"],
    "plan": lambda w: ["plan", "--hf", str(w.folder), "--seq-len", "8", "--gpu", "t4", "--world-size", "2",
                       "--parallel", "fsdp", "--precision", "bf16", "--checkpointing", "off", "--json"],
    "report": lambda w: ["report", str(w.path)],
    "export": lambda w: ["export", str(w.path), "--html", str(w.path.parent / "run.html")],
    "diff": lambda w: ["diff", str(w.path), str(w.path)],
}
CLI_NOT_CALLED = {"demo", "merge"}  # merge needs the traces of distributed ranks, which a CPU run here has not


def test_every_entry_point_is_walked():
    names = set(memprof.__all__)
    assert not (names - set(CALLS) - NOT_CALLED), f"not walked by this test: {sorted(names - set(CALLS) - NOT_CALLED)}"
    commands = set(_parser()._subparsers._group_actions[0].choices)
    assert not (commands - set(CLI) - CLI_NOT_CALLED), f"CLI commands not walked: {sorted(commands - set(CLI))}"


@pytest.mark.parametrize("name", sorted(CALLS))
def test_an_entry_point_leaves_every_generator_as_it_was(world, name):
    _seed()
    call = CALLS[name](world)
    before = _states()
    call()
    assert _changed(before, _states()) == []


@pytest.mark.parametrize("command", sorted(CLI))
def test_a_cli_command_leaves_every_generator_as_it_was(world, command, capsys):
    _seed()
    before = _states()
    assert main(CLI[command](world)) == 0, capsys.readouterr().err
    assert _changed(before, _states()) == []


def test_the_generators_come_back_when_the_call_raises():
    def fails(model, mesh):
        random.random()
        np.random.rand()
        torch.rand(1)
        raise ValueError("the user's own mistake")

    _seed()
    model = build()
    before = _states()
    with pytest.raises(ValueError, match="the user's own mistake"):
        memprof.estimate(model, _opt, inputs=IDS, targets=IDS, loss_fn=loss_fn, world_size=2, parallelize=fails)
    assert _changed(before, _states()) == []


def test_a_torch_imported_inside_gets_its_fresh_state(monkeypatch):
    # The context, entered where the process has no torch yet: on exit the CPU generator is as a fresh import
    # leaves it, whatever the body drew.
    fresh = torch.Generator().manual_seed(torch.default_generator.initial_seed()).get_state()
    with torch.random.fork_rng(devices=[]):  # the test's own draws undone for the tests after it
        monkeypatch.delitem(sys.modules, "torch")
        with random_state_kept():
            monkeypatch.setitem(sys.modules, "torch", torch)
            torch.rand(3)
        assert torch.equal(torch.get_rng_state(), fresh)
