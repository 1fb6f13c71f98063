"""The code's shape, held: small modules and classes, no import cycle at run time, imports one way
(collectors upstream of the record, analyses and renderers downstream of it), no torch on import."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "memprof"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _runtime_imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """memprof modules ``name`` imports when it runs: at top level or inside functions, but not under
    ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def test_no_module_over_700_lines_and_no_class_over_400():
    too_long = []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > 700:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                too_long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def test_no_import_cycle_at_run_time():
    modules = _modules()
    graph = {name: _runtime_imports(name, path, set(modules)) for name, path in modules.items()}
    cycles = []

    def visit(node, trail):
        for nxt in graph[node]:
            if nxt in trail:
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, trail + [nxt])
        done.add(node)

    done: set[str] = set()
    for start in graph:
        if start not in done:
            visit(start, [start])
    # The package __init__ re-exports names; a submodule importing a sibling through it is not a cycle
    # of code, so only cycles between submodules count.
    cycles = [c for c in cycles if "memprof" not in c]
    assert cycles == []


def test_analyses_and_renderers_never_reach_back_into_the_collectors():
    modules = _modules()
    downstream = [n for n in modules if n.startswith(("memprof.anatomy", "memprof.analyse.reconciler", "memprof.render"))
                  or n in ("memprof.record.trace", "memprof.report", "memprof.analyse.compare", "memprof.analyse.budget")]
    reaching = {n: sorted(t for t in _runtime_imports(n, modules[n], set(modules))
                          if t.startswith("memprof.collect") or t == "memprof.collect.profiler") for n in downstream}
    assert {n: t for n, t in reaching.items() if t} == {}


def test_importing_memprof_imports_no_torch():
    code = "import sys, memprof, memprof.record.trace, memprof.report; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "False"
