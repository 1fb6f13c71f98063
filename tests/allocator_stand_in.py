"""A stand-in for the CUDA caching allocator's history, so that ``source="allocator"`` and the snapshot labels run
on CPU: tests emit the entries torch's allocator would record, at known moments of a real training step."""

from __future__ import annotations


class FakeAllocator:
    """What memprof asks of torch's allocator history, kept in lists: the entries recorded (a ring buffer of
    ``max_entries``), whether it records, the metadata string, and every call memprof made."""

    def __init__(self, enabled: bool = False, metadata: str = "") -> None:
        self.on = enabled
        self.max_entries = 1 << 30
        self.buffer: list[dict] = []
        self.metadata = metadata
        self.calls: list[tuple] = []
        self.texts: list[str] = []
        self.t = 0
        self.seen: list[dict] = []  # every entry recorded, also those a drain cleared

    def enabled(self) -> bool:
        return self.on

    def labels(self) -> bool:
        return True

    def record(self, enabled, **options) -> None:
        self.calls.append((enabled, options))
        self.on = enabled is not None
        if enabled is not None:
            self.max_entries = options.get("max_entries", self.max_entries)
            if options.get("clear_history"):
                self.buffer.clear()

    def snapshot(self) -> dict:
        return {"segments": [], "device_traces": [list(self.buffer)]}

    def get_metadata(self) -> str:
        return self.metadata

    def set_metadata(self, text: str) -> None:
        self.texts.append(text)
        self.metadata = text

    def emit(self, action: str, addr: int, size: int) -> None:
        if not self.on:
            return
        self.t += 1
        self.buffer.append({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": self.t,
                            "frames": [], "compile_context": "", "user_metadata": self.metadata})
        self.seen.append(self.buffer[-1])
        del self.buffer[:-self.max_entries]
