"""The device-level figures of a run on a (simulated) CUDA device, with their text: what
``est.device_memory`` and ``report.what_a_gpu_would_reserve()`` give."""

from __future__ import annotations

from ..simulate import device_memory as device
from .wrap import promote

__all__ = ["DeviceMemory", "on_device"]


class DeviceMemory(device.DeviceMemory):
    __doc__ = device.DeviceMemory.__doc__

    def to_text(self) -> str:
        """The verdict, a measured run's comparison and every term with its source: what ``print()`` shows."""
        from ..render.text import device_memory_text

        return device_memory_text(self)

    def __str__(self) -> str:
        return self.to_text()


def on_device(data: "device.DeviceMemory | None") -> "DeviceMemory | None":
    """``data`` with its views (None stays None)."""
    return None if data is None else promote(DeviceMemory, data)
