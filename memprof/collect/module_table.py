"""The model's modules as a table: one row per module, what the profile learns about it, and where
memprof cannot see inside (compiled code).

The module hooks (:mod:`.modules`) fill it; the saved-tensor accounting (:mod:`.saved`) reads which
module saved what; the record (:mod:`.freeze`) turns it into the per-module rows.
"""

from __future__ import annotations

import weakref
from typing import Iterator

import torch
from torch import nn

from ..record.trace import parent_path
from .ledger import TAGS

__all__ = ["ModuleInfo", "ModuleTable", "class_names", "is_compile_wrapper", "unique_params", "attribute_tensors",
           "tensors_in_args"]

_TAG = {name: i for i, name in enumerate(TAGS)}


class ModuleInfo:
    """What the profile learns about one module: its calls, saved bytes and peaks."""

    __slots__ = ("path", "type", "calls", "act_step", "act_bytes", "fwd_peak", "bwd_peak", "fwd_tmp", "bwd_tmp")

    def __init__(self, path: str, type_name: str) -> None:
        self.path = path
        self.type = type_name
        self.calls = 0
        self.act_step = -1
        self.act_bytes = 0
        self.fwd_peak: "int | None" = None
        self.bwd_peak: "int | None" = None
        self.fwd_tmp: "int | None" = None
        self.bwd_tmp: "int | None" = None


class ModuleTable:
    """The model's modules, by row, and the compiled code among them."""

    def __init__(self, model: nn.Module) -> None:
        self.root_ref = weakref.ref(model)
        self.info: list[ModuleInfo] = []
        self.refs: list[weakref.ref[nn.Module]] = []
        self.index: dict[int, int] = {}  # id(module) -> its row in the tables
        self.params: list[list[weakref.ref[nn.Parameter]]] = []  # each module's parameters (its own and its children's)
        # The tag a storage saved while this module is innermost gets when no op rule named it.
        self.saved_tag: list[int] = []
        self.brackets: set[int] = set()  # modules whose calls run compiled code memprof cannot see into
        self.compiled_paths: list[str] = []
        self.unhooked: set[int] = set()  # modules inside compiled code: no hooks, no per-module figures
        self.parents: set[int] = set()  # modules with hooked children
        self.skipped_paths: list[str] = []  # modules whose calls ran none of their children's hooks
        self.compiled_calls = 0
        self.compiled_depth = 0  # compiled calls in progress
        self.unseen_saves: list[int] = []  # unknown storages saved as inputs in the current outermost call

    def path(self, index: int) -> str:
        """The module's path as the report prints it (the root is ``<model>``)."""
        return self.info[index].path or "<model>"

    def add(self, model: nn.Module) -> list[tuple[int, nn.Module, bool]]:
        """Rows for the modules of ``model`` not in the table yet (all of them at the start): each new row,
        its module, and whether it gets hooks (not inside compiled code, where they would run in the graph)."""
        from ..anatomy.activations import saved_bytes_rule

        inside: list[str] = []  # path prefixes of compiled code
        rows: dict[str, int] = {}
        new: list[tuple[int, nn.Module, bool]] = []
        mod: nn.Module  # torch's named_modules() is untyped
        for path, mod in model.named_modules():
            compiled_here = any(path == p or path.startswith(p + ".") for p in inside)
            known = self.index.get(id(mod))
            alive = self.refs[known]() if known is not None else None
            if known is not None and alive is mod:
                rows[path] = known
                if not compiled_here and getattr(mod, "_compiled_call_impl", None) is not None:
                    inside.append(path)
                elif not compiled_here and is_compile_wrapper(mod):
                    inside.append(f"{path}._orig_mod" if path else "_orig_mod")
                continue
            index = len(self.info)
            rows[path] = index
            self.info.append(ModuleInfo(path or "", type(mod).__name__))
            self.refs.append(weakref.ref(mod))
            self.index[id(mod)] = index
            self.params.append([weakref.ref(p) for p in unique_params(mod)])
            if any(True for _ in mod.children()):
                self.saved_tag.append(_TAG["saved_in_container_code"])
            elif saved_bytes_rule(mod) is None:
                self.saved_tag.append(_TAG["saved_in_module_without_rule"])
            else:
                self.saved_tag.append(-1)
            if compiled_here:
                self.unhooked.add(index)
                new.append((index, mod, False))
                continue
            if getattr(mod, "_compiled_call_impl", None) is not None:
                # Compiled in place: its own hooks would run inside the compiled code.
                self.unhooked.add(index)
                inside.append(path)
                parent = parent_path(path)
                if parent in rows:
                    self.brackets.add(rows[parent])
                self.compiled_paths.append(path or "<model>")
                new.append((index, mod, False))
                continue
            if is_compile_wrapper(mod):
                inside.append(f"{path}._orig_mod" if path else "_orig_mod")
                self.brackets.add(index)
                self.compiled_paths.append(path or "<model>")
            if path and parent_path(path) in rows:
                self.parents.add(rows[parent_path(path)])
            new.append((index, mod, True))
        return new

    def saved_in(self, index: int, nbytes: int, step: int) -> None:
        """``nbytes`` were saved while module ``index`` ran its forward in ``step``."""
        info = self.info[index]
        if info.act_step != step:
            info.act_step = step
            info.act_bytes = 0
        info.act_bytes += nbytes

    def skipped(self, index: int) -> None:
        """A call of module ``index`` ran none of its hooked children's hooks: from now on it brackets code
        memprof does not see into."""
        if index not in self.brackets:
            self.brackets.add(index)
            self.skipped_paths.append(self.path(index))

    def is_ancestor(self, parent: int, child: int) -> bool:
        p = self.info[parent].path
        c = self.info[child].path
        return p == "" or c.startswith(p + ".")


# ---------------------------------------------------------------------- helpers


def class_names(cls: type, base: type = nn.Module) -> tuple[str, ...]:
    """``module.QualName`` of a class and its bases, most specific first, up to ``base`` (excluded); then
    the transformers layers it is a copy of (:func:`memprof.anatomy.hf_rules.computes_like`), so that
    the formula finds their rule."""
    names = tuple(f"{k.__module__}.{k.__qualname__}" for k in cls.__mro__
                  if isinstance(k, type) and issubclass(k, base) and k is not base)
    if cls.__module__.startswith("transformers."):
        from ..anatomy.hf_rules import computes_like

        names += tuple(n for n in computes_like(cls) if n not in names)
    return names


def is_compile_wrapper(mod: nn.Module) -> bool:
    """The module torch.compile(model) returns (torch._dynamo.eval_frame.OptimizedModule)."""
    return type(mod).__name__ == "OptimizedModule" and isinstance(getattr(mod, "_orig_mod", None), nn.Module)


def unique_params(model: nn.Module) -> Iterator[nn.Parameter]:
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def attribute_tensors(mod: nn.Module) -> list[torch.Tensor]:
    """Tensors a module keeps as plain attributes, not registered as parameters or buffers."""
    return [v for v in vars(mod).values() if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)]


def tensors_in_args(args: object, kwargs: object) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _collect_tensors(args, out, 0)
    if kwargs:
        _collect_tensors(kwargs, out, 0)
    return out


def _collect_tensors(obj: object, out: list[torch.Tensor], depth: int) -> None:
    # A module-level function, not a nested closure: a recursive closure is a
    # reference cycle that would keep the user's tensors alive until gc runs.
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for x in obj:
            _collect_tensors(x, out, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for x in obj.values():
            _collect_tensors(x, out, depth + 1)
