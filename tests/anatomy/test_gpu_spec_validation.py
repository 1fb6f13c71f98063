"""A GpuSpec describes a device that can exist: an impossible field is refused at once with the field and the fix
named (issue 36, item 9), not carried into a replay that would read it as a negative capacity."""

from __future__ import annotations

import pytest

from memprof.anatomy.gpus import GpuSpec
from memprof.errors import InvalidArgumentError

MiB = 2**20
GOOD = dict(name="mine", capacity_bytes=24 * 2**30, compute_capability=(8, 9))


@pytest.mark.parametrize("change,message", [
    (dict(compute_capability=(-1, 0)), r"compute_capability \(-1, 0\) is no CUDA compute capability.*\(9, 0\)"),
    (dict(compute_capability=(9, -1)), r"compute_capability \(9, -1\) is no CUDA compute capability"),
    (dict(compute_capability=(0, 0)), r"the major version is 1 or more"),
    (dict(compute_capability=(8, 10)), r"the minor one digit"),
    (dict(compute_capability=(True, 0)), r"compute_capability must be a \(major, minor\) tuple"),
    # An nvidia-smi total loses the driver's share (1.52 %, rounded up to MiB): 1 MiB of it leaves nothing.
    (dict(capacity_bytes=MiB, capacity_kind="nvidia-smi"), r"capacity_bytes 1048576 of kind 'nvidia-smi' is not above "
                                                            r"the 1048576 B .* capacity_kind='cudaMemGetInfo'"),
    (dict(capacity_bytes=-5), r"capacity_bytes must be a positive int"),
    (dict(capacity_bytes=2.5e10), r"capacity_bytes must be a positive int"),
    (dict(context_bytes=24 * 2**30), r"context_bytes 25769803776 is not below the 25769803776 B the device offers"),
    (dict(context_bytes=-1), r"context_bytes must be a non-negative int"),
    (dict(name=""), r"GpuSpec.name must be a non-empty string"),
    (dict(name=None), r"GpuSpec.name must be a non-empty string"),
    (dict(source=3), r"GpuSpec.source must be a string"),
])
def test_an_impossible_gpu_names_its_field_and_the_fix(change, message):
    with pytest.raises(InvalidArgumentError, match=message):
        GpuSpec(**{**GOOD, **change})


def test_the_smallest_possible_gpus_are_accepted():
    # Compute capability 1.0 is CUDA's first; an nvidia-smi total of 2 MiB keeps 1 MiB after the 1 MiB gap.
    assert GpuSpec("old", 2**30, (1, 0)).compute_capability == (1, 0)
    assert GpuSpec("tiny", 2 * MiB, (9, 0), capacity_kind="nvidia-smi").allocatable_bytes == MiB
    assert GpuSpec("ctx", 2 * MiB, (9, 0), context_bytes=2 * MiB - 1).context().bytes == 2 * MiB - 1
