"""Sphinx configuration of memprof's API reference, generated from the package's docstrings.

Build it from the repository root with warnings as errors, as CI does (``.ci/run``)::

    pip install -e ".[dev]"
    sphinx-build -E -W -n -q -b html docs/api build/api
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

from sphinx.util.inspect import stringify_signature as stringify
from sphinx.util.nodes import make_refnode

# The package from this checkout, also when it is not installed.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import memprof

project = "memprof"
author = "memprof contributors"
release = memprof.__version__
version = release

extensions = ["sphinx.ext.autodoc"]

# The docstrings document their arguments in prose; the signature's types are listed under it, where they can be
# read whole rather than on one long line.
autodoc_typehints = "description"
autodoc_member_order = "bysource"
# Members as they stand in the source. Base classes are not shown by default: a public result class is the facade's
# subclass of a plain data class, an implementation detail (errors.rst shows the errors' bases, which matter).
autodoc_default_options = {"members": True}

# Every cross-reference must resolve (``-n``); the groups below are the ones that cannot, each for its reason. No
# other project's inventory is fetched (no intersphinx): CI may run offline, and the build must not depend on
# another site being up.
nitpicky = True
nitpick_ignore: list[tuple[str, str]] = []
nitpick_ignore_regex: list[tuple[str, str]] = [
    # The standard library, named by the signatures' annotations (builtins resolve without an inventory).
    (r"py:(class|obj|data|func)", r"(collections\.abc|typing|os|enum|fractions|array|dataclasses|pathlib|io|types"
     r"|contextlib|signal|numbers|json)(\..+)?"),
    # torch: memprof's signatures take models (nn.Module), optimizers, tensors and dtypes.
    (r"py:(class|obj|data|func|meth|attr|mod)", r"(torch|nn|optim)(\..+)?"),
    # pandas (the DataFrames of to_frame()) and transformers (configs, models, caches).
    (r"py:(class|obj|data|func|meth|attr|mod)", r"(pd|pandas|transformers)(\..+)?"),
]

html_theme = "alabaster"
exclude_patterns = ["_build"]


# A docstring may name an object by another spelling than the reference's (memprof.report.reports.Report for
# memprof.Report, check_budget's BudgetResult from its own module), or an implementation the reference does not
# document (a module of collect/ or simulate/, a private helper), for readers of the source. Each such name is
# looked up as Python would, from the docstring's module and class: where it is an object the reference documents,
# the reference links there; where it exists but is not documented, it is let through unlinked; a name that does
# not exist (a typo, a renamed function) still fails the build.
_MISSING = object()


def _member(obj: object, name: str) -> object:
    """``getattr(obj, name)``, also for a dataclass field or an annotated attribute without a class-level value."""
    try:
        return getattr(obj, name)
    except AttributeError:
        if isinstance(obj, type) and any(name in getattr(c, "__annotations__", {}) for c in obj.__mro__):
            return None
        raise


def _lookup(dotted: str) -> object:
    """The object ``dotted`` names (the longest importable module, then attributes), or _MISSING."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = _member(obj, name)
        except AttributeError:
            return _MISSING
        return obj
    return _MISSING


def _candidates(node: Any, guess: bool = True) -> list[str]:
    """The dotted names a reference may mean, in the order Python's scoping would find them; ``guess``: also, for
    a signature's annotation, the same name in every module of the package."""
    target = node.get("reftarget", "")
    module, cls = node.get("py:module") or "", node.get("py:class") or ""
    candidates = [target]
    # Where autodoc put the docstring ("...:docstring of memprof.analyse.budget.check_budget"): the names its own
    # module and class see, also when the object is documented under its top-level spelling (memprof.check_budget).
    source = str(node.get("source") or getattr(node, "source", None) or "")
    if "docstring of " in source:
        scope = source.rpartition("docstring of ")[2].split(".")
        candidates += [".".join(scope[:cut] + [target]) for cut in range(len(scope), 0, -1)]
    documented = _lookup(f"{module}.{cls}") if module and cls else _MISSING
    for c in getattr(documented, "__mro__", ()):
        # A class documented under another spelling (memprof.Trace): the names of the modules its class and bases
        # are written in, and a sibling module written relatively (:mod:`.mixed_layers`).
        candidates += [f"{c.__module__}.{target}", f"{c.__module__.rpartition('.')[0]}.{target}"]
    if module:
        candidates.append(f"{module}.{target}")
        if cls:
            candidates.append(f"{module}.{cls}.{target}")
        package = module.rpartition(".")[0]
        if package:  # a sibling module written relatively (:mod:`.params` in a package's docstring)
            candidates.append(f"{package}.{target}")
    if guess and not source and target.split(".")[0].isidentifier():
        # A signature's annotation (autodoc_typehints = "description"), written in the module that defines the
        # object, which may not be the one it is documented under: the names the package's modules define.
        import sys

        candidates += [f"{n}.{target}" for n, m in sorted(sys.modules.items()) if n.startswith("memprof") and m]
    return [c for c in candidates if c.startswith("memprof")]


def _documented(env: Any) -> dict[int, str]:
    """The classes, functions and modules the reference documents, by identity: their documented names."""
    py = env.get_domain("py")
    index: dict[int, str] = {}
    for name, entry in py.objects.items():
        if entry.objtype in ("class", "exception", "function", "method", "module") and not entry.aliased:
            obj = _lookup(name)
            if obj is not _MISSING and (callable(obj) or isinstance(obj, types.ModuleType)):
                index.setdefault(id(obj), name)
    return index


def _link_by_identity(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    if node.get("refdomain") != "py":
        return None
    if not hasattr(env, "_memprof_documented"):
        env._memprof_documented = _documented(env)
    found = [obj for obj in map(_lookup, _candidates(node, guess=False)) if obj is not _MISSING][:1]
    if not found:  # an annotation: linked only where every module's object of that name is the same documented one
        found = [obj for obj in map(_lookup, _candidates(node)) if obj is not _MISSING]
    names = {env._memprof_documented.get(id(obj)) for obj in found}
    if len(names) != 1 or None in names:
        return None
    (name,) = names
    entry = env.get_domain("py").objects[name]
    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, name)


def _let_through_what_exists(app: Any, domain: Any, node: Any) -> "bool | None":
    if getattr(domain, "name", None) == "py" and any(_lookup(c) is not _MISSING for c in _candidates(node)):
        return True  # exists, undocumented: shown unlinked
    return None


def _public_signature(app: Any, what: str, name: str, obj: Any, options: Any, signature: "str | None",
                      return_annotation: "str | None") -> "tuple[str, str | None] | None":
    """The signature without its private keywords (``Profiler(..., _allow_meta=False)``: the simulation's seam,
    not the user's): a parameter whose name starts with ``_`` is not part of the API."""
    import inspect

    if not signature or "_" not in signature:
        return None
    try:
        sig = inspect.signature(obj.__init__ if what in ("class", "exception") else obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if not any(p.name.startswith("_") for p in params):
        return None
    if what in ("class", "exception") and params and params[0].name == "self":
        params = params[1:]
    shown = sig.replace(parameters=[p for p in params if not p.name.startswith("_")],
                        return_annotation=inspect.Signature.empty)
    # autodoc's typehints recorded them already (its handler runs first): drop them from the description too.
    recorded = app.env.temp_data.get("annotations", {}).get(name, {})
    for private in [key for key in recorded if key.startswith("_")]:
        del recorded[private]
    return stringify(shown, show_annotation=False), return_annotation


def setup(app: Any) -> None:
    app.connect("autodoc-process-signature", _public_signature)
    app.connect("missing-reference", _link_by_identity)
    app.connect("warn-missing-reference", _let_through_what_exists)
