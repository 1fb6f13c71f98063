"""What stands at the path memprof writes to decides how it writes, for every writer.

Nothing there, or a regular file: replaced atomically. A symbolic link: followed, through chains and
dangling links, and its final target written so. A named pipe or a character device (``/dev/stdout``,
``/dev/null``): written into, never replaced. A folder, a socket, a block device, a looping link or a
link into a missing folder: refused before anything is written, with the path and what it is.

The suite may run as root, where replacing ``/dev/null`` would break the machine: every target is
built in a temporary folder (a second node of ``/dev/null``'s device with ``os.mknod`` stands for a
character device), and ``/dev/null`` itself is written only after a link to it was shown to be
written through, never replaced.
"""

from __future__ import annotations

import os
import pathlib
import socket
import stat
import threading
import time

import pytest

import memprof
from memprof.cli import main
from memprof.errors import InvalidArgumentError
from memprof.record.files import check_writable, write_bytes_atomic, write_json_atomic, write_text_atomic

from factories import full_trace
from helpers import json_strings

REPORT = memprof.Report(full_trace())
TEXT = "memprof \u00e9crit\n"
DATA = bytes(range(256)) * 300  # 76,800 bytes: more than a pipe holds at once (64 KiB on Linux)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    """The trace the command-line writers read, in a folder of its own."""
    path = tmp_path_factory.mktemp("input") / "run.json"
    REPORT.save(path)
    return path


def _api(fn):
    def write(path, trace_file, capsys):
        try:
            fn(path)
        except InvalidArgumentError as exc:
            return str(exc)
        return None
    return write


def _cli(*argv):
    """``memprof ARGV... PATH``: None when written; else the error, checked to be one line and exit 1."""
    def write(path, trace_file, capsys):
        code = main([a.replace("TRACE", str(trace_file)) for a in argv] + [str(path)])
        err = capsys.readouterr().err
        if code == 0:
            return None
        assert code == 1 and err.startswith("memprof: error: ") and err.count("\n") == 1, err
        return err
    return write


WRITERS = {
    "write_text_atomic": _api(lambda p: write_text_atomic(p, TEXT)),
    "write_bytes_atomic": _api(lambda p: write_bytes_atomic(p, DATA)),
    "write_json_atomic": _api(lambda p: write_json_atomic(p, {"a": [1, TEXT]})),
    "Report.save": _api(REPORT.save),
    "Report.export_chrome_trace": _api(REPORT.export_chrome_trace),
    "Report.export_memory_viz": _api(REPORT.export_memory_viz),
    "Report.export_html": _api(REPORT.export_html),
    "memprof report --html": _cli("report", "TRACE", "--html"),
    "memprof export --chrome": _cli("export", "TRACE", "--chrome"),
    "memprof export --memory-viz": _cli("export", "TRACE", "--memory-viz"),
    "memprof export --html": _cli("export", "TRACE", "--html"),
}

_EXPECTED: dict = {}


def _expected(writer, trace_file, capsys, tmp_path_factory):
    """What ``writer`` writes into a new file: what every target that is written must receive."""
    if writer not in _EXPECTED:
        path = tmp_path_factory.mktemp("expected") / "out"
        assert WRITERS[writer](path, trace_file, capsys) is None
        _EXPECTED[writer] = path.read_bytes()
    return _EXPECTED[writer]


def _mknod(path, kind, device):
    try:
        os.mknod(path, kind | 0o600, device)
    except (PermissionError, OSError) as exc:
        pytest.skip(f"os.mknod is not permitted here ({exc.strerror}): a device node needs root")


# Each kind of target: build(folder) -> the path to write. Targets that are written are checked against
# what the writer writes to a new file; refused ones leave the folder exactly as it was.
def _regular(d):
    (d / "out").write_text("old content, longer than nothing")
    os.chmod(d / "out", 0o640)
    return d / "out"


def _chain(d):
    # out -> sub/hop -> ../real: a relative link inside a folder, relative to that folder
    (d / "sub").mkdir()
    (d / "real").write_text("old")
    os.symlink("../real", d / "sub" / "hop")
    os.symlink("sub/hop", d / "out")
    return d / "out"


def _link_to(target):
    def build(d):
        target(d)
        os.symlink(target.__name__.strip("_"), d / "out")
        return d / "out"
    return build


def _real(d):
    (d / "real").write_text("old")


def _made(d):
    pass  # a dangling link: the file it names does not exist yet


def _fifo(d):
    os.mkfifo(d / "fifo")


def _nul(d):
    # A second node of /dev/null's device (character device 1, 3 on Linux): a real character device
    # that nothing on the machine uses.
    st = os.stat(os.devnull)
    _mknod(d / "nul", stat.S_IFCHR, st.st_rdev)


WRITTEN = {
    "nothing there": lambda d: d / "out",
    "a regular file": _regular,
    "a link to a file": _link_to(_real),
    "a chain of links": _chain,
    "a dangling link": lambda d: (os.symlink("made.json", d / "out"), d / "out")[1],
    "a named pipe": lambda d: (_fifo(d), d / "fifo")[1],
    "a link to a named pipe": _link_to(_fifo),
    "a character device": lambda d: (_nul(d), d / "nul")[1],
    "a link to a character device": _link_to(_nul),
    # /dev/null itself, through a link: a writer that replaced what it found would replace the link only
    "a link to /dev/null": lambda d: (os.symlink(os.devnull, d / "out"), d / "out")[1],
}


def _socket(d):
    s = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(d)  # a relative name: a socket's path may not be longer than 107 bytes
    try:
        s.bind("sock")
    finally:
        os.chdir(cwd)
    s.close()  # the socket file stays
    return d / "sock"


def _loop(d):
    os.symlink("b", d / "a")
    os.symlink("a", d / "b")
    return d / "a"


REFUSED = {
    "a folder": (lambda d: (os.mkdir(d / "out"), d / "out")[1], "it is a folder"),
    "a link to a folder": (lambda d: (os.mkdir(d / "dir"), os.symlink("dir", d / "out"), d / "out")[2],
                           "it is a folder"),
    "a socket": (_socket, "it is a socket, not a file"),
    "a block device": (lambda d: (_mknod(d / "blk", stat.S_IFBLK, os.makedev(7, 255)), d / "blk")[1],
                       "it is a block device"),
    "a link that loops": (_loop, "symbolic link that loops"),
    "a link into a missing folder": (lambda d: (os.symlink("gone/x.json", d / "out"), d / "out")[1],
                                     "does not exist"),
    # What a plain write could not overwrite: the rename would replace it and keep its mode (issue 36 item 12).
    # No write bit for anyone: refused for root too, where os.access would say writable (see _refuse_read_only).
    "a read-only file": (lambda d: _read_only(d, "out"), "it is read-only, mode 0444: no one may write it"),
    "a link to a read-only file": (lambda d: (_read_only(d, "kept"), os.symlink("kept", d / "out"), d / "out")[2],
                                   "it is read-only, mode 0444: no one may write it"),
    # A path that names a folder, where a plain open() fails ('Is a directory', 'Not a directory'): the path is
    # given as a str, since pathlib drops a trailing separator (review of issue 36, files item 1).
    "a file named with a trailing separator": (lambda d: _kept(d, "out") + os.sep, "names a folder"),
    "a new name with a trailing separator": (lambda d: str(d / "new.json") + os.sep, "names a folder"),
    "a new name ending in a dot": (lambda d: str(d / "new") + os.sep + ".", "names a folder"),
    "a file ending in two dots": (lambda d: _kept(d, "out") + os.sep + "..", "names a folder"),
    "a link to a name with a trailing separator": (lambda d: _link(d, "made" + os.sep), "names a folder"),
    # A folder that is a file: the lexical path would skip it ("kept/../x" is "x"), the kernel does not.
    "a path through a file": (lambda d: (_kept(d, "x.json"), _kept(d, "kept") + "/../x.json")[1],
                              "is a file, not a folder"),
    "a link through a file": (lambda d: (_kept(d, "x.json"), _kept(d, "kept"), _link(d, "kept/../x.json"))[2],
                              "is a file, not a folder"),
    "a path through a missing folder": (lambda d: (_kept(d, "x.json"), str(d / "gone") + "/../x.json")[1],
                                        "does not exist"),
}


def _kept(d, name):
    """A regular file at ``d / name`` that a refused write must leave as it is; its path as a str."""
    (d / name).write_text("kept as it was")
    return str(d / name)


def _link(d, target):
    """A link ``d / "out"`` to ``target`` (whatever stands there); its path as a str."""
    os.symlink(target, d / "out")
    return str(d / "out")


def _read_only(d, name):
    (d / name).write_text("kept as it was")
    os.chmod(d / name, 0o444)
    return d / name


def _state(folder):
    """Every entry under ``folder``: its type, inode, link target and content."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.lstat(p)
            link = os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
            body = pathlib.Path(p).read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[os.path.relpath(p, folder)] = (stat.S_IFMT(st.st_mode), st.st_ino, link, body)
    return out


def _through_pipe(fifo, write):
    """Run ``write()`` while a thread reads the pipe at ``fifo``; what the reader got.

    The read end is opened without blocking first, so the writer's open never waits; the reader stops
    once the writer has returned and the pipe is empty (a writer that never opened the pipe leaves it
    empty: the test fails, it does not hang)."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    got, done = [], threading.Event()

    def read():
        # No deadline: on a loaded machine rendering can take longer than any bound, and a reader that gave
        # up early would fail the test for nothing. The loop ends once write() has returned and the pipe is
        # empty; write() itself cannot block, since this read end stays open.
        while True:
            # Whether write() had returned is read before the pipe is: an empty read after that moment means
            # everything written has been read. Read after, the writer could open, write, close and return
            # between an empty read and the check, and its bytes would be left in the pipe.
            finished = done.is_set()
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:  # a writer is there, nothing to read yet
                chunk = None
            if chunk:
                got.append(chunk)
            elif chunk == b"" and finished:
                return
            else:
                time.sleep(0.001)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        result = write()
    finally:
        done.set()
        reader.join()
        os.close(fd)
    return result, b"".join(got)


@pytest.mark.parametrize("kind", list(WRITTEN))
@pytest.mark.parametrize("writer", list(WRITERS))
def test_every_writer_writes_through_links_and_into_pipes_and_devices(writer, kind, tmp_path, trace_file, capsys,
                                                                       tmp_path_factory):
    expected = _expected(writer, trace_file, capsys, tmp_path_factory)
    path = WRITTEN[kind](tmp_path)
    links = {p: os.readlink(p) for p in tmp_path.rglob("*") if p.is_symlink()}
    final = pathlib.Path(os.path.realpath(path))
    node = os.stat(path) if os.path.exists(path) else None
    if node is not None and stat.S_ISFIFO(node.st_mode):
        refused, got = _through_pipe(path, lambda: WRITERS[writer](path, trace_file, capsys))
        assert refused is None and got == expected
    else:
        assert WRITERS[writer](path, trace_file, capsys) is None
        if node is None or stat.S_ISREG(node.st_mode):
            assert final.read_bytes() == expected
    # Every link is still the link it was, and a pipe or device is still the node it was.
    assert {p: os.readlink(p) for p in tmp_path.rglob("*") if p.is_symlink()} == links
    if node is not None and not stat.S_ISREG(node.st_mode):
        after = os.stat(path)
        assert (after.st_ino, after.st_mode, after.st_rdev) == (node.st_ino, node.st_mode, node.st_rdev)
    if node is not None and stat.S_ISREG(node.st_mode):
        assert stat.S_IMODE(os.stat(final).st_mode) == stat.S_IMODE(node.st_mode)
        assert os.stat(final).st_ino != node.st_ino  # replaced (atomically), not rewritten in place
    # No temporary file is left beside the target.
    assert not [p for p in tmp_path.rglob(".*.tmp")]


@pytest.mark.parametrize("kind", list(REFUSED))
@pytest.mark.parametrize("writer", list(WRITERS))
def test_every_writer_refuses_what_is_not_a_file_before_writing(writer, kind, tmp_path, trace_file, capsys):
    build, what = REFUSED[kind]
    path = build(tmp_path)
    before = _state(tmp_path)
    error = WRITERS[writer](path, trace_file, capsys)
    assert error is not None and str(path) in error and what in error
    assert _state(tmp_path) == before


@pytest.mark.parametrize("kind", list(REFUSED))
def test_the_check_alone_refuses_the_same(kind, tmp_path):
    build, what = REFUSED[kind]
    path = build(tmp_path)
    with pytest.raises(InvalidArgumentError, match=what):
        check_writable(path)


@pytest.mark.parametrize("writer", list(WRITERS))
def test_every_writer_refuses_a_read_only_named_pipe(writer, tmp_path, trace_file, capsys):
    # A read end is held open (_through_pipe), so that a writer which wrongly opened the pipe fails the test
    # rather than waiting for a reader.
    _fifo(tmp_path)
    os.chmod(tmp_path / "fifo", 0o444)
    error, got = _through_pipe(tmp_path / "fifo", lambda: WRITERS[writer](tmp_path / "fifo", trace_file, capsys))
    assert got == b"" and error is not None and "it is read-only, mode 0444: no one may write it" in error


def _access_denied_to(monkeypatch, denied):
    """``os.access`` says no for ``denied`` (as for a user without the permission: root's says yes to all)."""
    real = os.access

    def access(path, mode, *args, **kwargs):
        if os.fspath(path) == str(denied) and mode & os.W_OK:
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


def test_a_file_this_process_may_not_write_is_refused_though_others_may(tmp_path, monkeypatch):
    # Another user's 0644 file, as that user's neighbour sees it: some may write it, this process may not.
    path = tmp_path / "theirs.json"
    path.write_text("theirs")
    os.chmod(path, 0o644)
    _access_denied_to(monkeypatch, path)
    for write in (REPORT.save, REPORT.export_html, check_writable):
        with pytest.raises(InvalidArgumentError) as info:
            write(path)
        assert str(info.value) == (f"cannot save to {path}: it is read-only, mode 0644: you may not write it; "
                                   f"memprof replaces only what a plain write could overwrite: make it writable (chmod "
                                   f"u+w {path}) or give another name")
    assert path.read_text() == "theirs" and os.listdir(tmp_path) == ["theirs.json"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write any file")
def test_a_file_only_the_group_may_write_is_refused_to_its_owner(tmp_path):
    # Mode 0464: the owner may read only, so a plain write by its owner fails; the rename would not.
    path = tmp_path / "run.json"
    path.write_text("kept")
    os.chmod(path, 0o464)
    with pytest.raises(InvalidArgumentError, match="read-only, mode 0464: you may not write it"):
        REPORT.save(path)
    assert path.read_text() == "kept"


def test_a_folder_the_temporary_file_cannot_be_made_in_is_refused_before_writing(tmp_path, monkeypatch):
    folder = tmp_path / "kept"
    folder.mkdir()
    (folder / "old.json").write_text("old")
    _access_denied_to(monkeypatch, folder)
    with pytest.raises(InvalidArgumentError, match=f"cannot save to {folder / 'new.json'}: the folder {folder} is "
                                                   "not writable; save it in a folder you can write"):
        check_writable(folder / "new.json")
    with pytest.raises(InvalidArgumentError, match="renames it over it .* and that folder is not writable"):
        REPORT.save(folder / "old.json")
    assert os.listdir(folder) == ["old.json"] and (folder / "old.json").read_text() == "old"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write in any folder")
def test_a_read_only_folder_is_refused_before_writing(tmp_path):
    folder = tmp_path / "kept"
    folder.mkdir()
    os.chmod(folder, 0o555)
    try:
        with pytest.raises(InvalidArgumentError, match="is not writable"):
            REPORT.save(folder / "new.json")
    finally:
        os.chmod(folder, 0o755)
    assert os.listdir(folder) == []


def test_a_writable_file_is_replaced_and_keeps_its_mode(tmp_path):
    for mode in (0o600, 0o640, 0o200, 0o664):  # 0200: write-only to its owner, which a plain write could
        path = tmp_path / f"run{mode:o}.json"
        path.write_text("old")
        os.chmod(path, mode)
        REPORT.save(path)
        assert stat.S_IMODE(os.stat(path).st_mode) == mode
        os.chmod(path, 0o600)
        assert memprof.load(path).trace == REPORT.trace


def test_dev_null_is_written_into_and_never_replaced(tmp_path):
    before = os.stat(os.devnull)
    link = tmp_path / "discard"
    os.symlink(os.devnull, link)
    REPORT.save(link)
    # Through the link first: a writer that replaced what it found would have replaced the link here,
    # and /dev/null itself is written only once that has been ruled out.
    assert os.readlink(link) == os.devnull
    REPORT.save(os.devnull)
    REPORT.export_html(os.devnull)
    after = os.stat(os.devnull)
    assert stat.S_ISCHR(after.st_mode)
    assert (after.st_ino, after.st_mode, after.st_rdev) == (before.st_ino, before.st_mode, before.st_rdev)


def test_a_block_device_is_refused_without_opening_it(tmp_path, monkeypatch):
    # The same refusal where os.mknod is not permitted: the writer asks os.stat what stands there, and a
    # block device is refused on that answer alone, never opened.
    target = tmp_path / "disk"
    target.write_text("")
    real_stat = os.stat
    opened = []

    def stat_says_block_device(path, *args, **kwargs):
        st = real_stat(path, *args, **kwargs)
        if os.fspath(path) == str(target):
            return os.stat_result((stat.S_IFBLK | 0o660,) + tuple(st)[1:])
        return st

    monkeypatch.setattr(os, "stat", stat_says_block_device)
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a) or pytest.fail("opened"))
    with pytest.raises(InvalidArgumentError, match=r"disk: it is a block device \(a disk\), not a file"):
        write_text_atomic(target, "x")
    assert opened == []


def test_the_demo_saves_through_a_link_and_refuses_a_socket_before_training(tmp_path, capsys):
    small = ["demo", "--steps", "1", "--batch-size", "1", "--seq-len", "8", "--layers", "1", "--hidden", "8",
             "--heads", "1", "--vocab", "16", "--save"]
    sock = _socket(tmp_path)
    assert main(small + [str(sock)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "it is a socket" in err  # refused before the run began
    os.symlink("kept.json", tmp_path / "link.json")
    assert main(small + [str(tmp_path / "link.json")]) == 0
    assert os.readlink(tmp_path / "link.json") == "kept.json"
    assert memprof.load(tmp_path / "kept.json").num_steps == 1


def test_two_outputs_that_are_one_file_through_a_link_are_refused(tmp_path, trace_file, capsys):
    os.symlink("page.html", tmp_path / "alias.html")
    code = main(["export", str(trace_file), "--chrome", str(tmp_path / "alias.html"), "--html",
                 str(tmp_path / "page.html")])
    assert code == 1 and "two outputs name the same file" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["alias.html"]


def test_a_name_at_the_file_systems_limit_is_written(tmp_path):
    # 255 bytes is the most a name may have on Linux file systems; the temporary file beside it, whose
    # name is built from the target's, must still fit.
    name = "r" * 250 + ".json"
    REPORT.save(tmp_path / name)
    assert memprof.load(tmp_path / name).trace == REPORT.trace


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a file to another user needs root")
def test_root_saving_over_a_users_file_leaves_it_the_users(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("old")
    os.chown(path, 12345, 23456)
    os.chmod(path, 0o604)
    REPORT.save(path)
    st = os.stat(path)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (12345, 23456, 0o604)


def test_saving_never_changes_the_process_umask(tmp_path, monkeypatch):
    # os.umask is process-wide: setting it even for a moment changes what another thread's new files get.
    def no_umask(*_):
        raise AssertionError("os.umask called")

    monkeypatch.setattr(os, "umask", no_umask)
    REPORT.save(tmp_path / "new.json")
    monkeypatch.undo()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "new.json").st_mode) == 0o666 & ~umask


# ---------------------------------------------------------------------------- text UTF-8 cannot hold


def test_a_lone_surrogate_is_written_as_a_replacement_character_by_every_text_writer(tmp_path):
    # A module named from undecodable bytes (os.fsdecode gives "\udcff" for the byte 0xff): no UTF-8 file
    # can hold the name, and a JSON escape of it is a string no strict reader takes back.
    import json

    import torch
    from torch import nn

    model = nn.Sequential()
    model.add_module("lin\udcff", nn.Linear(4, 4))
    with memprof.profile(model) as prof:
        model(torch.randn(2, 4)).sum().backward()
    rep = prof.report()
    for name, write in (("save", rep.save), ("chrome", rep.export_chrome_trace), ("html", rep.export_html),
                        ("text", lambda p: write_text_atomic(p, "a \ud800 b"))):
        path = tmp_path / name
        write(path)
        text = path.read_bytes().decode("utf-8")  # strict: valid UTF-8
        # The page shows the name as the text report does, the surrogate escaped; the files hold U+FFFD.
        assert ("lin\\udcff" if name == "html" else "\ufffd") in text
        if name in ("save", "chrome"):
            assert not [s for s in json_strings(json.loads(text)) if any("\ud800" <= c <= "\udfff" for c in s)]
    assert [m.path for m in memprof.load(tmp_path / "save").trace.modules] == ["<model>", "lin\ufffd"]
