import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # Several workers on the machine's few cores: with torch's default of one intra-op thread per core each,
    # they oversubscribe the cores and spin against each other (the suite ran 16 % longer so). One thread
    # each.
    torch.set_num_threads(1)
    # The processes the tests start (scripts, CLI runs, gloo ranks) too, unless the user's environment says how
    # many: with two OpenMP threads on two cores that the workers keep busy, every op of theirs waited on a
    # thread the scheduler had not run (a 29,184-parameter GPT's step took 0.92 s with two threads, 2 ms with
    # one: benchmarks/overhead.py --quick ran 35 s instead of a few). The in-process tests already run so.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not os.environ.get("MEMPROF_TEST_PLAN_FORKS"):
        # A plan's default (processes=None) forks a searching process per group of rows, and an estimate of a
        # pipeline one per rank class: under two workers that already keep both cores busy they only add forks
        # and work each fork redoes without the parent's caches. By default here everything runs in the worker;
        # the tests that pass processes= (test_plan_hf's small_plan, test_cli_options' --processes,
        # tests/unit/test_plan_processes.py, tests/integration/test_pipeline_processes.py) fork as asked.
        # MEMPROF_TEST_PLAN_FORKS=1 leaves the default as it is.
        from memprof.simulate import forked as _forked

        _processes_for = _forked.processes_for

        def _here_by_default(processes, parts):
            return _processes_for(1 if processes is None else processes, parts)

        _here_by_default.__wrapped__ = _processes_for  # the rule itself, for tests/unit/test_plan_processes.py
        _forked.processes_for = _here_by_default


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _names_dist(args) -> bool:
    return any(a == "-d" or a.startswith("--dist") for a in args)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n`` without a ``--dist`` of the user's, work stealing instead of xdist's default "load".

    "load" hands out the first quarter of the tests one by one, alternating workers, so the tests of one module
    land on both and each worker builds that module's shared fixtures; and it cannot take back a batch already
    sent, so one worker can sit idle while the other ends a long test queue. Work stealing gives each worker a
    contiguous half (a module's fixtures are built once) and lets an idle worker take half of what the other still
    has queued.
    """
    if config.getvalue("dist") != "load" or _names_dist(config.invocation_params.args):
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)
