"""GPUs by name: memory as the driver reports it, compute capability, and what follows from them.

``gpu("h100")`` looks a GPU up by any usual spelling ("H100", "h100-80gb", "NVIDIA H100 80GB HBM3",
"nvidia-h100-80gb-hbm3"); ``GpuSpec`` describes one of your own. Every figure cites where it comes from.

Capacity comes in three kinds, named in ``capacity_kind``: ``"cudaMemGetInfo"`` (the total
``cudaMemGetInfo`` / ``torch.cuda.get_device_properties().total_memory`` report: what the device offers a
process), ``"nvidia-smi"`` (nvidia-smi's or NVML's total, which is larger: by 621 MiB on an A100-SXM4-40GB,
40,960 vs 40,339 MiB, and 871 MiB on an A100 80GB PCIe, 81,920 vs 81,049 MiB) and ``"marketed"`` (the
marketed N GB read as N x 10^9 B, below the driver's figure on every GPU where both are known).
``allocatable_bytes`` turns each into a figure not above the driver's total.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InvalidArgumentError, UnknownNameError
from .outside import OutsideTerm, cublas_workspace_bytes, cuda_context

__all__ = ["GpuSpec", "GPUS", "gpu", "known_gpus"]

MiB = 1_048_576
# The largest relative gap between nvidia-smi's total and cudaMemGetInfo's among GPUs with both sourced:
# A100-SXM4-40GB, 40,960 MiB (modal-labs/modal-client PR #2797) vs 42,298,834,944 B = 40,339 MiB
# (deviceQuery in bottlerocket-os/bottlerocket PR #3873): 621 / 40,960 = 1.52 %.
_SMI_GAP = (621, 40_960)
_KINDS = ("cudaMemGetInfo", "nvidia-smi", "marketed")


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: ``capacity_bytes`` of ``capacity_kind``, ``compute_capability`` (major, minor) and,
    when known, the CUDA context it carries (``context_bytes``; else the published range is used)."""

    name: str
    capacity_bytes: int
    compute_capability: tuple[int, int]
    context_bytes: int | None = None
    capacity_kind: str = "cudaMemGetInfo"
    source: str = "given by the user"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise InvalidArgumentError(f"GpuSpec.name must be a non-empty string (the GPU's name), got {self.name!r}")
        if not _whole(self.capacity_bytes) or self.capacity_bytes <= 0:
            raise InvalidArgumentError("GpuSpec.capacity_bytes must be a positive int of bytes (torch.cuda."
                                       f"get_device_properties(0).total_memory), got {self.capacity_bytes!r}")
        cc = self.compute_capability
        if not (isinstance(cc, tuple) and len(cc) == 2 and all(_whole(x) for x in cc)):
            raise InvalidArgumentError(f"GpuSpec.compute_capability must be a (major, minor) tuple, got {cc!r}")
        # CUDA's compute capabilities run from 1.0; the minor version is one digit (torch.cuda.get_device_capability).
        if cc[0] < 1 or not 0 <= cc[1] <= 9:
            raise InvalidArgumentError(f"GpuSpec.compute_capability {cc!r} is no CUDA compute capability: the major "
                                       "version is 1 or more and the minor one digit, as "
                                       "torch.cuda.get_device_capability() gives them (an H100 is (9, 0))")
        if self.context_bytes is not None and (not _whole(self.context_bytes) or self.context_bytes < 0):
            raise InvalidArgumentError(
                f"GpuSpec.context_bytes must be a non-negative int or None, got {self.context_bytes!r}")
        if self.capacity_kind not in _KINDS:
            raise InvalidArgumentError(
                f"GpuSpec.capacity_kind must be one of {', '.join(_KINDS)}, got {self.capacity_kind!r}")
        if not isinstance(self.source, str):
            raise InvalidArgumentError(f"GpuSpec.source must be a string, got {type(self.source).__name__}")
        usable = self.allocatable_bytes
        if usable <= 0:
            raise InvalidArgumentError(
                f"GpuSpec.capacity_bytes {self.capacity_bytes} of kind 'nvidia-smi' is not above the "
                f"{self.capacity_bytes - usable} B memprof takes off an nvidia-smi total for what the driver keeps "
                "(the largest sourced gap, 1.52 %, rounded up to MiB): give the device's total in bytes, or its "
                "cudaMemGetInfo total with capacity_kind='cudaMemGetInfo'")
        if self.context_bytes is not None and self.context_bytes >= usable:
            raise InvalidArgumentError(
                f"GpuSpec.context_bytes {self.context_bytes} is not below the {usable} B the device offers: a CUDA "
                "context takes hundreds of MiB of a device of GiBs; give the context's bytes (or None for the "
                "published range) and the device's total in capacity_bytes")

    @property
    def allocatable_bytes(self) -> int:
        """The device total a process can count on: the ``cudaMemGetInfo`` total as given, an nvidia-smi
        total less the largest sourced gap (1.52 %, rounded up to MiB), a marketed figure as it is."""
        if self.capacity_kind != "nvidia-smi":
            return self.capacity_bytes
        gap = -(-self.capacity_bytes * _SMI_GAP[0] // (_SMI_GAP[1] * MiB)) * MiB
        return self.capacity_bytes - gap

    @property
    def bf16(self) -> bool:
        """bf16 tensor-core math needs sm80 or newer (``torch.cuda.is_bf16_supported`` checks major >= 8)."""
        return self.compute_capability >= (8, 0)

    @property
    def flash_attention(self) -> bool:
        """SDPA's flash kernel runs on sm80 to sm121 (``check_flash_attention_hardware_support`` in
        ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``)."""
        return (8, 0) <= self.compute_capability <= (12, 1)

    @property
    def efficient_attention(self) -> bool:
        """The memory-efficient SDPA kernel runs on sm50 to sm121 (``check_mem_efficient_hardware_support``)."""
        return (5, 0) <= self.compute_capability <= (12, 1)

    @property
    def cublas_workspace_bytes(self) -> int:
        """One default cuBLAS workspace for this compute capability (``CublasHandlePool.cpp``)."""
        return cublas_workspace_bytes(self.compute_capability)

    def context(self) -> OutsideTerm:
        """The CUDA context: ``context_bytes`` when given, else the published range's upper end."""
        if self.context_bytes is not None:
            return OutsideTerm("cuda_context", self.context_bytes, f"given for {self.name}", self.source)
        return cuda_context(gpu=self.name)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _spec(name: str, capacity: int, cc: tuple[int, int], kind: str, source: str) -> GpuSpec:
    return GpuSpec(name=name, capacity_bytes=capacity, compute_capability=cc, capacity_kind=kind, source=source)


_MODAL = "nvidia-smi totals listed in modal-labs/modal-client PR #2797"
_MARKETED = "no driver-reported total found; the marketed figure in GB (1e9 B)"
_CC = "compute capability: NVIDIA, 'CUDA GPUs - Compute Capability'"

#: The GPUs memprof knows, by canonical name. Compute capabilities from NVIDIA's table of CUDA GPUs.
GPUS: dict[str, GpuSpec] = {spec.name: spec for spec in [
    _spec("a100-40gb-sxm", 42_298_834_944, (8, 0), "cudaMemGetInfo",
          f"deviceQuery 'NVIDIA A100-SXM4-40GB': 42,298,834,944 B (bottlerocket-os/bottlerocket PR #3873); {_CC}"),
    _spec("a100-40gb-pcie", 40_960 * MiB, (8, 0), "nvidia-smi",
          f"{_MODAL} ('A100 40GB: 40960MiB', form factor not stated); {_CC}"),
    _spec("a100-80gb-sxm", 81_920 * MiB, (8, 0), "nvidia-smi",
          f"{_MODAL} ('A100 80GB: 81920MiB', form factor not stated); {_CC}"),
    _spec("a100-80gb-pcie", 81_049 * MiB, (8, 0), "cudaMemGetInfo",
          f"'NVIDIA A100 80GB PCIe ... Total global mem: 81049 MB' (totalGlobalMem in MiB, "
          f"ekondis/mixbench #47); {_CC}"),
    _spec("h100-80gb-sxm", 81_559 * MiB, (9, 0), "nvidia-smi",
          f"'NVIDIA H100 80GB HBM3 ... 81559MiB' (NVIDIA/nccl #1264; {_MODAL}); {_CC}"),
    _spec("h100-80gb-pcie", 80 * 10**9, (9, 0), "marketed", f"{_MARKETED} (80 GB); {_CC}"),
    _spec("h100-nvl-94gb", 99_961_274_368, (9, 0), "nvidia-smi",
          f"NVML total of 'NVIDIA H100 NVL': 99,961,274,368 B (fastfetch-cli/fastfetch #1658); {_CC}"),
    _spec("h200-141gb", 141 * 10**9, (9, 0), "marketed", f"{_MARKETED} (141 GB); {_CC}"),
    _spec("b200-180gb", 178_350_000_000, (10, 0), "cudaMemGetInfo",
          "'NVIDIA B200 ... Total Global Memory: 178.35 GB' (pytorch/ao PR #4002); the unit's base is not stated, "
          f"the smaller reading (1e9 B) is used; {_CC}"),
    _spec("l4-24gb", 23_034 * MiB, (8, 9), "nvidia-smi", f"{_MODAL}; {_CC}"),
    _spec("l40s-48gb", 46_068 * MiB, (8, 9), "nvidia-smi", f"{_MODAL}; {_CC}"),
    _spec("a10-24gb", 23_028 * MiB, (8, 6), "nvidia-smi", f"{_MODAL}; {_CC}"),
    _spec("a10g-24gb", 24 * 10**9, (8, 6), "marketed", f"{_MARKETED} (24 GB); {_CC}"),
    _spec("t4-16gb", 15_360 * MiB, (7, 5), "nvidia-smi", f"{_MODAL}; {_CC}"),
    _spec("v100-16gb", 16 * 10**9, (7, 0), "marketed", f"{_MARKETED} (16 GB); {_CC}"),
    _spec("v100-32gb", 32 * 10**9, (7, 0), "marketed", f"{_MARKETED} (32 GB); {_CC}"),
    _spec("rtx-4090-24gb", 24 * 10**9, (8, 9), "marketed", f"{_MARKETED} (24 GB); {_CC}"),
    _spec("rtx-3090-24gb", 24 * 10**9, (8, 6), "marketed", f"{_MARKETED} (24 GB); {_CC}"),
    _spec("rtx-5090-32gb", 33_677_180_928, (12, 0), "cudaMemGetInfo",
          "deviceQuery 'NVIDIA GeForce RTX 5090': 33,677,180,928 B (aikitoria/open-gpu-kernel-modules #1; "
          f"33,680,457,728 B in NVIDIA/nccl #1637, the smaller is used); {_CC}"),
]}

# Short names a user types. A name that leaves the memory out means the smaller variant (a fit predicted
# for it holds on the larger one): the 40 GB A100, the 16 GB V100; one that leaves the form factor out
# means the SXM part.
_ALIASES = {
    "a100": "a100-40gb-sxm", "a100-40gb": "a100-40gb-sxm", "a100-80gb": "a100-80gb-sxm",
    "a100-sxm4-40gb": "a100-40gb-sxm", "a100-sxm4-80gb": "a100-80gb-sxm", "a100-pcie-40gb": "a100-40gb-pcie",
    "a100-80gb-pcie": "a100-80gb-pcie", "h100": "h100-80gb-sxm", "h100-80gb": "h100-80gb-sxm",
    "h100-80gb-hbm3": "h100-80gb-sxm", "h100-sxm": "h100-80gb-sxm", "h100-sxm5-80gb": "h100-80gb-sxm",
    "h100-pcie": "h100-80gb-pcie", "h100-nvl": "h100-nvl-94gb", "h200": "h200-141gb", "b200": "b200-180gb",
    "l4": "l4-24gb", "l40s": "l40s-48gb", "a10": "a10-24gb", "a10g": "a10g-24gb", "t4": "t4-16gb",
    "tesla-t4": "t4-16gb", "v100": "v100-16gb", "v100-sxm2-16gb": "v100-16gb", "v100-sxm2-32gb": "v100-32gb",
    "tesla-v100-sxm2-16gb": "v100-16gb", "tesla-v100-sxm2-32gb": "v100-32gb", "rtx-4090": "rtx-4090-24gb",
    "geforce-rtx-4090": "rtx-4090-24gb", "4090": "rtx-4090-24gb", "rtx-3090": "rtx-3090-24gb",
    "geforce-rtx-3090": "rtx-3090-24gb", "3090": "rtx-3090-24gb", "rtx-5090": "rtx-5090-32gb",
    "geforce-rtx-5090": "rtx-5090-32gb",
}


def _normalise(name: str) -> str:
    text = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return re.sub(r"^nvidia-", "", text)


def known_gpus() -> list[str]:
    """The canonical names ``gpu()`` accepts (aliases and spellings aside)."""
    return sorted(GPUS)


def gpu(name: str) -> GpuSpec:
    """The spec of a GPU by name, case and punctuation aside ("H100 80GB HBM3" -> ``h100-80gb-sxm``)."""
    if isinstance(name, GpuSpec):
        return name
    if not isinstance(name, str):
        raise InvalidArgumentError(f"gpu() takes a GPU name, got {type(name).__name__}")
    key = _normalise(name)
    if key in GPUS:
        return GPUS[key]
    if key in _ALIASES:
        return GPUS[_ALIASES[key]]
    raise UnknownNameError(f"unknown GPU {name!r}; known: {', '.join(known_gpus())}. For another GPU build "
                           "GpuSpec(name, capacity_bytes=torch.cuda.get_device_properties(0).total_memory, "
                           "compute_capability=(major, minor))")
