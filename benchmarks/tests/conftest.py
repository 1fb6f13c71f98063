"""The benchmark scripts' smoke runs: CI runs them apart from the test suite (``python -m pytest -q -n auto
benchmarks/tests``), since each starts a Python process of its own and together they would be a sixth of the
suite's time."""

import os

if os.environ.get("PYTEST_XDIST_WORKER") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # The scripts these tests start, on cores the other worker keeps busy: with one OpenMP thread per core each op
    # waits on a thread the scheduler has not run (tests/conftest.py measured it), so one thread each, unless the
    # user's environment says how many.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
