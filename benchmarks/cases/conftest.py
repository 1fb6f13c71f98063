"""Model-scale cases of the suite's guarantees: more layers, micro-batches, schedules and targets than the suite's
own cases of the same mechanisms, which run every line these run in seconds each (README's test command keeps to
four minutes on two cores). CI runs them after the suite: ``python -m pytest -q -n auto benchmarks/cases``.

The cases reuse the suite's helpers and fixtures: tests/ and tests/integration are put on the path, and the suite's
conftest modules are loaded for their settings (one thread per worker), fixtures and scheduling hook.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path[:0] = [str(_TESTS), str(_TESTS / "integration")]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_suite = _load("_suite_conftest", _TESTS / "conftest.py")
_integration = _load("_suite_integration_conftest", _TESTS / "integration" / "conftest.py")

# Hooks and fixtures are found by their names in this module.
_deterministic = _suite._deterministic
pytest_collection_modifyitems = _suite.pytest_collection_modifyitems
pytest_xdist_make_scheduler = _suite.pytest_xdist_make_scheduler
fake_world_of_two = _integration.fake_world_of_two
