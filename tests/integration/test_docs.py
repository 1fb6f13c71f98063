"""Every python code block in the docs runs (blocks in one page share a namespace, in order)."""

import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if "```python" in p.read_text())
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_run(page, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files the examples write (saved reports, logs) land here
    blocks = BLOCK.findall(page.read_text())
    torch.manual_seed(0)
    ns: dict = {"__name__": f"docs_{page.stem}"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{page.name}[block {i}]", "exec"), ns)
        except Exception as exc:  # pragma: no cover - the message names the block
            raise AssertionError(f"{page.name} block {i} failed: {exc!r}\n{code}") from exc
