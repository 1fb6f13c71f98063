"""``memprof estimate --config run.toml`` and ``memprof plan --config``: a run described in a TOML or JSON file of
RunConfig's sections gives the very figures the same run given by flags gives, byte for byte; a flag given beside
the file overrides its value; every malformed file is one error naming the file, the section and the key; and the
file's keys, the sections' fields and the command's options cannot drift apart (walked here)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import textwrap

import pytest

transformers = pytest.importorskip("transformers")

from memprof import cli  # noqa: E402
from memprof.cli import config as cli_config  # noqa: E402
from memprof.simulate import run as run_module  # noqa: E402
from memprof.simulate import run_file  # noqa: E402

# A Mixtral small enough to simulate in well under a second (its routers make routing observable).
MIXTRAL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=16, intermediate_size=32,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
               max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2)
# The plan's model, as tests/integration/test_cli_options.py plans it: long sequences on an L4.
PLANNED = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=256,
               max_position_embeddings=32768)

MODULE = textwrap.dedent('''
    import contextlib

    from memprof.simulate import hf

    CONFIG = {config!r}


    def build(batch_size):
        built = hf.build_model(hf.load_config(CONFIG))
        return {{"model": built.model, "inputs": hf.token_batch(built, batch_size, 8), "loss_fn": hf.hf_loss}}


    def shard(model, mesh):
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)


    @contextlib.contextmanager
    def _nothing():
        yield


    def watch():
        return _nothing()
''')


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run_file")
    for name, config in (("mixtral", MIXTRAL), ("planned", PLANNED)):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config))
    (tmp / "run_file_models.py").write_text(MODULE.format(config=str(tmp / "mixtral")))
    mp = pytest.MonkeyPatch()
    mp.chdir(tmp)
    mp.syspath_prepend(str(tmp))
    yield tmp
    mp.undo()


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # a string, an int, a float: TOML writes them as JSON does


def write(place, run: dict, kind: str, name: str = "run") -> str:
    """``run`` (top-level keys, then sections as dicts) written as a TOML or JSON run file."""
    path = place / f"{name}.{kind}"
    if kind == "json":
        path.write_text(json.dumps(run, indent=1))
    else:
        top = [f"{k} = {_toml(v)}" for k, v in run.items() if not isinstance(v, dict)]
        sections = [f"\n[{s}]\n" + "\n".join(f"{k} = {_toml(v)}" for k, v in keys.items())
                    for s, keys in run.items() if isinstance(keys, dict)]
        path.write_text("\n".join(top) + "\n" + "\n".join(sections) + "\n")
    return str(path)


def run(argv: "list[str]", capsys) -> "tuple[int, str, str]":
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse's own refusals
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


M = "run_file_models"
#: The same run, by flags and as a file: (the command and its flags, the file's content).
SAME_RUN = {
    "factory-layout": (["estimate", f"{M}:build", "--batch-size", "2", "--device", "cpu", "--precision", "bf16",
                        "--optimizer", "sgd", "--world-size", "2", "--parallel", "zero3", "--json"],
                       {"model": f"{M}:build", "precision": "bf16", "workload": {"batch_size": 2, "optimizer": "sgd"},
                        "target": {"device": "cpu"}, "parallelism": {"world_size": 2, "parallel": "zero3"}}),
    "factory-parallelize": (["estimate", f"{M}:build", "--batch-size", "2", "--device", "cpu", "--routing", "worst",
                             "--step-context", f"{M}:watch", "--world-size", "2", "--parallelize", f"{M}:shard",
                             "--mesh", "a=2,b=1", "--rank", "1", "--json"],
                            {"model": f"{M}:build", "workload": {"batch_size": 2, "routing": "worst",
                                                                 "step_context": f"{M}:watch"},
                             "target": {"device": "cpu"},
                             "parallelism": {"world_size": 2, "parallelize": f"{M}:shard", "mesh": {"a": 2, "b": 1},
                                             "rank": 1}}),
    "factory-target": (["estimate", f"{M}:build", "--batch-size", "2", "--precision", "mixed", "--gpu", "h100-80gb",
                        "--alloc-conf", "expandable_segments:True", "--attention", "math", "--extrapolate", "1",
                        "--json"],
                       {"model": f"{M}:build", "precision": "mixed", "workload": {"batch_size": 2},
                        "target": {"gpu": "h100-80gb", "alloc_conf": "expandable_segments:True",
                                   "attention": "math"},
                        "depth": {"extrapolate": 1}}),
    "hf": (["estimate", "--hf", "mixtral", "--seq-len", "8", "--batch-size", "2", "--checkpointing", "--optimizer",
            "adam", "--precision", "mixed-fp16", "--gpu", "h100-80gb", "--loop", "plain", "--json"],
           {"hf": "mixtral", "precision": "mixed-fp16",  # memprof's own loop: a named loop's fp16 is not simulated
            "workload": {"batch_size": 2, "seq_len": 8, "checkpointing": True, "optimizer": "adam", "loop": "plain"},
            "target": {"gpu": "h100-80gb"}}),
    "hf-generation": (["estimate", "--hf", "mixtral", "--generate", "--batch-size", "2", "--prompt-len", "6",
                       "--new-tokens", "3", "--routing", "worst", "--device", "cpu", "--json"],
                      {"hf": "mixtral", "generation": {"batch_size": 2, "prompt_len": 6, "max_new_tokens": 3,
                                                       "routing": "worst"},
                       "target": {"device": "cpu"}}),
    "factory-generation": (["estimate", f"{M}:build", "--generate", "--batch-size", "2", "--prompt-len", "6",
                            "--new-tokens", "3", "--device", "cpu", "--json"],
                           {"model": f"{M}:build", "generation": {"batch_size": 2, "prompt_len": 6,
                                                                  "max_new_tokens": 3},
                            "target": {"device": "cpu"}}),
    "plan": (["plan", "--hf", "planned", "--seq-len", "32768", "--gpu", "l4-24gb", "--precision", "bf16",
              "--checkpointing", "off", "--world-size", "2", "--parallel", "fsdp", "--optimizer", "sgd", "--attention", "math", "--json"],
             {"hf": "planned", "precision": "bf16",
              "workload": {"seq_len": 32768, "checkpointing": False, "optimizer": "sgd"},
              "target": {"gpu": "l4-24gb", "attention": "math"}, "parallelism": {"world_size": 2, "parallel": "fsdp"}}),
}


@pytest.mark.parametrize("case", sorted(SAME_RUN))
def test_a_run_by_flags_and_by_a_toml_and_a_json_file_prints_the_same_bytes(place, capsys, case):
    argv, content = SAME_RUN[case]
    flags = run(argv, capsys)
    assert flags[0] in (0, 1) and not flags[2].strip() and flags[1].strip(), flags  # 1: a verdict, not an error
    for kind in ("toml", "json"):
        path = write(place, content, kind, name=case)
        by_file = run([argv[0], "--config", path, "--json"], capsys)
        assert by_file == flags, (case, kind)


def test_a_flag_given_beside_the_file_overrides_its_value(place, capsys):
    # The file says batch 3 and a cpu target; --batch-size 2 on the command line wins, the file's other values stay.
    path = write(place, {"model": f"{M}:build", "workload": {"batch_size": 3}, "target": {"device": "cpu"}}, "toml")
    overridden = run(["estimate", "--config", path, "--batch-size", "2", "--json"], capsys)
    flags = run(["estimate", f"{M}:build", "--batch-size", "2", "--device", "cpu", "--json"], capsys)
    from_file = run(["estimate", "--config", path, "--json"], capsys)
    assert overridden[0] == 0 and overridden == flags
    assert json.loads(from_file[1])["peak_bytes"] > json.loads(flags[1])["peak_bytes"]  # batch 3: the file's own
    # Which model is the command line's too: --hf beside a file naming a factory simulates the config.
    hf = run(["estimate", "--config", path, "--hf", "mixtral", "--seq-len", "8", "--batch-size", "2", "--json"],
             capsys)
    assert hf == run(["estimate", "--hf", "mixtral", "--seq-len", "8", "--batch-size", "2", "--device", "cpu",
                      "--json"], capsys)


def test_a_key_no_flag_takes_reaches_the_simulation(place, capsys):
    # steps (no flag of memprof estimate) is estimate()'s steps=: the notes say how many steps ran.
    for steps in (2, 3):
        path = write(place, {"model": f"{M}:build", "workload": {"batch_size": 2, "steps": steps},
                             "target": {"device": "cpu"}}, "toml")
        rc, out, err = run(["estimate", "--config", path], capsys)
        assert rc == 0 and not err and f"the training loop: {steps} steps of forward and loss" in out
    # num_beams is estimate_generation()'s: the file's figures are the Python call's, and beams cost memory.
    from memprof.report import planning

    gen = {"batch_size": 2, "prompt_len": 6, "max_new_tokens": 3}
    path = write(place, {"hf": "mixtral", "generation": {**gen, "num_beams": 2}, "target": {"device": "cpu"}}, "json")
    rc, out, err = run(["estimate", "--config", path, "--json"], capsys)
    beams = planning.estimate_hf_generation("mixtral", **gen, num_beams=2, device="cpu")
    greedy = planning.estimate_hf_generation("mixtral", **gen, device="cpu")
    assert rc == 0 and json.loads(out)["peak_bytes"] == beams.peak_bytes > greedy.peak_bytes


def _one_line_error(outcome: "tuple[int, str, str]") -> str:
    rc, out, err = outcome
    assert rc == 1 and not out and len(err.strip().splitlines()) == 1, outcome
    return err


WORKLOAD_TAKES = "[workload] takes optimizer, steps, step_context, routing"
TOP_TAKES = "the top level takes model, hf, precision and the sections [workload], [generation], [target]"
#: A malformed file (as text, by kind) and what its one-line refusal says, besides the file's name.
REFUSED = {
    "unknown-section": ("json", '{"model": "m:build", "wrkload": {"batch_size": 2}}',
                        ["key 'wrkload' is no section or key of a run file", TOP_TAKES]),
    "unknown-key": ("toml", 'model = "m:build"\n[target]\ngpus = "h100"\n',
                    ["[target] key 'gpus' is unknown", "[target] takes device, gpu, alloc_conf, attention"]),
    "not-in-a-file": ("toml", 'model = "m:build"\n[workload]\ninputs = 3\n',
                      ["[workload] key 'inputs' cannot be given in a file (tensors: the factory's 'inputs' key",
                       WORKLOAD_TAKES]),
    "pipeline": ("json", '{"model": "m:build", "parallelism": {"pipeline": "pp"}}',
                 ["[parallelism] key 'pipeline' cannot be given in a file (a memprof.Pipeline object",
                  "[parallelism] takes world_size, parallel, parallelize, mesh, rank"]),
    "count-as-string": ("toml", 'model = "m:build"\n[workload]\nbatch_size = "8"\n',
                        ["[workload] key 'batch_size' must be a whole number of at least 1, not a string '8'",
                         WORKLOAD_TAKES]),
    "count-as-bool": ("json", '{"model": "m:build", "workload": {"batch_size": true}}',
                      ["[workload] key 'batch_size' must be a whole number of at least 1, not a boolean True"]),
    "zero-ranks": ("toml", 'model = "m:build"\n[parallelism]\nworld_size = 0\n',
                   ["[parallelism] key 'world_size' must be a whole number of at least 1, not an integer 0"]),
    "flag-as-string": ("toml", 'hf = "x"\n[workload]\ncheckpointing = "yes"\n',
                       ["[workload] key 'checkpointing' must be true or false, not a string 'yes'"]),
    "mesh-as-string": ("toml", 'model = "m:build"\n[parallelism]\nmesh = "dp=2"\n',
                       ["[parallelism] key 'mesh' must be a table of dimension names and sizes"]),
    "unknown-layout": ("toml", 'model = "m:build"\n[parallelism]\nparallel = "tp"\n',
                       ['[parallelism] key \'parallel\' must be one of "ddp", "fsdp", "fsdp1", "zero1", "zero2", "zero3"']),
    "unknown-precision": ("json", '{"model": "m:build", "precision": "fp8"}',
                          ["key 'precision' must be one of \"fp32\", \"bf16\"", TOP_TAKES]),
    "factory-without-colon": ("toml", 'model = "m.build"\n',
                              ["key 'model' must be a function named \"module:function\""]),
    "top-p-above-one": ("toml", 'hf = "x"\n[generation]\ntop_p = 2\n',
                        ["[generation] key 'top_p' must be a number in (0, 1], not an integer 2",
                         "[generation] takes batch_size, prompt_len, max_new_tokens, num_beams"]),
    "section-not-a-table": ("json", '{"model": "m:build", "target": "cuda"}',
                            ["[target] must be a table of keys, not a string", "[target] takes device"]),
    "not-a-table": ("json", '[1, 2]', ["must hold a table of sections (an object in JSON), not an array"]),
    "section-twice-toml": ("toml", 'model = "m:build"\n[workload]\nbatch_size = 2\n[target]\ndevice = "cpu"\n'
                                   '[workload]\nsteps = 3\n',
                           ["[workload] is given twice; give each section and key once", WORKLOAD_TAKES]),
    "key-twice-toml": ("toml", 'model = "m:build"\n[workload]\nbatch_size = 2\nbatch_size = 3\n',
                       ["[workload] key 'batch_size' is given twice", WORKLOAD_TAKES]),
    "section-twice-json": ("json", '{"model": "m:build", "workload": {"steps": 2}, "workload": {"steps": 3}}',
                           ["key 'workload' is given twice; give each section and key once", TOP_TAKES]),
    "key-twice-json": ("json", '{"model": "m:build", "workload": {"batch_size": 2, "batch_size": 3}}',
                       ["[workload] key 'batch_size' is given twice", WORKLOAD_TAKES]),
    "mesh-name-twice-toml": ("toml", 'model = "m:build"\n[parallelism.mesh]\ndp = 2\ndp = 4\n',
                             ["[parallelism.mesh] key 'dp' is given twice", "[parallelism] takes world_size"]),
    "mesh-name-twice-json": ("json", '{"model": "m:build", "parallelism": {"mesh": {"dp": 2, "dp": 4}}}',
                             ["[parallelism] key 'mesh' gives 'dp' twice"]),
    "two-models": ("toml", 'model = "m:build"\nhf = "x"\n', ["key 'hf' and model both say which model; give one"]),
    "train-and-generate": ("toml", 'hf = "x"\n[workload]\nbatch_size = 2\n[generation]\nbatch_size = 2\n',
                           ["[generation] and [workload] both describe the run", "[generation] takes"]),
    "generation-on-ranks": ("toml", 'hf = "x"\n[generation]\nbatch_size = 2\n[parallelism]\nworld_size = 2\n',
                            ["[parallelism] is a training step's: a generation runs on one device",
                             "[parallelism] takes world_size"]),
    "bad-toml": ("toml", 'model = "m:build"\n[workload\n', ["is not valid TOML (", "line 2"]),
    "bad-json": ("json", '{"model": "m:build",}', ["is not valid JSON (", "line 1"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_malformed_file_is_one_error_naming_the_file_the_section_and_the_key(place, capsys, case):
    kind, text, said = REFUSED[case]
    path = place / f"bad-{case}.{kind}"
    path.write_text(text)
    err = _one_line_error(run(["estimate", "--config", str(path)], capsys))
    assert f"error: {path}" in err, err
    for words in said:
        assert words in err, (case, words, err)
    # The Python error is memprof's own: one InvalidArgumentError, whatever was malformed.
    from memprof.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        run_file.read_run_file(path)


def test_only_a_toml_or_json_file_is_read(place, capsys):
    path = place / "run.yaml"
    path.write_text("model: m:build\n")
    err = _one_line_error(run(["estimate", "--config", str(path)], capsys))
    assert "a run file is .toml or .json, and its name says which" in err


def test_the_one_reader_refuses_a_named_pipe_and_a_file_too_large(place, capsys, monkeypatch):
    fifo = place / "fifo.toml"
    os.mkfifo(fifo)  # no writer: a plain open() would block here for ever
    err = _one_line_error(run(["estimate", "--config", str(fifo)], capsys))
    assert f"{fifo} is a named pipe, not a file; memprof reads a run file from a regular file only" in err
    path = write(place, {"model": f"{M}:build", "workload": {"batch_size": 2}}, "toml")
    monkeypatch.setenv("MEMPROF_MAX_FILE_SIZE", "16")  # bytes: the file above holds more
    err = _one_line_error(run(["estimate", "--config", path], capsys))
    assert "above the 16 B (16 bytes) memprof reads at most (MEMPROF_MAX_FILE_SIZE)" in err


def test_what_neither_the_file_nor_a_flag_gives_is_asked_for(place, capsys):
    path = write(place, {"model": f"{M}:build", "target": {"device": "cpu"}}, "toml")
    rc, out, err = run(["estimate", "--config", path], capsys)
    assert rc == 2 and err.strip().splitlines()[-1].endswith(
        "the following arguments are required: --batch-size (or [workload] or [generation] batch_size in the "
        "--config file)")
    rc, out, err = run(["plan", "--config", write(place, {"hf": "planned"}, "toml")], capsys)
    assert rc == 2 and "required: --seq-len (or [workload] seq_len in the --config file)" in err


def test_plan_refuses_what_a_plan_does_not_take(place, capsys):
    path = write(place, {"hf": "planned", "workload": {"seq_len": 64, "batch_size": 8}, "target": {"gpu": "l4-24gb"}},
                 "toml")
    err = _one_line_error(run(["plan", "--config", path], capsys))
    assert f"{path}: [workload] batch_size is not for memprof plan" in err and "searching the batch size" in err
    assert "memprof plan takes hf, precision, [parallelism] parallel" in err
    path = write(place, {"hf": "planned", "workload": {"seq_len": 64, "optimizer": "none"},
                         "target": {"gpu": "l4-24gb"}}, "json")
    err = _one_line_error(run(["plan", "--config", path], capsys))
    assert '[workload] optimizer = "none" is not for memprof plan' in err


# The walk: RunConfig's sections, the file's keys and the commands' options, one against another.

def _dests(command: str) -> "set[str]":
    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest for a in sub.choices[command]._actions if not isinstance(a, argparse._HelpAction)}


def test_every_field_of_every_section_is_a_key_of_the_file_or_says_why_not():
    for section, cls in run_file.SECTIONS.items():
        taken = set(run_file.section_keys(section))
        refused = run_file.NOT_IN_FILE.get(section, {})
        for field in dataclasses.fields(cls):
            assert (field.name in taken) != (field.name in refused), (section, field.name)
            assert field.name in taken or len(refused[field.name]) > 20, (section, field.name)  # a reason, said
    # The file's names are the keyword arguments' (one mapping): each keyword of estimate() is its section's key.
    for section, names in run_module._SECTIONS.items():
        fields = {f.name for f in dataclasses.fields(run_file.SECTIONS[section])}
        assert set(names) <= fields, section


def test_every_key_of_the_file_reaches_a_flag_or_a_keyword_of_the_simulation():
    estimate = _dests("estimate")
    for section in run_file.SECTIONS:
        keywords = run_module.GENERATION_OPTIONS if section == "generation" else run_module.OPTIONS
        for key in run_file.section_keys(section):
            dest = cli_config._DESTS.get((section, key), key)
            assert dest in estimate or key in keywords, (section, key)
    for key in run_file.TOP_KEYS:
        assert cli_config._DESTS.get(("", key), key) in estimate, key


def test_every_option_of_estimate_and_plan_is_a_key_of_the_file_or_says_why_not():
    keys = {cli_config._DESTS.get((s, k), k) for s in run_file.SECTIONS for k in run_file.section_keys(s)}
    keys |= {cli_config._DESTS.get(("", k), k) for k in run_file.TOP_KEYS}
    for dest in _dests("estimate"):
        assert dest in keys or dest in cli_config.FLAG_ONLY, dest
    planned = {k for _, k in cli_config.PLAN_KEYS}
    for dest in _dests("plan"):
        assert dest in planned or dest in cli_config.FLAG_ONLY, dest
    for section, key in cli_config.PLAN_KEYS:  # what plan takes is a key of the file
        assert key in (run_file.section_keys(section) if section else run_file.TOP_KEYS), (section, key)


def test_the_help_says_that_a_flag_overrides_the_file(capsys):
    for command in ("estimate", "plan"):
        rc, out, _ = run([command, "--help"], capsys)
        assert rc == 0
        assert "a flag given beside it overrides the file's value" in re.sub(r"\s+", " ", out)


def test_the_example_file_docs_cli_gives_is_read_whole(tmp_path):
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    section = doc[doc.index("## A run in a file"):]
    example = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    (tmp_path / "run.toml").write_text(example)
    read = run_file.read_run_file(tmp_path / "run.toml")
    assert read.model == "mymodels:build" and read.precision == "mixed"
    assert set(read.sections) == {"workload", "target", "parallelism", "depth"}  # every section of a training run
    assert read.sections["parallelism"] == {"world_size": 8, "parallel": "fsdp"}
    # The commented keys are keys the file takes: uncommented, the example still reads.
    (tmp_path / "all.toml").write_text(re.sub(r"^# (\w+ = )", r"\1", example, flags=re.M)
                                       .replace('parallel = "fsdp"', ""))
    everything = run_file.read_run_file(tmp_path / "all.toml")
    assert everything.sections["parallelism"]["mesh"] == {"dp": 4, "tp": 2}
    assert everything.sections["workload"]["checkpointing"] is True
