"""The prose docs and the package agree: every ``memprof.dotted.name`` the docs write in backticks exists, every
keyword a doc shows in ``name(arg=...)`` form for one of memprof's functions is one its signature takes, and the
statements the docs make about the code's own counts and tests still hold.

The pages are README.md and docs/**/*.md, but docs/changelog.md, which records names as they were when each entry
was written (its tables pair the old name with the new one). Python code blocks are skipped here: they are user
code and they run (tests/integration/test_docs.py), so a wrong name fails there; every other fenced block (shell
lines, output, configuration) is read like the prose.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pathlib
import re
import typing
from typing import Any

import pytest

import memprof

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "changelog.md")

PYTHON_BLOCK = re.compile(r"^```python\n.*?^```", re.S | re.M)
SPAN = re.compile(r"``(.+?)``|`([^`\n]+)`")
# memprof.x.y, not a file (run.memprof.json), a path (memprof/collect), part of another name (torch_memprof) or a
# quoted string value (a trace file's 'format': 'memprof.trace' in an error message).
DOTTED = re.compile(r"(?<![\w./'\"-])memprof(?:\.[A-Za-z_]\w*)+")
# name(args) where args may hold one level of parentheses: estimate(model, inputs=torch.randn(8, 16), gpu="h100").
CALL = re.compile(r"(?<![\w.])((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\(([^()]*(?:\([^()]*\)[^()]*)*)\)")

# The names the docs give results in prose (``report.reconcile(at=...)``), and the class each stands for.
RECEIVERS = {
    "report": "memprof.Report",
    "rec": "memprof.Reconciliation",
    "d": "memprof.Diff",
    "est": "memprof.Estimate",
    "prof": "memprof.Profiler",
    "memprof.anatomy": "memprof.anatomy",
}


def _spans(page: pathlib.Path) -> list[str]:
    """The inline code spans of a page, outside python blocks, and every line of its other fenced blocks."""
    text = PYTHON_BLOCK.sub("", page.read_text())
    spans = []
    for fenced in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        spans += fenced.splitlines()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    spans += [m.group(1) or m.group(2) for m in SPAN.finditer(prose)]
    return spans


def _member(obj: Any, name: str) -> Any:
    """``getattr(obj, name)``; a dataclass field or an annotated attribute without a class-level value counts."""
    try:
        return getattr(obj, name)
    except AttributeError:
        if isinstance(obj, type) and any(name in getattr(c, "__annotations__", {}) for c in obj.__mro__):
            return None
        raise


def resolve(dotted: str) -> Any:
    """The object ``dotted`` names: the longest importable module, then attributes. AttributeError if none."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and not ".".join(parts[:cut]).startswith(exc.name):
                raise  # the module exists and failed to import something else: not a wrong name
            continue
        for name in parts[cut:]:
            obj = _member(obj, name)
        return obj
    raise AttributeError(dotted)


def _dotted_names(page: pathlib.Path) -> list[str]:
    return sorted({name for span in _spans(page) for name in DOTTED.findall(span)})


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_dotted_memprof_name_in_the_docs_exists(page):
    missing = []
    for name in _dotted_names(page):
        try:
            resolve(name)
        except AttributeError:
            missing.append(name)
    assert not missing, f"{page.relative_to(ROOT)} names what memprof does not have: {missing}"


def _keywords(args: str) -> list[str]:
    """The keyword names of a call's argument text (``model, inputs=x, gpu="h100"`` -> inputs, gpu), read at
    the top level only; ``...`` and ``**options`` say nothing."""
    depth, top, current = 0, [], ""
    for ch in args:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            top.append(current)
            current = ""
        else:
            current += ch
    top.append(current)
    return [m.group(1) for part in top if (m := re.match(r"\s*([A-Za-z_]\w*)\s*=(?!=)", part))]


def _callee(name: str) -> Any:
    """The memprof function or method ``name`` stands for in the docs, or None where it is not memprof's (or
    the receiver is a variable whose class the docs do not fix). AttributeError where it should be memprof's
    and is not there."""
    head, _, last = name.rpartition(".")
    if not head:
        for space in (memprof, memprof.anatomy):
            if name in getattr(space, "__all__", ()):
                return getattr(space, name)
        return None
    if head in RECEIVERS:
        return _member(resolve(RECEIVERS[head]), last)
    if head.startswith("memprof"):
        return resolve(name)
    return None


def _forwarded() -> "dict[Any, set[str]]":
    """The ``**`` keywords of functions that hand them on, as their docstrings say: check_budget's are category
    names, the planners' are the options of the estimate they run (RunConfig refuses any other)."""
    from memprof.simulate.run import EstimateOptions, GenerationOptions

    return {
        memprof.check_budget: {c.value for c in memprof.Category},
        memprof.max_batch_size: set(typing.get_type_hints(EstimateOptions)),
        memprof.max_generation_batch_size: set(typing.get_type_hints(GenerationOptions)),
    }


def _accepted(func: Any) -> "tuple[set[str], bool]":
    """The keywords ``func`` takes, and whether that set is complete: ``**options: Unpack[TypedDict]`` adds the
    TypedDict's keys, a function of :func:`_forwarded` the keywords it hands on; a ``**kwargs`` of any other kind
    makes the set incomplete (it cannot be checked)."""
    sig = inspect.signature(func)
    names, complete = set(), True
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            names.add(p.name)
        elif p.kind is p.VAR_KEYWORD and func in _forwarded():
            names |= _forwarded()[func]
        elif p.kind is p.VAR_KEYWORD:
            typed = re.fullmatch(r"Unpack\[(\w+)\]", str(p.annotation).strip("'\""))
            options = typed and _typed_dict(typed.group(1), func)
            if options is None or not typed:
                complete = False
            else:
                names |= set(typing.get_type_hints(options))
    return names, complete


def _typed_dict(name: str, func: Any) -> Any:
    """The TypedDict called ``name`` that ``func``'s module (or the module it reads as, via same_as) defines or
    imports under TYPE_CHECKING."""
    import sys

    for module in [m for n, m in list(sys.modules.items()) if n.startswith("memprof") and m is not None]:
        candidate = getattr(module, name, None)
        if isinstance(candidate, type) and typing.is_typeddict(candidate):
            return candidate
    return None


def _documented_calls(page: pathlib.Path) -> "list[tuple[str, list[str]]]":
    """Each ``name(args)`` of the page's spans, with the keywords its arguments name."""
    return [(call.group(1), _keywords(call.group(2))) for span in _spans(page) for call in CALL.finditer(span)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_call_the_docs_show_matches_a_signature(page):
    wrong = []
    for name, keywords in _documented_calls(page):
        try:
            func = _callee(name)
        except AttributeError:
            wrong.append(f"{name}(): no such function")
            continue
        if func is None or not callable(func) or not keywords:
            continue
        if isinstance(func, type):
            func = func.__init__
        accepted, complete = _accepted(func)
        wrong += [f"{name}({k}=...)" for k in keywords if complete and k not in accepted]
    assert not wrong, f"{page.relative_to(ROOT)} shows calls memprof's signatures do not take: {wrong}"


def test_the_check_reads_names_and_keywords_as_meant(tmp_path):
    # The extraction on a line written for it: a name in a span, one in a shell block, none in a python block,
    # and a call's keywords at the top level only.
    page = tmp_path / "probe.md"
    page.write_text("Use `memprof.nope.nothing` and `estimate(model, inputs=f(a=1), gpu='h100')`.\n\n"
                    "```bash\npython -c 'import memprof.cli.absent'\n```\n\n```python\nmemprof.not_checked_here\n```\n")
    assert _dotted_names(page) == ["memprof.cli.absent", "memprof.nope.nothing"]
    assert _documented_calls(page) == [("estimate", ["inputs", "gpu"])]  # f(a=1) is an argument, not a claim
    with pytest.raises(AttributeError):
        _callee("report.no_such_method")
    with pytest.raises(AttributeError):
        resolve("memprof.Report.no_such_method")
    assert resolve("memprof.Estimate.trace") is None  # a dataclass field without a class-level value
    accepted, complete = _accepted(memprof.estimate)  # **options: Unpack[EstimateOptions]
    assert complete and {"inputs", "gpu", "world_size", "optimizer"} <= accepted and "batch" not in accepted
    assert _accepted(memprof.estimate_hf)[1] is False  # **options: Any cannot be checked
    assert {"total", "activations"} <= _accepted(memprof.check_budget)[0]  # **categories: the category names


# -- what the docs say about the code's counts and the tests ----------------------------------------------------


def test_the_ledger_docstring_counts_what_it_copies():
    # The ledger's docstring says how many ints each new high copies: the tensor categories' totals and the saved
    # tags' live bytes; its TAGS comment splits the tags into what-tags and where-tags.
    from memprof.collect import ledger

    words = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
             "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16}
    doc = " ".join(ledger.__doc__.split())
    copied = [words[w] for w in re.findall(r"\((\w+) ints", doc)]
    assert copied == [ledger.N_CATS, ledger.N_TAGS], doc
    source = (ROOT / "memprof" / "collect" / "ledger.py").read_text()
    what, where = re.search(r"the first (\w+), from the op.*?the last (\w+),", source, re.S).groups()
    assert (words[what], words[where]) == (ledger.FIRST_WHERE_TAG, ledger.N_TAGS - ledger.FIRST_WHERE_TAG)


# A unit test builds no profile of a model; a file under tests/unit that builds or runs a module at all is one
# docs/architecture.md names, so the page's "Tests" section stays what the directory holds.
MODEL_USE = re.compile(r"\bnn\.(?!Module\b)[A-Z]\w*\(|torch\.nn\.(?!Module\b)[A-Z]\w*\(|memprof\.(profile|estimate|"
                       r"estimate_generation|max_batch_size|max_generation_batch_size|plan)\(|\.backward\(")


def test_architecture_names_every_unit_test_that_builds_a_module():
    unit = ROOT / "tests" / "unit"
    using = {p.name for p in unit.glob("test_*.py") if p.name != "test_docs_drift.py"
             and MODEL_USE.search(_code_only(p.read_text()))}
    section = (ROOT / "docs" / "architecture.md").read_text().split("- `tests/unit/`", 1)[1].split("\n- ", 1)[0]
    named = set(re.findall(r"`(test_\w+\.py)`", section))
    assert using == named, f"build a module: {sorted(using)}; docs/architecture.md names: {sorted(named)}"


class _NoStrings(ast.NodeTransformer):
    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        return ast.Constant("") if isinstance(node.value, str) else node


def _code_only(source: str) -> str:
    """The source without comments, docstrings and other strings (a message may quote ``memprof.profile(...)``)."""
    return ast.unparse(_NoStrings().visit(ast.parse(source)))


def test_the_api_reference_documents_every_public_name():
    # docs/api documents each name of memprof.__all__ under its top-level spelling, memprof.X.
    text = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.rst"))
    directive = re.compile(r"^\.\. auto(?:function|class|exception|data|module)::\s+(\S+)", re.M)
    current = re.compile(r"^\.\. currentmodule::\s+(\S+)", re.M)
    documented = set()
    for page in (ROOT / "docs" / "api").glob("*.rst"):
        module = None
        for line in page.read_text().splitlines():
            if m := current.match(line):
                module = m.group(1)
            elif m := directive.match(line):
                target = m.group(1)
                documented.add(target if "." in target or module is None else f"{module}.{target}")
    assert text
    missing = [n for n in memprof.__all__ if f"memprof.{n}" not in documented]
    assert not missing, f"docs/api does not document: {missing}"


def test_dataclass_fields_are_checked_as_attributes():
    # resolve() accepts a field only where the class declares it.
    @dataclasses.dataclass
    class Probe:
        field: int

    assert _member(Probe, "field") is None
    with pytest.raises(AttributeError):
        _member(Probe, "other")
