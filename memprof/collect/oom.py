"""Out-of-memory forensics: ``profile(..., oom_dump="dir/")``.

When an out-of-memory error leaves the block (``torch.OutOfMemoryError``, a CUDA OOM surfaced as
``RuntimeError``, the CPU allocator's "can't allocate memory", Python's ``MemoryError``), the trace up
to that moment is written to ``dir/memprof-oom-<rank>-<pid>-<time>.json``, with what was live by
category and module and, where known, the failed request and the device's free and total memory.

On CUDA torch's allocator calls an observer at the failing allocation itself
(``torch._C._cuda_attach_out_of_memory_observer``, the hook behind torch's documented "snapshot on
OOM" recipe; c10/cuda/CUDACachingAllocator.cpp): memprof reads the exact request and free bytes
there, takes the live breakdown before anything unwinds, and writes a memory_viz snapshot
(``torch.cuda.memory._snapshot()``) beside the dump. torch has no call to detach an observer, so one
observer is attached once per process and forwards to the profiles running.

The user's exception always propagates unchanged: writing the dump never raises, a failure to write
is a warning. The folder is checked (created if needed, and written to) when the block starts, so an
unwritable one is an error then, not at the OOM.
"""

from __future__ import annotations

import datetime
import os
import re
import warnings
from typing import TYPE_CHECKING, Callable

from ..errors import InvalidArgumentError, MemprofWarning, error_text, is_interrupt
from ..record.checks import MAX_COUNT
from ..record.files import make_writable_folder
from ..record.trace import OomRecord
from .weak import WeakIdentitySet

if TYPE_CHECKING:
    import torch

    from ..record.trace import Breakdown, Trace

#: What was live at an error (``Profiler.live_now``): by category, by creating module (name, bytes), and storage by
#: storage (address, bytes, category, module).
LiveAtError = tuple["Breakdown", tuple[tuple[str, int], ...], tuple[tuple[int, int, str, str], ...]]

__all__ = ["OomDump", "is_oom", "checked_folder", "oom_record", "error_text"]

# The CPU allocator says how many bytes it was asked for, to the byte (c10/core/impl/alloc_cpu.cpp).
# ASCII digits only (``\d`` takes any script's), and no more than a count of bytes can have: a message
# quoting a longer number is not the allocator's, and int() refuses numbers of over 4,300 digits.
_CPU_REQUEST = re.compile(r"tried to allocate ([0-9]{1,20}) bytes")
# Longest exception text a record keeps: a message of megabytes would be most of the dump.
_WATCHING: "WeakIdentitySet[OomDump]" = WeakIdentitySet()
_OBSERVER_ATTACHED = False


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error of torch, the CPU allocator, or Python, or was raised
    from one (a framework that wraps the OOM in its own exception: ``raise X from oom``, or in ``except``)."""
    import torch

    seen = 0
    current: "BaseException | None" = exc
    while current is not None and seen < 8:
        if isinstance(current, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(current, RuntimeError):
            text = error_text(current).lower()
            if "out of memory" in text or "can't allocate memory" in text:
                return True
        current = current.__cause__ or current.__context__
        seen += 1
    return False


def checked_folder(folder: object, argument: str = "oom_dump") -> str:
    """``folder`` as a path memprof can write files into (created if missing), or a clear error now;
    ``argument`` is the name the error gives it (the integrations' ``save_dir`` is checked here too)."""
    if not isinstance(folder, (str, os.PathLike)) or not os.fspath(folder):
        raise InvalidArgumentError(f"{argument} must be a folder path (a str or pathlib.Path), got {folder!r}")
    path = os.path.abspath(os.fspath(folder))
    if os.path.exists(path) and not os.path.isdir(path):
        raise InvalidArgumentError(f"{argument}={folder!r} is a file, not a folder; give a folder for memprof's files")
    try:
        make_writable_folder(path)
    except OSError as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise InvalidArgumentError(
            f"{argument}={folder!r}: memprof cannot write there ({exc.strerror or exc}); give a writable folder"
        ) from None
    return path


class OomDump:
    """Watches one profile for an out-of-memory error and writes its dump.

    Between :meth:`start` and :meth:`stop` (the profile's block), ``live_now`` says what is live, by category,
    module and storage (``Profiler.live_now``); it is dropped at :meth:`stop`, so that nothing of the profile
    stays reachable from here after it.
    """

    def __init__(self, folder: str, device: "torch.device") -> None:
        self.folder = folder
        self.device = device
        self._live_now: "Callable[[], LiveAtError | None] | None" = None
        # The latest OOM the CUDA allocator reported: (device, requested, device free), what was live then
        # (Profiler.live_now) and the snapshot written. An OOM the user caught is replaced by the next.
        self.observed: "tuple[int, int, int] | None" = None
        self.live: "LiveAtError | None" = None
        self.snapshot: "str | None" = None

    def start(self, live_now: "Callable[[], LiveAtError | None]") -> None:
        if self.device.type == "cuda":
            _attach_observer()
            _WATCHING.add(self)
        self._live_now = live_now

    def stop(self) -> None:
        _WATCHING.discard(self)
        self._live_now = None

    def discard(self) -> None:
        """The block ended without an OOM: an OOM caught inside it leaves no snapshot behind."""
        self._remove_snapshot()
        self.observed = self.live = None

    def _remove_snapshot(self) -> None:
        if self.snapshot is not None:
            try:
                os.unlink(self.snapshot)
            except OSError as failure:
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                pass
            self.snapshot = None

    # -- at the failing allocation (CUDA) ------------------------------------------------------

    def on_cuda_oom(self, device: int, requested: int, device_free: int) -> None:
        live_now = self._live_now
        if live_now is None:  # the profile is not running
            return
        self.observed = (device, requested, device_free)
        self.live = live_now()  # before the exception unwinds anything
        self._remove_snapshot()  # an earlier OOM, caught by the user: this one is what a dump would show
        try:
            import pickle

            from ..record.files import write_bytes_atomic
            from .torch_compat import cuda_memory_snapshot

            snapshot = cuda_memory_snapshot()
            name = os.path.join(self.folder, _file_name("pickle"))
            write_bytes_atomic(name, pickle.dumps(snapshot))  # whole or not at all: no truncated pickle left
            self.snapshot = name
        except Exception as exc:  # never a second exception inside the allocator's failure path
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            warnings.warn(f"memprof could not write the memory_viz snapshot at the OOM: {exc}", MemprofWarning,
                          stacklevel=2)

    # -- when the error leaves the block -------------------------------------------------------

    def record(self, exc: BaseException) -> OomRecord:
        """The record of ``exc``, with what the CUDA observer saw of it."""
        return oom_record(exc, self.device, self.observed, self.snapshot)

    def write(self, trace: "Trace") -> "str | None":
        """Write the dump; a failure is a warning, never an exception."""
        try:
            from ..record.files import write_json_atomic

            path = os.path.join(self.folder, _file_name("json"))
            # Compact: the C encoder, several times faster than an indented dump (the OOM is waiting).
            write_json_atomic(path, trace.to_dict())
            return path
        except Exception as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            _warn(f"memprof could not write its OOM dump into {self.folder}: {exc}")
            return None


def _warn(message: str) -> None:
    # Called in the profile's exit while the user's OOM propagates: with warnings made errors
    # (-W error, pytest's filterwarnings) the warning would replace that OOM, so it is dropped instead.
    try:
        warnings.warn(message, MemprofWarning, stacklevel=4)
    except Warning as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        pass


def oom_record(exc: BaseException, device: "torch.device", observed: "tuple[int, int, int] | None" = None,
               snapshot: "str | None" = None) -> OomRecord:
    """What an out-of-memory error says of itself: its message (:func:`error_text`, first line), the
    request (exact from the CUDA observer's ``(device, requested, free)``, or from the CPU allocator's
    message), the device's memory."""
    requested = free = total = None
    if observed is not None:
        _, requested, free = observed
    else:
        found = _CPU_REQUEST.search(error_text(exc))
        requested = int(found.group(1)) if found else None
        if requested is not None and requested > MAX_COUNT:
            requested = None  # more than a trace may hold (no allocator was asked for 8 EiB): not a figure to record
    if device.type == "cuda":
        try:
            import torch

            total = torch.cuda.get_device_properties(device).total_memory
        except Exception as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            total = None
    return OomRecord(error_text(exc, first_line=True), requested, free, total,
                     os.path.basename(snapshot) if snapshot else None)


def _file_name(ext: str) -> str:
    rank = 0
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
    except Exception as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        rank = 0
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return f"memprof-oom-{rank}-{os.getpid()}-{stamp}.{ext}"


def _observer(device: int, requested: int, device_allocated: int, device_free: int) -> None:
    for dump in list(_WATCHING):
        try:
            dump.on_cuda_oom(device, requested, device_free)
        except Exception as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            pass  # the allocator's failure path must see no exception of ours


def _attach_observer() -> None:
    global _OBSERVER_ATTACHED
    if _OBSERVER_ATTACHED:
        return
    from .torch_compat import attach_cuda_oom_observer as attach

    if attach is not None:
        attach(_observer)
        _OBSERVER_ATTACHED = True
