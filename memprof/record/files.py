"""Files memprof writes and reads: atomically written, strictly and boundedly read. Every file memprof
writes goes through :func:`write_bytes_atomic` (or its text and JSON forms), every file it reads through
:func:`read_bytes` (or :func:`read_json`).

A trace is written to a temporary file in the same folder, flushed to disk
and renamed over the target, so a failed write (disk full, quota, a size
limit) leaves the previous file intact. Only a regular file is replaced so: a
link is followed to the file it names, a named pipe or a character device
(``/dev/stdout``) is written into, and anything else (a folder, a socket, a
disk), a read-only file, a folder memprof cannot write in and a path a plain
``open()`` fails on as a folder (``run.json/``, ``run.json/../x.json``) is
refused before a byte is written. A file is read only if it is a regular file
no larger than :data:`MAX_FILE_BYTES` (a pipe cannot block the read,
``/dev/zero`` cannot fill memory), with every failure (not a file, too large,
unreadable, failing while read, not UTF-8, not JSON, a key given twice, nested
too deep, out of memory) turned into a :class:`~memprof.errors.TraceFormatError`
that names the file and the fix.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import stat
import tempfile
from typing import TYPE_CHECKING, NamedTuple

from .aliases import JSON, JSONObject
from ..errors import InvalidArgumentError, MemprofError, TraceFormatError, TraceNotFoundError, is_interrupt

if TYPE_CHECKING:
    from .trace import Trace

__all__ = ["write_text_atomic", "write_bytes_atomic", "write_json_atomic", "check_writable", "make_writable_folder",
           "read_bytes", "read_json", "load_trace", "max_file_bytes", "MAX_FILE_BYTES", "LIMIT_ENV"]


def _path(path: object, what: str) -> str:
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
    except UnicodeEncodeError as lone:
        if is_interrupt(lone):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        data = _SURROGATE.sub("\ufffd", text).encode("utf-8")
    write_bytes_atomic(path, data)


def write_json_atomic(path: "str | os.PathLike[str]", value: JSON, *, indent: "int | None" = None) -> None:
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
    replaced. A folder, a socket, a block device, a link that loops, a file a plain write could not
    overwrite (read-only: see :func:`_refuse_read_only`), a path that names a folder or passes through a
    file (:func:`_new_file`) or a folder the temporary file cannot be made in is refused with
    :class:`InvalidArgumentError`, before anything is written;
    :func:`check_writable` makes the same check alone.
    """
    target = _target(path)
    if target.stream:
        _stream(target.path, data)
    else:
        _replace(target, data)


def check_writable(path: "str | os.PathLike[str]") -> None:
    """Refuse now, as :func:`write_bytes_atomic` would, a ``path`` memprof cannot write (a folder, a
    socket, a block device, a looping link, a missing or unwritable folder, a read-only file, a path that
    names a folder), so that a command can refuse all its outputs before it writes any."""
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


def _target(path: object) -> _Target:
    name = _path(path, "saving")
    if _folder_name(name):
        raise InvalidArgumentError(_names_a_folder(name, name))
    try:
        st = os.stat(name)  # follows every link, /proc's to pipes and terminals included
    except (FileNotFoundError, NotADirectoryError) as missing:
        if is_interrupt(missing):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return _new_file(name)
    except OSError as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        if exc.errno == errno.ELOOP:
            raise InvalidArgumentError(
                f"cannot save to {name}: it is a symbolic link that loops (or a chain of links too long to "
                "follow); point it at a file, or give another name") from None
        raise OSError(exc.errno, f"cannot save to {name} ({exc.strerror})", name) from None
    if stat.S_ISREG(st.st_mode):
        real = os.path.realpath(name)
        try:
            same = os.path.samestat(st, os.stat(real))
        except OSError as gone:
            if is_interrupt(gone):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            same = False
        if not same:  # a link to a deleted file (/proc/self/fd/N), or it changed under us
            raise InvalidArgumentError(
                f"cannot save to {name}: it leads to a file memprof cannot find by name ({real}); give the "
                "file's own path")
        _refuse_read_only(name, real, st)
        _refuse_unwritable_folder(name, os.path.dirname(real), replacing=True)
        return _Target(real, stream=False, old=st)
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode):
        _refuse_read_only(name, name, st)
        return _Target(name, stream=True)
    via = "" if os.path.abspath(name) == os.path.realpath(name) else f" (through a link, {os.path.realpath(name)})"
    if stat.S_ISDIR(st.st_mode):
        raise InvalidArgumentError(f"cannot save to {name}: it is a folder{via}; give a file name such as run.json")
    raise InvalidArgumentError(
        f"cannot save to {name}: it is {_kind(st.st_mode)}{via}, not a file; memprof writes a regular file "
        "(replaced atomically), a named pipe or a character device such as /dev/stdout; give a file name "
        "such as run.json")


def _refuse_read_only(name: str, real: str, st: os.stat_result) -> None:
    """Refuse what stands at ``name`` if a plain write (a shell's ``>``, ``open(path, "w")``) could not overwrite
    it: the rename that saves a file atomically needs only the folder's permission, so it would replace a file the
    user protected, and keeping its mode would hide that it ever happened.

    A file is read-only to memprof when this process may not write it (``os.access`` with the effective ids: the
    owner, group and others bits, ACLs, a read-only mount), or when no one may (no write bit at all: ``chmod
    a-w``, mode 0444). The second holds for root too, whom ``os.access`` lets write anything: a plain write as root
    would succeed, but only by overriding the permissions, and whoever made a file unwritable for everyone (a
    baseline kept for comparison, in a container or a CI job that runs as root) meant it as any user does. A file
    some may write (another user's 0644) root writes, as its plain write would, and leaves that user's
    (:func:`_keep_owner_and_mode`)."""
    effective = os.access in os.supports_effective_ids
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o222 and os.access(real, os.W_OK, effective_ids=effective):
        return
    via = "" if real == name else f" (through a link, {real})"
    who = "no one may write it" if not mode & 0o222 else "you may not write it"
    raise InvalidArgumentError(
        f"cannot save to {name}{via}: it is read-only, mode {mode:04o}: {who}; memprof replaces only what a "
        f"plain write could overwrite: make it writable (chmod u+w {real}) or give another name")


def _refuse_unwritable_folder(name: str, folder: str, *, replacing: bool) -> None:
    """Refuse now a file memprof could not create in ``folder`` (the temporary file it renames over the target)."""
    if os.access(folder, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return
    why = (f"memprof writes the new file beside the old one in {folder} and renames it over it (so that a failed "
           "write leaves the old one whole), and that folder is not writable" if replacing
           else f"the folder {folder} is not writable")
    raise InvalidArgumentError(f"cannot save to {name}: {why}; save it in a folder you can write")


def _kind(mode: int) -> str:
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISBLK(mode):
        return "a block device (a disk)"
    return "not a regular file"


def _folder_name(name: str) -> "str | None":
    """How ``name`` ends if it names a folder whatever stands there: in a separator (``run.json/``), ``.`` or
    ``..``; else None. A plain ``open(name, "w")`` of such a path fails (``Is a directory``, ``No such file``), while
    :func:`os.path.realpath` drops the ending and names another file, one memprof would create or replace."""
    if name.endswith((os.sep, os.altsep or os.sep)):
        return name[-1]
    last = os.path.basename(name)
    return last if last in (os.curdir, os.pardir) else None


def _names_a_folder(name: str, final: str) -> str:
    """The refusal of ``name``, which names a folder (through a link to ``final``, where it is not ``name``)."""
    ending = _folder_name(final)
    if os.path.isdir(final):
        what = "it is a folder" if final == name else f"it links to {final}, a folder"
    else:
        what = (f"it ends in {ending!r}, so it names a folder" if final == name
                else f"it links to {final}, which ends in {ending!r} and so names a folder")
    return f"cannot save to {name}: {what}, where a plain write fails; give a file name such as run.json"


def _new_file(name: str) -> _Target:
    """Nothing at ``name``, or a dangling link: the file to create, once the kernel finds its folder.

    The folder is the one the kernel would create the file in: the name's (or the last link's) own folder,
    looked up by ``os.stat`` and never shortened by hand, so ``run.json/../x.json`` (a file on the way: ``Not a
    directory``) and ``gone/../x.json`` are refused as a plain write refuses them, not taken for ``x.json``."""
    final = _link_end(name)
    if _folder_name(final):
        raise InvalidArgumentError(_names_a_folder(name, final))
    folder = os.path.dirname(final) or os.curdir
    if os.path.isdir(folder):
        real = os.path.realpath(folder)
        _refuse_unwritable_folder(name, real, replacing=False)
        return _Target(os.path.join(real, os.path.basename(final)), stream=False)
    via = "" if final == name else f"it links to {final}, but "
    # The first part of the folder's path that is no folder: a file on the way, or the first folder missing.
    missing, above = folder, os.path.dirname(folder)
    while above and above != missing and not os.path.exists(above):
        missing, above = above, os.path.dirname(above)
    if os.path.exists(missing) and not os.path.isdir(missing):
        raise InvalidArgumentError(f"cannot save to {name}: {via}{missing} is a file, not a folder")
    if above and os.path.exists(above) and not os.path.isdir(above):
        raise InvalidArgumentError(f"cannot save to {name}: {via}{above} is a file, not a folder")
    raise InvalidArgumentError(f"cannot save to {name}: {via}the folder {missing} does not exist; create it first")


#: The most links the kernel follows for one path (Linux's MAXSYMLINKS): a longer chain is refused as a loop.
_MAX_LINKS = 40


def _link_end(name: str) -> str:
    """The name the chain of links at ``name`` ends in (``name`` itself if it is no link), each link's text
    joined to the folder it stands in, as the kernel reads it, and never shortened (``a/..`` stays, for the
    kernel to look up)."""
    path = name
    for _ in range(_MAX_LINKS):
        try:
            if not stat.S_ISLNK(os.lstat(path).st_mode):
                return path
            text = os.readlink(path)
        except OSError as exc:  # nothing there, or a file on the way: the caller finds which
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            return path
        path = os.path.join(os.path.dirname(path), text)
    raise InvalidArgumentError(f"cannot save to {name}: it is a symbolic link that loops (or a chain of links too "
                               "long to follow); point it at a file, or give another name")


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
        except OSError as left:
            if is_interrupt(left):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
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
        except OSError as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            if isinstance(exc, FileExistsError):
                continue
            raise OSError(exc.errno, f"cannot write in {folder} ({exc.strerror})", os.path.join(folder, base)) from None
    raise FileExistsError(errno.EEXIST, f"cannot write in {folder} (no free temporary name)", folder)


def _keep_owner_and_mode(tmp: str, old: os.stat_result) -> None:
    if (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
        try:
            os.chown(tmp, old.st_uid, old.st_gid)  # root saving over a user's file leaves it the user's
        except OSError as refused:  # not permitted: the file is the writer's, as any new file would be
            if is_interrupt(refused):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
    os.chmod(tmp, stat.S_IMODE(old.st_mode))  # after chown, which clears set-user-ID bits


def _sync_folder(folder: str) -> None:
    # The rename itself is durable only once the folder's entry is on disk (POSIX; a no-op elsewhere).
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # a file system that cannot sync a folder: the rename stands
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
    finally:
        os.close(fd)


#: The largest file memprof reads (a trace, a memory snapshot), unless ``MEMPROF_MAX_FILE_SIZE`` in the
#: environment says otherwise (a size: ``4GiB``, ``500MB``, bytes). Far above any record memprof writes (each of
#: its long parts is capped: 100,000 live storages, 20,000 router calls, the steps kept in full), and a bound on
#: what a crafted or mistaken path costs: parsed, JSON takes several times its size in memory.
MAX_FILE_BYTES = 2**30
#: The environment variable that sets the limit in place of :data:`MAX_FILE_BYTES`.
LIMIT_ENV = "MEMPROF_MAX_FILE_SIZE"
_TRACE_FIX = "give a file written by report.save()"


def max_file_bytes() -> int:
    """The most bytes :func:`read_bytes` reads: ``MEMPROF_MAX_FILE_SIZE`` if set, else :data:`MAX_FILE_BYTES`
    (read at each call, so a test or a long-lived process can change it)."""
    from ..units import parse_size
    from ..errors import SizeParseError

    setting = os.environ.get(LIMIT_ENV, "").strip()
    if not setting:
        return MAX_FILE_BYTES
    try:
        return parse_size(setting)
    except SizeParseError as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise InvalidArgumentError(f"{LIMIT_ENV}={setting!r} is not a size ({exc}); give one such as 4GiB, or "
                                   "unset it for the default (1 GiB)") from None


def read_bytes(path: "str | os.PathLike[str]", *, what: str = "a trace", fix: str = _TRACE_FIX,
               error: "type[MemprofError]" = TraceFormatError) -> bytes:
    """The bytes of the regular file at ``path`` (a link to one is followed): the one way memprof reads a file.

    Whatever stands there, the read is bounded in time and memory. The file is opened without waiting
    (``O_NONBLOCK``: a named pipe with no writer cannot block it) and what was opened is checked, not the
    path (no race with a rename): a pipe, a device (``/dev/zero``, a terminal), a folder or a socket is
    refused before a byte is read. A file above :func:`max_file_bytes` is refused by its size, and at most
    that many bytes plus one are read, so a file that grows while it is read is refused too. A missing file
    raises :class:`TraceNotFoundError` (a ``FileNotFoundError``); anything else, the ``error`` class, naming
    ``path``, what it is, and ``fix`` (what to give instead). ``what`` names the file expected ("a trace").
    """
    name = _path(path, f"reading {what}")
    limit = max_file_bytes()
    fd = _open_for_reading(name, what, fix, error)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            real = os.path.realpath(name)
            via = "" if real == os.path.abspath(name) else f" (through a link, {real})"
            raise error(f"{name} is {_node(st.st_mode)}{via}, not a file; memprof reads {what} from a regular "
                        f"file only; {fix}")
        if st.st_size > limit:
            raise error(_too_large(name, st.st_size, limit, what))
        data = _read_at_most(fd, limit + 1)
        if len(data) > limit:  # it grew while being read (a log still written, a file in /proc)
            raise error(_too_large(name, None, limit, what))
        return data
    except MemprofError:
        raise  # a refusal above (an OSError itself where ``error`` is one)
    except MemoryError as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise error(f"{name} is too large to read in the memory this process may use; {fix}, or give the "
                    "process more memory") from None
    except OSError as exc:  # the open succeeded, the read did not: a disk error, /proc/self/mem, a revoked right
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise error(f"{name} cannot be read ({_reason(exc)}); {fix}") from None
    finally:
        os.close(fd)


def _open_for_reading(name: str, what: str, fix: str, error: "type[MemprofError]") -> int:
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(name, flags)
    except OSError as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        if isinstance(exc, FileNotFoundError):
            raise TraceNotFoundError(errno.ENOENT, f"no such file: {name}; {fix}", name) from None
        if isinstance(exc, IsADirectoryError):  # where a folder cannot be opened for reading at all
            raise error(f"{name} is a folder, not a file; {fix}") from None
        if isinstance(exc, PermissionError):
            raise error(f"{name} cannot be read (permission denied); {fix} that you can read") from None
        raise error(f"{name} cannot be read ({_reason(exc)}); {fix}") from None


def _reason(exc: OSError) -> str:
    """Why a file could not be opened or read, in words."""
    if exc.errno == errno.ELOOP:
        return "it is a symbolic link that loops"
    if exc.errno == errno.ENXIO:  # a socket, or a device with nothing behind it
        return "it is a socket or a device, not a file"
    return exc.strerror or type(exc).__name__


def _node(mode: int) -> str:
    """What a path that is not a regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode):
        return "a character device (such as /dev/zero or a terminal)"
    return _kind(mode)


def _too_large(name: str, size: "int | None", limit: int, what: str) -> str:
    from ..units import format_bytes

    was = f"is {format_bytes(size)} ({size:,} bytes), above" if size is not None else "grew, while read, past"
    return (f"{name} {was} the {format_bytes(limit)} ({limit:,} bytes) memprof reads at most ({LIMIT_ENV}); if it is "
            f"{what}, set {LIMIT_ENV} above its size (such as {LIMIT_ENV}=8GiB) to read it")


def _read_at_most(fd: int, most: int) -> bytes:
    """At most ``most`` bytes of ``fd``, in pieces, so that nothing is allocated ahead for a size the file
    only claims (``os.read(fd, most)`` would allocate ``most`` bytes at once)."""
    parts: list[bytes] = []
    got = 0
    while got < most:
        try:
            part = os.read(fd, min(most - got, 1 << 24))
        except InterruptedError as exc:  # pragma: no cover - retried by Python itself since PEP 475
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            continue
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_json(path: "str | os.PathLike[str]") -> JSON:
    """The JSON value in ``path``, read by :func:`read_bytes`. A missing file raises :class:`TraceNotFoundError`
    (a ``FileNotFoundError`` too); any other failure to read it as JSON raises :class:`TraceFormatError`, an object
    that gives one key twice included (JSON allows it and Python's reader keeps the last silently: a file that
    says ``"num_steps": 2, "num_steps": 7`` says two things, and memprof does not choose)."""
    name = _path(path, "loading a trace")
    data = read_bytes(name)
    size = len(data)
    try:
        text = data.decode("utf-8")
        del data  # parsed from the text alone: the file's bytes need not stay in memory beside it
        value: JSON = json.loads(text, object_pairs_hook=_once_each)
        return value
    except (ValueError, RecursionError, MemoryError) as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise TraceFormatError(f"{name} {_unreadable_json(exc, size)}") from None


class _Repeated(ValueError):
    """An object of the file gives ``key`` twice."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _once_each(pairs: "list[tuple[str, JSON]]") -> JSONObject:
    """A JSON object as a dict, refusing a key it gives twice (the reader's ``object_pairs_hook``)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Repeated(key)
            seen.add(key)
    return out


def _unreadable_json(exc: BaseException, size: int) -> str:
    """Why a file's bytes are no JSON value memprof reads, and the fix, in words (after the file's name)."""
    if isinstance(exc, UnicodeDecodeError):
        return f"is not a text file (not UTF-8); {_TRACE_FIX}"
    if isinstance(exc, json.JSONDecodeError):
        return f"is not valid JSON ({exc.msg} at line {exc.lineno}); {_TRACE_FIX}"
    if isinstance(exc, _Repeated):
        key = exc.key if len(exc.key) <= 40 else exc.key[:37] + "..."
        return f"gives the key {key!r} twice in one object, where a trace says each thing once; {_TRACE_FIX}"
    if isinstance(exc, RecursionError):
        return f"is nested too deeply to be a memprof trace; {_TRACE_FIX}"
    if isinstance(exc, MemoryError):
        return (f"({size:,} bytes) is too large to parse in the memory this process may use; {_TRACE_FIX}, or give "
                "the process more memory")
    return f"cannot be read ({exc}); {_TRACE_FIX}"


def load_trace(path: "str | os.PathLike[str]") -> "Trace":
    """The Trace saved in ``path`` (see :func:`read_json` for the errors; running out of memory while building
    it is a :class:`TraceFormatError` too, never a bare ``MemoryError``)."""
    from .trace import Trace

    data = read_json(path)
    try:
        return Trace.from_dict(data)
    except MemoryError as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        del data
        raise TraceFormatError(f"{os.fspath(path)} holds more than this process has the memory to load; "
                               f"{_TRACE_FIX}, or give the process more memory") from None
