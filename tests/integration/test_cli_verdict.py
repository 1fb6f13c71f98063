"""``memprof estimate``'s verdict says one thing wherever it is read: the JSON's ``fits`` and ``headroom``, the text's
last line and the exit status judge the same peak against the same limit (``--budget``, the GPU's memory, whichever
is smaller; a simulated out-of-memory error never fits). And the Python spellings docs/cli.md gives reach what
they name from ``import memprof`` alone."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

transformers = pytest.importorskip("transformers")

from memprof.cli import main  # noqa: E402

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=16, intermediate_size=32,
             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
             max_position_embeddings=32768)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("verdict")
    (path / "config.json").write_text(json.dumps(LLAMA))
    return str(path)


def _run(capsys, folder, *extra, seq="16"):
    base = ["estimate", "--hf", folder, "--seq-len", seq, "--batch-size", "1", "--precision", "bf16", *extra]
    rc = main([*base, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert main(base) == rc  # the text's exit status is the JSON's
    return rc, data, capsys.readouterr().out.strip().splitlines()[-1]


def test_json_fits_is_the_exit_status(folder, capsys):
    # --gpu alone: the device-level peak against the H100's memory.
    rc, data, line = _run(capsys, folder, "--gpu", "h100-80gb")
    assert (rc, data["fits"], data["budget"]) == (0, True, None)
    assert data["headroom"] == data["capacity"] - data["device_peak"] > 0 and " fits in h100" in line
    # A budget below the device peak: it does not fit, though the GPU would hold it (the JSON said fits: true
    # while the exit status said 1).
    budget = data["device_peak"] - 1
    rc, data, line = _run(capsys, folder, "--gpu", "h100-80gb", "--budget", str(budget))
    assert (rc, data["fits"], data["budget"], data["headroom"]) == (1, False, budget, -1)
    assert "does NOT fit" in line
    rc, data, line = _run(capsys, folder, "--gpu", "h100-80gb", "--budget", str(budget + 1))
    assert (rc, data["fits"], data["headroom"]) == (0, True, 0)
    # Without --gpu the tensors' peak against the budget; with neither, nothing is judged.
    rc, data, line = _run(capsys, folder, "--device", "cpu", "--budget", str(data["peak_bytes"]))
    assert (rc, data["fits"]) == (0, True) and "estimated peak" in line
    rc, data, line = _run(capsys, folder, "--device", "cpu", "--budget", str(data["peak_bytes"] - 1))
    assert (rc, data["fits"], data["headroom"]) == (1, False, -1)
    rc, data, _ = _run(capsys, folder, "--device", "cpu")
    assert (rc, data["fits"], data["headroom"], data["budget"]) == (0, None, None, None)


def test_a_budget_larger_than_the_gpu_does_not_make_it_fit(folder, capsys):
    # 32,768 tokens run the T4 out of memory: a budget of 1 TiB does not make it fit (the exit status said 1 and
    # the JSON, judged on the budget alone, said it fitted with 1 TiB of headroom).
    rc, data, line = _run(capsys, folder, "--gpu", "t4", "--budget", "1 TiB", seq="32768")
    assert (rc, data["fits"]) == (1, False)
    assert data["headroom"] == data["capacity"] - data["device_peak"] < 0
    assert line.endswith("runs out of memory first")


# Dotted names docs/cli.md spells in backticks, from memprof down (memprof.report.planning.plan_grid ...).
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "cli.md"
NAMES = sorted(set(re.findall(r"`(memprof(?:\.[A-Za-z_]\w*)+)", DOC.read_text())))


def test_the_names_docs_cli_spells_are_reachable_from_import_memprof():
    assert "memprof.report.planning.plan_grid" in NAMES
    # Each name from a fresh ``import memprof``, so that no name is reachable only because another one imported its
    # module: one interpreter imports memprof, then a forked child per name walks it (a copy of the interpreter as
    # the import left it) and exits 0 when it got there; the parent prints the names that failed.
    code = textwrap.dedent(f"""
        import os, sys, traceback
        import memprof
        failed = []
        for name in {NAMES!r}:
            pid = os.fork()
            if pid == 0:
                try:
                    obj = memprof
                    for part in name.split(".")[1:]:
                        obj = getattr(obj, part)
                except BaseException:
                    traceback.print_exc()
                    os._exit(1)
                os._exit(0)
            if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
                failed.append(name)
        print(failed)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", (done.stdout, done.stderr[-3000:])
