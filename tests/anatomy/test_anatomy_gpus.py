"""GPUs by name: lookup spellings, capacities by kind, what the compute capability allows."""

from __future__ import annotations

import pytest

from memprof.anatomy.gpus import GPUS, GpuSpec, gpu, known_gpus
from memprof.anatomy.outside import CUDA_CONTEXT_EAGER_MAX_BYTES
from memprof.errors import InvalidArgumentError, UnknownNameError

MiB = 2**20


@pytest.mark.parametrize("name", ["H100", "h100-80gb", "H100 80GB HBM3", "nvidia-h100-80gb-hbm3", "NVIDIA H100 80GB HBM3",
                                  "h100_sxm"])
def test_spellings_of_the_h100(name):
    assert gpu(name) is GPUS["h100-80gb-sxm"]


@pytest.mark.parametrize("name,canonical", [
    ("NVIDIA A100-SXM4-40GB", "a100-40gb-sxm"), ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"), ("Tesla T4", "t4-16gb"), ("NVIDIA L4", "l4-24gb"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090-24gb"), ("NVIDIA H100 NVL", "h100-nvl-94gb"), ("B200", "b200-180gb"),
    ("Tesla V100-SXM2-32GB", "v100-32gb"), ("A10G", "a10g-24gb"), ("H200", "h200-141gb"),
    # a name without the memory means the smaller variant: a fit predicted for it holds on the larger one
    ("A100", "a100-40gb-sxm"), ("V100", "v100-16gb"),
])
def test_device_names_as_torch_and_nvidia_smi_print_them(name, canonical):
    assert gpu(name).name == canonical


def test_unknown_names_list_the_known_ones():
    with pytest.raises(UnknownNameError, match="unknown GPU 'MI300X'; known: a10-24gb, .*GpuSpec"):
        gpu("MI300X")
    with pytest.raises(InvalidArgumentError):
        gpu(80)
    assert known_gpus() == sorted(GPUS) and len(known_gpus()) == 19


def test_capacities_by_kind():
    # H100 SXM: nvidia-smi's 81,559 MiB less 1.52 % (621/40,960, the A100-40GB gap), rounded up to MiB:
    # ceil(81,559 * 621 / 40,960) = 1,237 MiB -> 80,322 MiB a process can count on
    h100 = gpu("h100")
    assert h100.capacity_bytes == 81_559 * MiB and h100.allocatable_bytes == 80_322 * MiB
    # cudaMemGetInfo totals are used as they are (deviceQuery: 42,298,834,944 B), marketed GB as 1e9 B
    assert gpu("a100-40gb").allocatable_bytes == 42_298_834_944
    assert gpu("h200").allocatable_bytes == 141 * 10**9
    # the A100-40GB's own nvidia-smi total, reduced the same way, lands on its cudaMemGetInfo total
    assert GpuSpec("x", 40_960 * MiB, (8, 0), capacity_kind="nvidia-smi").allocatable_bytes == 40_339 * MiB


def test_what_the_compute_capability_allows():
    t4, a10, h100, b200 = gpu("t4"), gpu("a10"), gpu("h100"), gpu("b200")
    assert (t4.bf16, t4.flash_attention, t4.efficient_attention) == (False, False, True)  # sm75
    assert (a10.bf16, a10.flash_attention) == (True, True)  # sm86
    assert h100.cublas_workspace_bytes == 32 * MiB and a10.cublas_workspace_bytes == 8_519_680
    assert b200.compute_capability == (10, 0) and b200.flash_attention


def test_own_gpu_and_its_context():
    mine = GpuSpec("my-gpu", 24 * 10**9, (8, 9), context_bytes=500 * MiB)
    assert mine.context().bytes == 500 * MiB and mine.context().assumption == "given for my-gpu"
    assert gpu(mine) is mine
    # no per-GPU context figure is published: the range's upper end, 1343 MiB
    assert gpu("l4").context().bytes == CUDA_CONTEXT_EAGER_MAX_BYTES == 1343 * MiB
    with pytest.raises(InvalidArgumentError, match="compute_capability"):
        GpuSpec("bad", 10**9, "8.0")
    with pytest.raises(InvalidArgumentError, match="capacity_kind"):
        GpuSpec("bad", 10**9, (8, 0), capacity_kind="nvml")
    with pytest.raises(InvalidArgumentError, match="capacity_bytes"):
        GpuSpec("bad", 0, (8, 0))


def test_every_entry_names_its_sources():
    for spec in GPUS.values():
        assert "CUDA GPUs" in spec.source and spec.capacity_kind in ("cudaMemGetInfo", "nvidia-smi", "marketed")
        if spec.capacity_kind == "marketed":
            assert "no driver-reported total found" in spec.source
