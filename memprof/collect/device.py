"""What the device itself reports: allocator counters and NVML.

On CPU there is no allocator counter and no driver figure: every method here
returns ``None`` there, and the report prints "not measured", never 0.
On CUDA, ``torch.cuda`` gives allocated and reserved bytes, and NVML
(``nvidia-ml-py``, imported only here and only when needed) gives the
process's device memory, from which memory outside PyTorch's allocator
(CUDA context, cuBLAS/cuDNN workspaces, NCCL) follows.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
import torch

from ..errors import is_interrupt
from ..record.trace import DeviceInfo

# The CUDA caching allocator rounds every block up to a multiple of 512 bytes
# (kMinBlockSize in c10/cuda/CUDACachingAllocator.cpp; c10/core/AllocatorConfig.h in torch 2.13).
CUDA_BLOCK = 512


@dataclass
class DeviceReading:
    allocated: "int | None" = None
    peak_allocated: "int | None" = None
    reserved: "int | None" = None
    nvml_used: "int | None" = None


class DeviceProbe:
    """Reads the device's own counters at phase boundaries."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.rounding = CUDA_BLOCK if self.is_cuda else 1
        self._light = False
        self._notes: list[str] = []
        self._nvml_handle: object = None  # pynvml's handle of the device, handed back to it
        self._nvml_tried = False
        self._global_peak = DeviceReading()
        self._max_allocated_seen = 0

    # -- light mode -----------------------------------------------------------

    def start_light(self) -> None:
        self._light = True
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def light_notes(self) -> list[str]:
        if self.is_cuda:
            return [
                "light mode resets torch.cuda peak memory statistics at each phase boundary "
                "(torch.cuda.max_memory_allocated() read after profiling covers only the last phase)",
                "light mode: temporaries at a peak = the allocator's peak minus the categories known at that moment",
            ]
        return [
            "light mode on CPU: there is no allocator counter, so temporaries and totals are not measured"
        ]

    def phase_started(self) -> None:
        if self._light and self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def phase_ended(self) -> "DeviceReading | None":
        if not self.is_cuda:
            return None
        reading = DeviceReading(
            allocated=torch.cuda.memory_allocated(self.device),
            peak_allocated=torch.cuda.max_memory_allocated(self.device),
            reserved=torch.cuda.memory_reserved(self.device),
            nvml_used=self._nvml_used(),
        )
        if reading.peak_allocated is not None and reading.peak_allocated >= self._max_allocated_seen:
            self._max_allocated_seen = reading.peak_allocated
            self._global_peak = reading
        return reading

    def finish(self) -> "DeviceReading | None":
        return self.phase_ended()

    def global_peak(self) -> "DeviceReading | None":
        return self._global_peak if self.is_cuda else None

    def notes(self) -> list[str]:
        return list(self._notes)

    def info(self) -> DeviceInfo:
        if self.is_cuda:
            props = torch.cuda.get_device_properties(self.device)
            return DeviceInfo(
                type="cuda",
                name=props.name,
                index=self.device.index if self.device.index is not None else torch.cuda.current_device(),
                total_memory=int(props.total_memory),
                rounding=self.rounding,
                max_memory_allocated=self._max_allocated_seen or None,
                memory_reserved=torch.cuda.memory_reserved(self.device),
                nvml_used=self._nvml_used(),
            )
        name = platform.processor() or platform.machine() or self.device.type
        return DeviceInfo(type=self.device.type, name=name, rounding=self.rounding)

    # -- NVML -----------------------------------------------------------------

    def _nvml_used(self) -> "int | None":
        if not self.is_cuda:
            return None
        if not self._nvml_tried:
            self._nvml_tried = True
            try:
                import pynvml  # provided by the nvidia-ml-py distribution

                pynvml.nvmlInit()
                index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
                handle = None
                if uuid is not None:
                    try:
                        handle = pynvml.nvmlDeviceGetHandleByUUID(("GPU-" + str(uuid)).encode())
                    except Exception as failure:
                        if is_interrupt(failure):
                            raise  # a signal handler's exception (errors.is_interrupt) is the user's
                        handle = None
                if handle is None:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                self._nvml_handle = handle
            except ImportError as failure:
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                self._notes.append(
                    "outside_torch not measured: install the nvml extra (pip install 'torch-memprof[nvml]')"
                )
            except Exception as exc:  # NVML missing from the driver, no permission, ...
                if is_interrupt(exc):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                self._notes.append(f"outside_torch not measured: NVML unavailable ({exc})")
        if self._nvml_handle is None:
            return None
        import pynvml

        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self._nvml_handle)
        except Exception as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            return None
        pid = os.getpid()
        for proc in procs:
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        # In containers NVML often cannot see our PID; the device's used memory
        # then includes other processes, so we do not guess.
        if "outside_torch" not in " ".join(self._notes):
            self._notes.append(
                "outside_torch not measured: NVML does not list this process (container PID namespace?)"
            )
        return None
