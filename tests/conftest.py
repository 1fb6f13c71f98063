import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # Several workers on the machine's few cores: with torch's default of one intra-op thread per core each,
    # they oversubscribe the cores and spin against each other (the suite ran 16 % longer so). One thread
    # each. Processes the tests start (gloo ranks, scripts) keep torch's default.
    torch.set_num_threads(1)


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
