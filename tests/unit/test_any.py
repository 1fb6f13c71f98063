"""``Any`` only where a value truly is of any type, each time with its reason: the package's code names ``Any`` only
in the definition of a module-level alias (``UserObject = Any``, ``ParamGroup = dict[str, Any]``) that a ``#:``
comment right above explains, and in the ``typing`` import that brings it; every other annotation uses those
aliases, or a real type. String annotations are read as code too."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "memprof"


def _names_any(node: ast.AST) -> bool:
    """Does ``node`` name ``Any`` (``Any``, ``typing.Any``), in code or in a string annotation inside it?"""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "Any":
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == "Any":
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and "Any" in sub.value:
            try:
                inner = ast.parse(sub.value, mode="eval")
            except SyntaxError:
                continue  # a string that is no annotation (a message, a docstring)
            if _names_any(inner):
                return True
    return False


def _explained(lines: list[str], node: ast.stmt) -> bool:
    """Is the statement at ``node`` a module-level alias with a ``#:`` comment right above it?"""
    above = node.lineno - 2
    return above >= 0 and lines[above].lstrip().startswith("#:")


def _unexplained_any(source: str) -> list[int]:
    """The lines of ``source`` that name ``Any`` outside an explained alias and the ``typing`` import."""
    tree = ast.parse(source)
    lines = source.splitlines()
    allowed: set[int] = set()
    for stmt in tree.body:
        aliased = isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
        annotated = isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)  # X: TypeAlias = ...
        if (aliased or annotated) and _explained(lines, stmt):
            allowed.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    bad = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            continue  # `from typing import Any`: the import itself
        if isinstance(node, (ast.Name, ast.Attribute, ast.Constant)) and _names_any(node):
            line = getattr(node, "lineno", 0)
            if line not in allowed:
                bad.add(line)
    return sorted(bad)


def test_any_only_in_aliases_that_say_why():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line in _unexplained_any(path.read_text()):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    assert found == [], "Any outside an explained alias (a `#:` comment above `Name = ...Any...`):\n" + "\n".join(found)


def test_the_check_reads_aliases_annotations_and_strings():
    explained = "from typing import Any\n\n#: a user's object, read by duck typing\nUserObject = Any\n"
    assert _unexplained_any(explained) == []
    assert _unexplained_any("from typing import Any\nUserObject = Any\n") == [2]  # no reason given
    assert _unexplained_any("def f(x: Any) -> None: ...\n") == [1]
    assert _unexplained_any("def f(x: 'dict[str, Any]') -> None: ...\n") == [1]  # a string annotation
    assert _unexplained_any("def f(x: typing.Any) -> None: ...\n") == [1]
    assert _unexplained_any("MESSAGE = 'Any value will do'\n") == []  # a string that is not code
    nested = "class C:\n    #: not module level\n    X = Any\n"
    assert _unexplained_any(nested) == [3]
