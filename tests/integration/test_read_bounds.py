"""Every file memprof reads is read through one reader (memprof.record.files.read_bytes), bounded in time
and in memory, whatever stands at the path: a named pipe cannot block it, a link to ``/dev/zero`` cannot
fill memory, a file above the limit is refused by its size, one that grows while read is cut at the limit
plus one byte, and running out of memory is one clear error, never a raw ``MemoryError`` (issue 36 item 11).

A reader that regressed would block on the pipe or read ``/dev/zero`` until the machine runs out: the pipe
is read in a thread with a deadline (and then unblocked by a writer), ``/dev/zero`` in a child process
under a memory limit, so that a regression fails the test rather than hanging it or the machine.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

import memprof
from memprof.cli import main
from memprof.errors import InvalidArgumentError, MemprofError, TraceFormatError
from memprof.record import files
from memprof.render.memory_viz import read_snapshot
from memprof.simulate.hf import load_config

from factories import full_trace

REPORT = memprof.Report(full_trace())

# Each reader of a path memprof has, as a user calls it: what it raised (None: it read the file).
READERS = {
    "memprof.load": lambda p: memprof.load(p),
    "memprof.merge": lambda p: memprof.merge([p]),
    "memprof.diff": lambda p: memprof.diff(p, p),
    "read_snapshot": read_snapshot,
    "memprof report": lambda p: main(["report", str(p)]),
    "memprof diff": lambda p: main(["diff", str(p), str(p)]),
    "memprof merge": lambda p: main(["merge", str(p)]),
    # A transformers config on this machine, read before transformers reads it (which would block or fill memory).
    "hf.load_config": load_config,
    "memprof estimate --hf": lambda p: main(["estimate", "--hf", str(p), "--batch-size", "1", "--seq-len", "8"]),
}
CONFIGS = ("hf.load_config", "memprof estimate --hf")


def _refusal(reader, path, capsys) -> str:
    """The one error ``reader`` gives for ``path``: a MemprofError's text, or the command's one stderr line."""
    capsys.readouterr()
    try:
        code = READERS[reader](path)
    except MemprofError as exc:
        return str(exc)
    assert code == 1, f"{reader} read {path}"
    err = capsys.readouterr().err
    assert err.startswith("memprof: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _within(seconds, fn):
    """``fn()``'s result, run in a thread that must end within ``seconds``; None if it did not."""
    out: list = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    return None if worker.is_alive() else out


@pytest.mark.parametrize("reader", list(READERS))
def test_a_named_pipe_is_refused_at_once(reader, tmp_path, capsys):
    fifo = tmp_path / "run.json"
    os.mkfifo(fifo)
    got = _within(30, lambda: _refusal(reader, fifo, capsys))
    if got is None:  # blocked on the pipe: a writer that opens and closes it lets the reader go
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"{reader} blocked on a named pipe")
    assert f"{fifo} is a named pipe, not a file" in got[0]


@pytest.mark.parametrize("reader", list(READERS))
def test_what_is_not_a_regular_file_is_refused_before_a_byte_is_read(reader, tmp_path, capsys):
    folder = tmp_path / "folder.json"
    folder.mkdir()
    sock = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # a relative name: a socket's path may not be longer than 107 bytes
    try:
        sock.bind("sock.json")
    finally:
        os.chdir(cwd)
        sock.close()
    tty = tmp_path / "tty.json"
    os.symlink("/dev/null", tty)  # a character device through a link: an empty read, still no file
    for path, what in ((folder, "is a folder"), (tmp_path / "sock.json", "socket"),
                       (tty, "is a character device (such as /dev/zero or a terminal) (through a link, /dev/null)")):
        if path is folder and reader in CONFIGS:
            what = f"no config.json in {folder}"  # a folder is where a config's config.json is looked for
        assert what in _refusal(reader, path, capsys)


def _failing_read(monkeypatch, path, where, errno_):
    """``os.fstat`` or ``os.read`` (``where``) on the descriptor opened for ``path`` fails with ``errno_``, as a disk
    error (EIO), a file whose permission changed after the open (NFS: EACCES) or ``/proc/self/mem`` do; every other
    descriptor is read as usual."""
    real_open, real = os.open, getattr(os, where)
    ours: set = set()

    def opened(name, *args, **kwargs):
        fd = real_open(name, *args, **kwargs)
        if os.fspath(name) == str(path):
            ours.add(fd)
        return fd

    def failing(fd, *args, **kwargs):
        if fd in ours:
            raise OSError(errno_, os.strerror(errno_))
        return real(fd, *args, **kwargs)

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, where, failing)


@pytest.mark.parametrize("where, errno_", [("read", errno.EIO), ("read", errno.EACCES), ("fstat", errno.EIO)])
@pytest.mark.parametrize("reader", list(READERS))
def test_a_file_that_fails_while_read_is_one_error_naming_it(reader, where, errno_, tmp_path, monkeypatch, capsys):
    # Review of issue 36, files item 2: an OSError after the open (memprof.load("/proc/self/mem") raised a raw
    # "OSError: [Errno 5]") is the reader's own error, naming the file and why, as a failed open is.
    path = tmp_path / "config.json"
    REPORT.save(path)
    _failing_read(monkeypatch, path, where, errno_)
    said = _refusal(reader, path, capsys)
    assert f"{path} cannot be read ({os.strerror(errno_)}); " in said, said


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="Linux's /proc/self/mem: a file whose read fails")
def test_proc_self_mem_is_refused_naming_it():
    # Its size says 0 and its first page is not mapped: the open succeeds and the read fails with EIO.
    with pytest.raises(TraceFormatError, match=r"^/proc/self/mem cannot be read \(Input/output error\); give a file "
                                               r"written by report.save\(\)$"):
        memprof.load("/proc/self/mem")


def test_a_link_to_a_regular_file_is_read_through(tmp_path):
    # The reader refuses what it opened, not links: a link to a trace reads the trace.
    REPORT.save(tmp_path / "real.json")
    os.symlink("real.json", tmp_path / "link.json")
    assert memprof.load(tmp_path / "link.json").trace == REPORT.trace


def test_a_file_above_the_limit_is_refused_by_its_size_and_the_limit_is_named(tmp_path, monkeypatch, capsys):
    path = tmp_path / "run.json"
    REPORT.save(path)
    size = path.stat().st_size
    monkeypatch.setenv(files.LIMIT_ENV, str(size))  # exactly its size: read
    assert memprof.load(path).trace == REPORT.trace
    monkeypatch.setenv(files.LIMIT_ENV, str(size - 1))
    from memprof.units import format_bytes

    expected = (f"{path} is {format_bytes(size)} ({size:,} bytes), above the {format_bytes(size - 1)} ({size - 1:,} "
                "bytes) memprof reads at most (MEMPROF_MAX_FILE_SIZE); if it is a trace, set MEMPROF_MAX_FILE_SIZE above its size (such as "
                "MEMPROF_MAX_FILE_SIZE=8GiB) to read it")
    for reader in READERS:
        said = _refusal(reader, path, capsys)
        assert expected in said.replace("a memory snapshot", "a trace").replace("a transformers config", "a trace")
    monkeypatch.delenv(files.LIMIT_ENV)
    assert files.max_file_bytes() == files.MAX_FILE_BYTES == 2**30


def test_a_limit_that_is_no_size_is_refused(tmp_path, monkeypatch):
    REPORT.save(tmp_path / "run.json")
    monkeypatch.setenv(files.LIMIT_ENV, "lots")
    with pytest.raises(InvalidArgumentError, match="MEMPROF_MAX_FILE_SIZE='lots' is not a size"):
        memprof.load(tmp_path / "run.json")


def test_a_file_that_grows_while_read_is_cut_at_the_limit_plus_one_byte(tmp_path, monkeypatch):
    # A file whose size says nothing of what it holds (/proc's say 0; a log still being written): the
    # reader reads at most limit + 1 bytes, and refuses it at that last byte.
    path = tmp_path / "run.json"
    path.write_bytes(b" " * 5000)
    real_fstat, real_read = os.fstat, os.read
    asked = []

    def fstat_says_empty(fd):
        st = real_fstat(fd)
        return os.stat_result(tuple(st)[:6] + (0,) + tuple(st)[7:])

    def counted_read(fd, n):
        asked.append(n)
        return real_read(fd, n)

    monkeypatch.setenv(files.LIMIT_ENV, "1000")
    monkeypatch.setattr(os, "fstat", fstat_says_empty)
    monkeypatch.setattr(os, "read", counted_read)
    with pytest.raises(TraceFormatError, match=f"{path} grew, while read, past the 1000 B \\(1,000 bytes\\) memprof reads at most"):
        memprof.load(path)
    assert sum(asked) == 1001


def test_running_out_of_memory_while_loading_is_one_error(tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    REPORT.save(path)

    def no_memory(*_a, **_k):
        raise MemoryError

    for where in ("loads",):  # parsing
        monkeypatch.setattr(json, where, no_memory)
        with pytest.raises(TraceFormatError, match=f"{path} .* is too large to parse in the memory this process"):
            memprof.load(path)
        monkeypatch.undo()
    monkeypatch.setattr(memprof.record.trace.Trace, "from_dict", no_memory)  # building the record
    with pytest.raises(TraceFormatError, match=f"{path} holds more than this process has the memory to load"):
        memprof.load(path)


# A child process, under a memory limit a little above what it uses once memprof is imported: a reader
# that read /dev/zero to its end would be stopped there by a MemoryError, not by the machine.
_CHILD = textwrap.dedent("""
    import json, resource, sys
    import memprof
    import transformers  # imported before the limit, as a program that uses it has
    from memprof.cli import main
    from memprof.render.memory_viz import read_snapshot
    from memprof.simulate.hf import load_config

    def vm():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))

    headroom = int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (vm() + headroom, resource.RLIM_INFINITY))
    out = {}
    for name, read in (("load", memprof.load), ("merge", lambda p: memprof.merge([p])),
                       ("snapshot", read_snapshot), ("config", load_config), ("cli", lambda p: main(["report", p]))):
        try:
            out[name] = repr(read(sys.argv[1]))
        except BaseException as exc:
            out[name] = type(exc).__name__ + ": " + str(exc)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
""")


def _child(tmp_path, target, headroom):
    result = tmp_path / "result.json"
    run = subprocess.run([sys.executable, "-c", _CHILD, str(target), str(result), str(headroom)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.exists(), run.stderr[-3000:]
    return json.loads(result.read_text()), run.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, RLIMIT_AS and /dev/zero as Linux has them")
def test_a_link_to_dev_zero_and_a_file_too_large_for_memory_are_one_error_each(tmp_path):
    # A crafted archive of traces can carry a link to /dev/zero: refused before a byte is read.
    os.symlink("/dev/zero", tmp_path / "zero.json")
    got, err = _child(tmp_path, tmp_path / "zero.json", 512 * 2**20)
    for name in ("load", "merge", "snapshot", "config"):
        assert "is a character device (such as /dev/zero or a terminal) (through a link, /dev/zero)" in got[name]
        assert not got[name].startswith("MemoryError")
    assert got["cli"] == "1" and err.count("\n") == 1 and "through a link, /dev/zero" in err
    # 96 MiB of JSON in 64 MiB of headroom: out of memory while reading or parsing, said in one line.
    big = tmp_path / "big.json"
    with open(big, "w") as f:
        f.write('{"format": "memprof.trace", "schema_version": 1, "notes": [')
        f.write("0," * (48 * 2**20) + "0]}")
    got, err = _child(tmp_path, big, 64 * 2**20)
    for name in ("load", "merge"):
        assert got[name].startswith("TraceFormatError: ") and "memory this process may use" in got[name], got[name]
    assert got["snapshot"].startswith("InvalidArgumentError: ") and "memory this process may use" in got["snapshot"]
    assert got["cli"] == "1" and "Traceback" not in err and "memory this process may use" in err
