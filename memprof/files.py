"""Files memprof writes and reads: atomically written, strictly read.

A trace is written to a temporary file in the same folder, flushed to disk
and renamed over the target, so a failed write (disk full, quota, a size
limit) leaves the previous file intact. A file is read with every failure
(not a file, unreadable, not UTF-8, not JSON, nested too deep) turned into
a :class:`~memprof.errors.TraceFormatError` that names the file and the fix.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgumentError, TraceFormatError, TraceNotFoundError

if TYPE_CHECKING:
    from .trace import Trace

__all__ = ["write_text_atomic", "write_bytes_atomic", "read_json", "load_trace"]


def _path(path: Any, what: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"{what} needs a file path (a str or pathlib.Path), got {type(path).__name__}")
    name = os.fspath(path)
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{what} needs a file path, got {path!r}")
    return name


def write_text_atomic(path: "str | os.PathLike[str]", text: str) -> None:
    """Write ``text`` to ``path`` so that ``path`` holds either its old content or all of the new."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: "str | os.PathLike[str]", data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either its old content or all of the new."""
    target = _path(path, "saving")
    folder = os.path.dirname(os.path.abspath(target))
    if os.path.isdir(target):
        raise InvalidArgumentError(f"cannot save to {target}: it is a folder; give a file name such as run.json")
    if not os.path.isdir(folder):
        if os.path.exists(folder):
            raise InvalidArgumentError(f"cannot save to {target}: {folder} is a file, not a folder")
        raise InvalidArgumentError(f"cannot save to {target}: the folder {folder} does not exist; create it first")
    try:
        mode = os.stat(target).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write in {folder} ({exc.strerror})", target) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _sync_folder(folder)


def _sync_folder(folder: str) -> None:
    # The rename itself is durable only once the folder's entry is on disk (POSIX; a no-op elsewhere).
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_json(path: "str | os.PathLike[str]") -> Any:
    """The JSON value in ``path``. A missing file raises :class:`TraceNotFoundError` (a
    ``FileNotFoundError`` too); any other failure to read it as JSON raises :class:`TraceFormatError`."""
    name = _path(path, "loading a trace")
    fix = "give a file written by report.save()"
    try:
        with open(name, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise TraceNotFoundError(2, f"no such file: {name}; give the path of a trace written by report.save()",
                                 name) from None
    except IsADirectoryError:
        raise TraceFormatError(f"{name} is a directory, not a trace file; {fix}") from None
    except PermissionError:
        raise TraceFormatError(f"{name} cannot be read (permission denied); {fix} that you can read") from None
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{name} is not valid JSON ({exc.msg} at line {exc.lineno}); {fix}") from None
    except UnicodeDecodeError:
        raise TraceFormatError(f"{name} is not a text file; {fix}") from None
    except RecursionError:
        raise TraceFormatError(f"{name} is nested too deeply to be a memprof trace; {fix}") from None
    except (OSError, ValueError) as exc:
        raise TraceFormatError(f"{name} cannot be read ({exc}); {fix}") from None


def load_trace(path: "str | os.PathLike[str]") -> "Trace":
    """The Trace saved in ``path`` (see :func:`read_json` for the errors)."""
    from .trace import Trace

    return Trace.from_dict(read_json(path))
