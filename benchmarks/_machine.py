"""What machine a benchmark ran on, and writing its results (shared by the benchmark scripts)."""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command_line(script: str, argv: "list[str] | None") -> str:
    """The command that ran ``script`` (its ``__file__``), as a user would type it from the repository root."""
    return " ".join(["python", os.path.relpath(script)] + (sys.argv[1:] if argv is None else argv))


def write_results(json_path: "str | None", data: Any, markdown_path: "str | None", markdown: str,
                  indent: int = 2) -> None:
    """Write ``data`` as JSON and ``markdown`` as text to the paths given (either may be None)."""
    for path in (json_path, markdown_path):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(data, f, indent=indent)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(markdown)


def import_memprof() -> Any:
    """memprof as installed, else from the repository these scripts sit in."""
    try:
        import memprof
    except ImportError:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        import memprof
    return memprof
