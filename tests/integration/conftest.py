"""Fixtures shared by the integration tests: small profiled runs (tests/runs.py), once per module."""

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
