"""``memprof estimate MODULE:FACTORY --world-size N --parallelize MODULE:FUNCTION``: the user's own parallelize
function from the command line (or from the factory's dict), one rank's figures."""

from __future__ import annotations

import textwrap

import pytest
import torch.distributed as dist

from memprof.cli import main

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

MODULE = textwrap.dedent('''
    import torch
    from torch import nn


    def build(batch_size):
        model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
        return {"model": model, "inputs": torch.randn(batch_size, 32)}


    def shard(model, mesh):
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)


    def build_sharded(batch_size):
        return {**build(batch_size), "parallelize": shard}
''')


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "cli_parallel_models.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    return "cli_parallel_models"


def test_the_parallelize_flag_and_the_factorys_key(factory, capsys):
    assert main(["estimate", f"{factory}:build", "--batch-size", "4", "--device", "cpu", "--world-size", "2",
                 "--parallelize", f"{factory}:shard", "--rank", "1"]) == 0
    flag = capsys.readouterr().out
    assert "rank 1 of 2" in flag and "fully_shard" in flag
    assert main(["estimate", f"{factory}:build_sharded", "--batch-size", "4", "--device", "cpu",
                 "--world-size", "2", "--rank", "1"]) == 0
    assert capsys.readouterr().out == flag  # the same rank, the same figures


def test_a_bad_mesh_and_two_layouts_are_refused(factory, capsys):
    assert main(["estimate", f"{factory}:build", "--batch-size", "4", "--world-size", "2", "--mesh", "dp"]) == 1
    assert "NAME=SIZE" in capsys.readouterr().err
    assert main(["estimate", f"{factory}:build_sharded", "--batch-size", "4", "--world-size", "2",
                 "--parallel", "fsdp"]) == 1
    assert "give one" in capsys.readouterr().err
