"""The code's shape, held: small modules and classes, a tree whose top level tells the data flow,
imports that run one way (every import counted: at top level, inside functions, under TYPE_CHECKING),
no import circle, and no torch on import."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "memprof"

# The floors, bottom to top: a module may import modules of its own floor or of a floor below, never
# one above. (docs/architecture.md draws the same order.)
FLOORS: tuple[tuple[str, ...], ...] = (
    ("memprof.vocabulary", "memprof.units", "memprof.errors", "memprof.swallowed", "memprof.version"),
    ("memprof.record",),
    ("memprof.anatomy",),
    ("memprof.collect",),
    ("memprof.simulate",),
    ("memprof.analyse",),
    ("memprof.render",),
    ("memprof.report",),
    ("memprof.cli", "memprof.pytest_plugin", "memprof.integrations", "memprof.demo", "memprof.__main__", "memprof"),
)


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Every memprof module ``name`` imports, wherever the import statement stands."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from .pkg import name``: the submodule ``pkg.name`` if there is one, else the package itself.
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for t in targets:
            while t not in known and "." in t:
                t = t.rpartition(".")[0]
            if t in known and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _floor(name: str) -> int:
    best = None
    for i, floor in enumerate(FLOORS):
        for prefix in floor:
            if name == prefix or (prefix != "memprof" and name.startswith(prefix + ".")):
                best = i
    assert best is not None, f"{name} belongs to no floor: add it to FLOORS and docs/architecture.md"
    return best


def test_every_module_has_a_floor_and_imports_only_its_floor_or_below():
    upward = sorted(f"{a} ({FLOORS[_floor(a)][0]}) imports {b} ({FLOORS[_floor(b)][0]})"
                    for a, targets in _graph().items() for b in targets if _floor(b) > _floor(a))
    assert upward == []


def test_no_import_circle_counting_every_import():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def test_at_most_twelve_modules_at_the_package_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= 12, top


def test_no_module_over_600_lines_and_no_class_over_300():
    too_long = []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > 600:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                too_long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


# Where the stricter limits below hold (the project's conventions: no class over 250 lines, no function
# over 80): the whole package.
SIZE_LIMITED: tuple[str, ...] = ("memprof",)
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 80


def _over_the_limits(name: str, text: str) -> list[str]:
    """The classes over MAX_CLASS_LINES and the functions over MAX_FUNCTION_LINES of one module's source, each
    counted from its ``def``/``class`` line to its last line (a nested function counts in its own right, and
    in the lines of the function or class around it)."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            limit, kind = MAX_CLASS_LINES, "class"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit, kind = MAX_FUNCTION_LINES, "function"
        else:
            continue
        lines = node.end_lineno - node.lineno + 1
        if lines > limit:
            out.append(f"{kind} {name}.{node.name} (line {node.lineno}): {lines} lines")
    return out


def test_no_class_over_250_lines_and_no_function_over_80_where_the_limits_hold():
    checked = {name: path for name, path in _modules().items()
               if any(name == p or name.startswith(p + ".") for p in SIZE_LIMITED)}
    assert checked, SIZE_LIMITED  # the prefixes name modules: a typo would check nothing
    too_long = [entry for name, path in sorted(checked.items()) for entry in _over_the_limits(name, path.read_text())]
    assert too_long == []


def test_the_size_check_counts_nested_functions_and_whole_classes():
    # The check itself, on source made to be just over and just at each limit.
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    at_limit = f"def f():\n{body}\n"  # the def line and 79 body lines: 80
    assert _over_the_limits("m", at_limit) == []
    over = f"def f():\n{body}\n    y = 0\n"
    assert _over_the_limits("m", over) == ["function m.f (line 1): 81 lines"]
    nested = "def outer():\n" + "\n".join("    " + line for line in over.splitlines()) + "\n"
    assert _over_the_limits("m", nested) == ["function m.outer (line 1): 82 lines", "function m.f (line 2): 81 lines"]
    methods = "\n".join(f"    def m{i}(self):\n        pass" for i in range(MAX_CLASS_LINES // 2))
    big = f"class C:\n{methods}\n"  # 1 + 2 * 125 = 251 lines
    assert _over_the_limits("m", big) == ["class m.C (line 1): 251 lines"]


MAX_PUBLIC_PARAMETERS = 12


def _parameters(node: "ast.FunctionDef | ast.AsyncFunctionDef") -> int:
    """A function's parameters as its callers see them: every named one, ``*args`` and ``**kwargs`` one each,
    ``self``/``cls`` not counted."""
    a = node.args
    named = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    if named and named[0].arg in ("self", "cls"):
        named = named[1:]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def test_no_public_function_takes_more_than_twelve_parameters():
    # Options that travel together are one record (RunConfig's sections, Wiring, Trained), or typed keyword
    # arguments written once (EstimateOptions), not a dozen keywords repeated from function to function.
    over = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                if _parameters(node) > MAX_PUBLIC_PARAMETERS:
                    over.append(f"{name}.{node.name}: {_parameters(node)} parameters")
    assert over == []


def test_the_parameter_count_is_what_callers_pass():
    (fn,) = ast.parse("def f(self, a, /, b, *c, d=1, **e): pass").body
    assert _parameters(fn) == 5  # a, b, *c, d, **e; self is not passed
    (wide,) = ast.parse("def g(" + ", ".join(f"p{i}" for i in range(13)) + "): pass").body
    assert _parameters(wide) == 13 > MAX_PUBLIC_PARAMETERS


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_package_imports_another_packages_private_names():
    # A leading underscore says "this package's own": another package that needs it needs a public seam.
    known = set(_modules())
    reached = []
    for name, path in _modules().items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith("memprof"):
                continue
            for alias in node.names:
                target = f"{module}.{alias.name}"
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                private_module = any(p.startswith("_") and not p.startswith("__") for p in module.split("."))
                if (private or private_module) and _package(module) != _package(name) and target not in known:
                    reached.append(f"{name} imports {target}")
    assert reached == []


def test_importing_memprof_imports_no_torch():
    code = "import sys, memprof, memprof.record.trace, memprof.report; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent, timeout=300)
    assert out.stdout.strip() == "False"
