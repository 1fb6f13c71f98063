"""Sphinx configuration of memprof's API reference, generated from the package's docstrings.

Build it from the repository root with warnings as errors, as CI does (``.ci/run``)::

    pip install -e ".[dev]"
    sphinx-build -E -W -n -q -b html docs/api build/api
"""

from __future__ import annotations

import os
import sys

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


# A docstring may name an implementation that the reference does not document (a module of collect/ or simulate/,
# a private helper) for readers of the source. Such a reference is let through only where the name exists in the
# package, looked up as Python would from the docstring's module and class; a name that does not exist (a typo, a
# renamed function) still fails the build.
def _member(obj: object, name: str) -> object:
    """``getattr(obj, name)``, also for a dataclass field or an annotated attribute without a class-level value."""
    try:
        return getattr(obj, name)
    except AttributeError:
        if isinstance(obj, type) and any(name in getattr(c, "__annotations__", {}) for c in obj.__mro__):
            return None
        raise


def _exists(dotted: str) -> bool:
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
            return False
        return True
    return False


def _memprof_name(app: object, domain: object, node: dict) -> bool | None:
    if getattr(domain, "name", None) != "py":
        return None
    target = node.get("reftarget", "")
    module, cls = node.get("py:module") or "", node.get("py:class") or ""
    candidates = [target]
    # Where autodoc put the docstring ("...:docstring of memprof.analyse.budget.check_budget"): the names its own
    # module and class see, also when the object is documented under its top-level spelling (memprof.check_budget).
    source = str(node.get("source") or getattr(node, "source", None) or "")
    if "docstring of " in source:
        scope = source.rpartition("docstring of ")[2].split(".")
        candidates += [".".join(scope[:cut] + [target]) for cut in range(len(scope), 0, -1)]
    if module and cls and _exists(f"{module}.{cls}"):
        # A class documented under another spelling (memprof.Trace): the modules its class and bases are written in.
        import importlib

        documented = importlib.import_module(module)
        for part in cls.split("."):
            documented = getattr(documented, part)
        for c in getattr(documented, "__mro__", ()):
            # its module's names, and a sibling module written relatively (:mod:`.mixed_layers`)
            candidates += [f"{c.__module__}.{target}", f"{c.__module__.rpartition('.')[0]}.{target}"]
    if module:
        candidates.append(f"{module}.{target}")
        if cls:
            candidates.append(f"{module}.{cls}.{target}")
        package = module.rpartition(".")[0]
        if package:  # a sibling module written relatively (:mod:`.params` in a package's docstring)
            candidates.append(f"{package}.{target}")
    if any(c.startswith("memprof") and _exists(c) for c in candidates):
        return True  # exists: let it through unlinked
    if not source and target.split(".")[0].isidentifier():
        # A signature's annotation (autodoc_typehints = "description"), written in the module that defines the
        # object, which may not be the one it is documented under: let through a name some module of the package
        # defines, and no other.
        import sys

        modules = [m for n, m in list(sys.modules.items()) if n.startswith("memprof") and m is not None]
        if any(_exists(f"{m.__name__}.{target}") for m in modules):
            return True
    return None


def setup(app: object) -> None:
    app.connect("warn-missing-reference", _memprof_name)  # type: ignore[attr-defined]
