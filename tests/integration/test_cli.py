import json
import subprocess
import sys

from memprof.cli import main


def test_demo_runs_and_prints_the_anatomy(capsys, tmp_path):
    out_file = tmp_path / "demo.json"
    assert main(["demo", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--layers", "1",
                 "--hidden", "32", "--device", "cpu", "--save", str(out_file)]) == 0
    out = capsys.readouterr().out
    for word in ("Peak", "activations", "optimizer_states", "Phases", "Top modules", "not measured"):
        assert word in out
    assert json.loads(out_file.read_text())["format"] == "memprof.trace"
    assert main(["report", str(out_file)]) == 0
    assert "Peak" in capsys.readouterr().out


def test_errors_are_one_line_with_exit_code_1(capsys, tmp_path):
    assert main(["report", str(tmp_path / "missing.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("memprof: error: no such file") and err.count("\n") == 1
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    assert main(["report", str(bad)]) == 1
    assert "not valid JSON" in capsys.readouterr().err


def test_usage_errors_exit_2():
    proc = subprocess.run([sys.executable, "-m", "memprof", "demo", "--steps", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--steps must be at least 1" in proc.stderr
    assert "Traceback" not in proc.stderr
