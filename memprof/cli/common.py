"""What the commands of ``memprof`` share: loading ``MODULE:FUNCTION``, reading a mesh, refusing an output or a
device before anything runs."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Callable

from ..errors import MemprofError, is_interrupt

if TYPE_CHECKING:
    import torch

__all__ = ["load_factory", "mesh", "writable", "device", "not_the_input"]


def not_the_input(path: str, source: str) -> None:
    if os.path.abspath(path) == os.path.abspath(source) or (
            os.path.exists(path) and os.path.exists(source) and os.path.samefile(path, source)):
        raise MemprofError(f"{path} is the trace being read; write the output to another file")


def load_factory(spec: str) -> Callable[..., object]:
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise MemprofError(f"expected MODULE:FACTORY (for example mypkg.models:build), got {spec!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if is_interrupt(exc):
            raise
        raise MemprofError(f"cannot import module {module_name!r}: {exc}") from None
    finally:
        sys.path.pop(0)
    factory: object = getattr(module, attr, None)
    if not callable(factory):
        raise MemprofError(f"{module_name} has no callable {attr!r}")
    return factory


def mesh(spec: str) -> "dict[str, int]":
    """``--mesh pp=2,dp=64,tp=8``: the mesh's dimensions by name, in order."""
    out: dict[str, int] = {}
    for part in spec.split(","):
        name, sep, size = part.strip().partition("=")
        if not sep or not name or not size.strip().isdigit():
            raise MemprofError(f"expected --mesh NAME=SIZE,NAME=SIZE (for example pp=2,dp=64,tp=8), got {spec!r}")
        out[name.strip()] = int(size)
    return out


def writable(path: str) -> None:
    """Refuse, before anything runs or is written, an output memprof's writer would refuse."""
    from ..record.files import check_writable

    check_writable(path)


def device(spec: str) -> "torch.device":
    import torch

    try:
        return torch.device(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        if is_interrupt(exc):
            raise
        raise MemprofError(f"unknown device {spec!r}; use cpu, cuda, cuda:1, mps ...") from None
