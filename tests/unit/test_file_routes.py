"""One reader and one writer: every file memprof reads or writes goes through memprof/record/files.py
(read_bytes, write_bytes_atomic and their text and JSON forms), which hold the checks a file needs: a
regular file of bounded size read without waiting, an atomic write that refuses what a plain write could
not overwrite (issue 36 items 11, 12). A call that opens, reads, writes or renames a file anywhere else
is one of its own, without them: this walks the package's source for any."""

from __future__ import annotations

import ast
import pathlib

import memprof

# What memprof calls to touch a file. Any such call outside memprof/record/files.py is a reader or a writer
# of its own, with none of the checks above (or of the atomic writer's).
_FILE_CALLS = {"open", "read_text", "write_text", "read_bytes", "write_bytes", "fdopen", "mkstemp",
               "NamedTemporaryFile", "replace", "rename", "load", "dump"}
_FILE_MODULES = {"os", "io", "json", "pickle", "torch", "tempfile", "shutil", "builtins"}
# Allowed: the command line's own stdout swapped for /dev/null after a closed pipe (a descriptor, not a file).
_ALLOWED = {(module, "os.open(os.devnull, os.O_WRONLY)") for module in ("memprof/cli.py", "memprof/cli/__init__.py")}


def test_every_file_memprof_reads_or_writes_goes_through_record_files():
    root = pathlib.Path(memprof.__file__).parent
    found = []
    for source in sorted(root.rglob("*.py")):
        rel = source.relative_to(root.parent).as_posix()
        if rel == "memprof/record/files.py":
            continue
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            if isinstance(fn, ast.Name) and fn.id == "open":
                call = ast.unparse(node)
            elif isinstance(fn, ast.Attribute) and fn.attr in _FILE_CALLS and (
                    fn.attr in ("read_text", "write_text", "read_bytes", "write_bytes")
                    or ast.unparse(fn.value) in _FILE_MODULES):
                call = ast.unparse(node)
            else:
                continue
            if (rel, call) not in _ALLOWED:
                found.append(f"{rel}:{node.lineno}: {call}")
    assert found == []
