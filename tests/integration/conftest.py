"""Fixtures shared by the integration tests: small profiled runs (tests/runs.py), once per module, and rank 0 of a
fake world of two."""

from __future__ import annotations

import pytest

from runs import run_mlp, run_root_ops


@pytest.fixture(scope="module")
def mlp8():
    return run_mlp(8)


@pytest.fixture(scope="module")
def mlp16():
    return run_mlp(16)


@pytest.fixture(scope="module")
def light8():
    return run_mlp(8, mode="light")


@pytest.fixture(scope="module")
def root_ops():
    return run_root_ops()


@pytest.fixture
def fake_world_of_two():
    """Rank 0 of two on torch's fake process group: collectives return at once, so one process runs it."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()
