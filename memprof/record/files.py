"""Files memprof writes and reads: atomically written, strictly read.

A trace is written to a temporary file in the same folder, flushed to disk
and renamed over the target, so a failed write (disk full, quota, a size
limit) leaves the previous file intact. Only a regular file is replaced so: a
link is followed to the file it names, a named pipe or a character device
(``/dev/stdout``) is written into, and anything else (a folder, a socket, a
disk) is refused before a byte is written. A file is read with every failure
(not a file, unreadable, not UTF-8, not JSON, nested too deep) turned into
a :class:`~memprof.errors.TraceFormatError` that names the file and the fix.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import stat
import tempfile
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import InvalidArgumentError, TraceFormatError, TraceNotFoundError

if TYPE_CHECKING:
    from .trace import Trace

__all__ = ["write_text_atomic", "write_bytes_atomic", "write_json_atomic", "check_writable", "make_writable_folder",
           "read_json", "load_trace"]


def _path(path: Any, what: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"{what} needs a file path (a str or pathlib.Path), got {type(path).__name__}")
    name = os.fspath(path)
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{what} needs a file path, got {path!r}")
    return name


def write_text_atomic(path: "str | os.PathLike[str]", text: str) -> None:
    """Write ``text`` as UTF-8 to ``path`` as :func:`write_bytes_atomic` does.

    A lone surrogate (``"\\ud800"``, from an exception message or a name made of undecodable bytes)
    has no UTF-8 form and no JSON reader takes it back: it is written as U+FFFD, the replacement
    character, so the file is valid UTF-8 whatever the text held.
    """
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        data = _SURROGATE.sub("\ufffd", text).encode("utf-8")
    write_bytes_atomic(path, data)


def write_json_atomic(path: "str | os.PathLike[str]", value: Any, *, indent: "int | None" = None) -> None:
    """Write ``value`` as JSON with :func:`write_text_atomic`: UTF-8 itself rather than ``\\u`` escapes, so
    that a lone surrogate in a string reaches the file as U+FFFD, never as an escape that a strict
    reader refuses. ``indent=None`` writes it compact (the C encoder, several times faster)."""
    separators = (",", ":") if indent is None else None
    write_text_atomic(path, json.dumps(value, indent=indent, separators=separators, ensure_ascii=False) + "\n")


# Lone surrogates: the only code points a Python str holds that UTF-8 cannot encode.
_SURROGATE = re.compile("[\ud800-\udfff]")


def write_bytes_atomic(path: "str | os.PathLike[str]", data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either its old content or all of the new.

    What stands at ``path`` decides how: nothing, or a regular file, is replaced atomically (a
    temporary file in the same folder, flushed, renamed over it; an existing file keeps its
    permissions and owner); a symbolic link is followed, through any chain, and its final target
    written so (a dangling link creates the file it points to, if that folder exists); a named pipe
    or a character device (``/dev/stdout``, ``/dev/null``) is written into as it stands, never
    replaced. A folder, a socket, a block device or a link that loops is refused with
    :class:`InvalidArgumentError`, before anything is written; :func:`check_writable` makes the same
    check alone.
    """
    target = _target(path)
    if target.stream:
        _stream(target.path, data)
    else:
        _replace(target, data)


def check_writable(path: "str | os.PathLike[str]") -> None:
    """Refuse now, as :func:`write_bytes_atomic` would, a ``path`` memprof cannot write (a folder, a
    socket, a block device, a looping link, a missing folder), so that a command can refuse all its
    outputs before it writes any."""
    _target(path)


def make_writable_folder(path: str) -> None:
    """Create the folder ``path`` if missing and write a file in it once (then remove it): an ``OSError`` now,
    when memprof could not write its files there later (a file on the way, no permission, a read-only disk)."""
    os.makedirs(path, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".memprof-probe-", dir=path)
    os.close(fd)
    os.unlink(probe)


class _Target(NamedTuple):
    #: The file to write: the final target of a replace (links resolved), the path given for a stream.
    path: str
    #: Write into what stands there (a pipe, a device) instead of replacing it.
    stream: bool
    #: The replaced file's status (its permissions and owner are kept), None for a new file.
    old: "os.stat_result | None" = None


def _target(path: Any) -> _Target:
    name = _path(path, "saving")
    try:
        st = os.stat(name)  # follows every link, /proc's to pipes and terminals included
    except (FileNotFoundError, NotADirectoryError):
        return _new_file(name)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidArgumentError(
                f"cannot save to {name}: it is a symbolic link that loops (or a chain of links too long to "
                "follow); point it at a file, or give another name") from None
        raise OSError(exc.errno, f"cannot save to {name} ({exc.strerror})", name) from None
    if stat.S_ISREG(st.st_mode):
        real = os.path.realpath(name)
        try:
            same = os.path.samestat(st, os.stat(real))
        except OSError:
            same = False
        if not same:  # a link to a deleted file (/proc/self/fd/N), or it changed under us
            raise InvalidArgumentError(
                f"cannot save to {name}: it leads to a file memprof cannot find by name ({real}); give the "
                "file's own path")
        return _Target(real, stream=False, old=st)
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode):
        return _Target(name, stream=True)
    via = "" if os.path.abspath(name) == os.path.realpath(name) else f" (through a link, {os.path.realpath(name)})"
    if stat.S_ISDIR(st.st_mode):
        raise InvalidArgumentError(f"cannot save to {name}: it is a folder{via}; give a file name such as run.json")
    raise InvalidArgumentError(
        f"cannot save to {name}: it is {_kind(st.st_mode)}{via}, not a file; memprof writes a regular file "
        "(replaced atomically), a named pipe or a character device such as /dev/stdout; give a file name "
        "such as run.json")


def _kind(mode: int) -> str:
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISBLK(mode):
        return "a block device (a disk)"
    return "not a regular file"


def _new_file(name: str) -> _Target:
    """Nothing at ``name``, or a dangling link: the file to create, once its folder is known to be there."""
    real = os.path.realpath(name)
    folder = os.path.dirname(real)
    if os.path.isdir(folder):
        return _Target(real, stream=False)
    via = "" if real == os.path.abspath(name) else f"it links to {real}, but "
    blocker = folder
    while not os.path.exists(blocker) and os.path.dirname(blocker) != blocker:
        blocker = os.path.dirname(blocker)
    if os.path.exists(blocker) and not os.path.isdir(blocker):
        raise InvalidArgumentError(f"cannot save to {name}: {via}{blocker} is a file, not a folder")
    raise InvalidArgumentError(f"cannot save to {name}: {via}the folder {folder} does not exist; create it first")


def _stream(name: str, data: bytes) -> None:
    """Write into the pipe or device at ``name`` (a pipe's open waits for a reader, as a shell's ``>`` does)."""
    # No O_CREAT, no O_TRUNC: if something else stands there by now, nothing is created or cut.
    fd = os.open(name, os.O_WRONLY | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
            raise InvalidArgumentError(f"cannot save to {name}: it changed while memprof opened it; save again")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _replace(target: _Target, data: bytes) -> None:
    folder = os.path.dirname(target.path)
    fd, tmp = _temporary(folder, os.path.basename(target.path))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if target.old is not None:
            _keep_owner_and_mode(tmp, target.old)
        os.replace(tmp, target.path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _sync_folder(folder)


def _temporary(folder: str, base: str) -> "tuple[int, str]":
    """A new file beside the target. Created with mode 0o666, which the kernel narrows by the umask: a new
    target gets the permissions any new file would, without reading the umask (os.umask sets it too,
    for every thread of the process). The target's name is shortened in it, so that a name near the
    file system's limit still leaves room for the prefix and suffix."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = os.path.join(folder, f".{base[:100]}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
        except OSError as exc:
            raise OSError(exc.errno, f"cannot write in {folder} ({exc.strerror})", os.path.join(folder, base)) from None
    raise FileExistsError(errno.EEXIST, f"cannot write in {folder} (no free temporary name)", folder)


def _keep_owner_and_mode(tmp: str, old: os.stat_result) -> None:
    if (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
        try:
            os.chown(tmp, old.st_uid, old.st_gid)  # root saving over a user's file leaves it the user's
        except OSError:
            pass  # not permitted: the file is the writer's, as any new file would be
    os.chmod(tmp, stat.S_IMODE(old.st_mode))  # after chown, which clears set-user-ID bits


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
