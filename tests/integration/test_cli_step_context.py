"""``memprof estimate ... --step-context MODULE:FUNCTION --routing POLICY``: the context a loop enters around forward
and backward, and the MoE routing assumption, from the command line (or from the factory's dict)."""

from __future__ import annotations

import textwrap

import pytest
import torch.distributed as dist

from memprof.cli import main

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

MODULE = textwrap.dedent('''
    import contextlib

    import torch
    from torch import nn

    ENTERED = []


    def build(batch_size):
        model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(2)])
        return {"model": model, "inputs": torch.randn(batch_size, 32)}


    @contextlib.contextmanager
    def watch(step):
        ENTERED.append(tuple(step.inputs.shape))
        yield


    def build_watched(batch_size):
        return {**build(batch_size), "step_context": watch}
''')


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "cli_step_context_models.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "cli_step_context_models"


def test_the_step_context_flag_and_the_factorys_key(factory, capsys):
    import importlib

    models = importlib.import_module(factory)
    assert main(["estimate", f"{factory}:build", "--batch-size", "4", "--device", "cpu",
                 "--step-context", f"{factory}:watch"]) == 0
    flag = capsys.readouterr().out
    assert "step context: each step's forward, loss and backward ran inside watch" in flag
    assert models.ENTERED == [(4, 32)] * 2  # two simulated steps, the batch as the model gets it
    assert main(["estimate", f"{factory}:build_watched", "--batch-size", "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == flag
    assert models.ENTERED == [(4, 32)] * 4


def test_refusals(factory, capsys):
    assert main(["estimate", f"{factory}:build", "--batch-size", "4", "--routing", "sideways"]) == 1
    assert "unknown routing 'sideways'" in capsys.readouterr().err
    assert main(["estimate", f"{factory}:build", "--batch-size", "4", "--generate", "--prompt-len", "4",
                 "--new-tokens", "2", "--step-context", f"{factory}:watch"]) == 1
    assert "leave it out with --generate" in capsys.readouterr().err
