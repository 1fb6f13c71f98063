"""Every option of ``memprof estimate`` (the factory form and the ``--hf`` form, each for a training step and for a
generation) and of ``memprof plan`` either reaches the simulation, seen in what the command prints (the figures or
the notes), or is refused with one line naming it. The options are read from the parser itself: an option added
later is walked too, and fails here until it does one or the other.

For each option and each probe value, a baseline (the form's own arguments, plus whatever the option needs beside
it: ``--rank`` needs ``--parallelize``) is run with and without it. The factory's model is the one ``--hf`` builds
from the same config, so the two forms given the same option must also give the same figures: an option that
reached one form and not the other shows there.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import textwrap

import pytest

transformers = pytest.importorskip("transformers")

from memprof import cli  # noqa: E402

# A Mixtral small enough to simulate in well under a second (its routers make --routing observable). One block: the
# walk runs about 150 simulations of it, and a second block doubled their cost without reaching another code path;
# the one option that needs a repeated stack of blocks (--extrapolate) is probed on the two-block MIXTRAL2.
MIXTRAL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=16, intermediate_size=32,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
               max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2)
MIXTRAL2 = {**MIXTRAL, "num_hidden_layers": 2}
DENSE = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=16, intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
             max_position_embeddings=32)
# The plan's model: long sequences on an L4 (flash attention, 22.5 GiB), where a few dozen samples fit and the
# activations (not the model states) decide the answer, so checkpointing, the kernel and the allocator show.
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


    def build_two(batch_size):
        built = hf.build_model(hf.load_config({two!r}))
        return {{"model": built.model, "inputs": hf.token_batch(built, batch_size, 8), "loss_fn": hf.hf_loss}}


    def build_pipeline(batch_size):
        # Two stages of the dense Llama over 2 ranks, 2 micro-batches: rank classes to simulate side by side.
        from memprof import Pipeline
        from memprof.simulate.hf_pipeline import causal_lm_loss, split

        built = hf.build_model(hf.load_config({dense!r}))
        ids = hf.token_batch(built, batch_size, 8)["input_ids"]
        return {{"model": built.model, "inputs": ids, "targets": ids, "loss_fn": causal_lm_loss(built.model),
                 "pipeline": Pipeline(split, schedule="1f1b", microbatches=2)}}


    def build_dense(batch_size):
        built = hf.build_model(hf.load_config({dense!r}))
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


    def step(model, optimizer, inputs):
        # A loop that keeps the model's output to the next step (its logits): what memprof's own loop does not.
        out = model(**inputs)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return out
''')

GEN = {"generate": True, "prompt_len": "6", "new_tokens": "3"}

#: Each form: its command and its own arguments, by dest (True: a flag given; None: absent).
FORMS = {
    "factory": ("estimate", {"factory": "cli_walk_models:build", "batch_size": "2", "device": "cpu", "json": True}),
    # memprof's own loop, as the factory form's default: the two forms give the same figures (--hf's default loop is
    # the HF Trainer's, probed through --loop).
    "hf": ("estimate", {"hf": "{mixtral}", "seq_len": "8", "batch_size": "2", "device": "cpu", "json": True,
                        "loop": "plain"}),
    "factory-generate": ("estimate", {"factory": "cli_walk_models:build", "batch_size": "2", "device": "cpu",
                                      "json": True, **GEN}),
    "hf-generate": ("estimate", {"hf": "{mixtral}", "batch_size": "2", "device": "cpu", "json": True, **GEN}),
    "plan": ("plan", {"hf": "{planned}", "seq_len": "32768", "gpu": "l4-24gb", "precision": "bf16",
                      "checkpointing": "off", "json": True}),
}

#: The values an option is tried with, where its choices do not say them (an option with choices is tried with
#: each, a flag with and without). A new option whose values cannot be read from the parser needs a line here.
VALUES = {
    "factory": ["cli_walk_models:build_dense"],
    "hf": ["{dense}"],
    "seq_len": ["6"],
    "batch_size": ["3"],
    "device": ["cuda"],
    "world_size": ["2"],
    "parallel": ["zero3"],
    "parallelize": ["cli_walk_models:shard"],
    "step_context": ["cli_walk_models:watch"],
    "train_step": ["cli_walk_models:step"],
    "loop": ["hf-trainer", "accelerate", "lightning", "torchtitan"],  # plain is the baselines' loop
    ("plan", "loop"): ["plain"],  # the plan's default is hf-trainer
    "routing": ["worst", "capacity=0.5"],
    "mesh": ["a=2,b=1"],  # two replicas of one shard each (HSDP): nothing sharded, unlike the default 1-D mesh
    "rank": ["1"],
    "extrapolate": ["1"],  # cuts to 1, 2 and 3 blocks: more than the 2 there are, which the notes say
    "budget": ["1 MiB"],
    "gpu": ["h100-80gb"],
    "alloc_conf": ["expandable_segments:True"],
    "prompt_len": ["4"],
    "new_tokens": ["5"],
    "optimizer": ["none"],
    "precision": ["mixed-fp16"],
    "attention": ["math"],
    "layouts": ["fsdp,zero3"],
    "html": ["{tmp}/plan.html"],
    "config": ["{tmp}/run.toml"],  # precision = "bf16", which no form's baseline gives
    ("plan", "config"): ["{tmp}/plan.toml"],  # [target] attention = "math"
    ("plan", "hf"): ["{wider}"],
    ("plan", "seq_len"): ["16384"],
    ("plan", "gpu"): ["a100-40gb"],
    ("plan", "precision"): ["mixed"],
    ("plan", "parallel"): ["fsdp,zero3"],
    ("plan", "optimizer"): ["sgd"],
    ("plan", "processes"): ["2"],
    # Forked or not, the figures are the same; the notes say which (the suite's workers fork none by default, a
    # plain run does: one of the two values changes the notes either way).
    ("estimate", "processes"): ["1", "2"],
}

#: What an option needs beside it, given to both runs: (form, dest), (command, dest) or dest -> arguments by dest.
COMPANIONS = {
    "attention": {"device": "cuda"},
    "alloc_conf": {"device": "cuda"},
    "gpu": {"device": None},
    "world_size": {"parallel": "fsdp"},
    "parallel": {"world_size": "2", "parallel": "ddp"},
    "rank": {"world_size": "2", "parallelize": "cli_walk_models:shard"},
    "mesh": {"world_size": "2", "parallelize": "cli_walk_models:shard"},
    "train_step": {"loop": None},  # each names the step: --loop and --train-step together are refused
    # Two blocks to cut (MIXTRAL has one, which --extrapolate refuses): each form's own way to name MIXTRAL2.
    ("factory", "extrapolate"): {"factory": "cli_walk_models:build_two"},
    ("hf", "extrapolate"): {"hf": "{mixtral2}"},
    ("plan", "world_size"): {},
    ("plan", "attention"): {},
    ("plan", "alloc_conf"): {},
    ("plan", "parallel"): {"world_size": "2", "parallel": "ddp"},
    ("plan", "layouts"): {"world_size": "2", "layouts": "ddp"},
    ("plan", "html"): {"json": None},  # the text says where the page went
    # Two groups of rows (two precisions), searched here, then by two processes: the text's notes say which.
    ("plan", "processes"): {"json": None, "precision": "bf16,fp32", "processes": "1"},
    ("factory", "processes"): {"factory": "cli_walk_models:build_pipeline", "world_size": "2"},
}

#: Values that must be refused, naming the option (and, for a misspelled name, the accepted spellings).
INVALID = {
    ("estimate", "routing"): ["banana", "capacity=-1"],
    ("estimate", "budget"): ["lots"],
    ("estimate", "device"): ["banana"],
    ("estimate", "gpu"): ["banana"],
    ("estimate", "mesh"): ["dp"],
    ("estimate", "extrapolate"): ["0"],
    ("estimate", "world_size"): ["0"],
    ("estimate", "prompt_len"): ["0"],
    ("plan", "precision"): ["banana"],
    ("plan", "layouts"): ["banana"],
    ("plan", "gpu"): ["banana"],
}

_TRAINING_ONLY = {"seq_len", "checkpointing", "optimizer", "step_context", "parallel", "world_size", "parallelize",
                  "mesh", "rank", "extrapolate", "train_step", "loop", "processes"}
#: Options a form refuses, whatever their value: they do not apply to it.
REFUSED = {
    "factory": {"hf", "seq_len", "checkpointing", "prompt_len", "new_tokens"},
    "hf": {"factory", "prompt_len", "new_tokens", "processes"},
    "factory-generate": {"hf"} | _TRAINING_ONLY,
    "hf-generate": {"factory"} | _TRAINING_ONLY,
    "plan": set(),
}


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _actions(command: str) -> "dict[str, argparse.Action]":
    return {a.dest: a for a in _subparser(command)._actions if not isinstance(a, argparse._HelpAction)}


def _name(action: argparse.Action) -> str:
    return max(action.option_strings, key=len) if action.option_strings else str(action.metavar or action.dest)


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("walk")
    folders = {}
    for name, config in (("mixtral", MIXTRAL), ("mixtral2", MIXTRAL2), ("dense", DENSE), ("planned", PLANNED),
                         ("wider", {**PLANNED, "intermediate_size": 512})):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config))
        folders[name] = str(tmp / name)
    (tmp / "run.toml").write_text('precision = "bf16"\n')
    (tmp / "plan.toml").write_text('[target]\nattention = "math"\n')
    (tmp / "cli_walk_models.py").write_text(MODULE.format(config=folders["mixtral"], two=folders["mixtral2"],
                                                                dense=folders["dense"]))
    mp = pytest.MonkeyPatch()
    mp.chdir(tmp)
    yield Walk({**folders, "tmp": str(tmp)})
    mp.undo()


class Walk:
    """Runs ``memprof`` in this process, each distinct command line once."""

    def __init__(self, places: "dict[str, str]") -> None:
        self.places, self.runs = places, {}

    def argv(self, command: str, args: "dict[str, object]") -> "tuple[str, ...]":
        actions = _actions(command)
        out = [command]
        for dest, value in args.items():
            if value is None or value is False:
                continue
            action = actions[dest]
            text = [] if value is True else [str(value).format(**self.places)]
            out += text if not action.option_strings else [action.option_strings[0], *text]
        return tuple(out)

    def run(self, command: str, args: "dict[str, object]") -> "tuple[int, str, str]":
        argv = self.argv(command, args)
        if argv not in self.runs:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = cli.main(list(argv[:1]) + list(argv[1:]))
                except SystemExit as exc:  # argparse's own refusals
                    rc = int(exc.code or 0)
            # The time a plan took is the one figure that differs between identical runs.
            text = re.sub(r"\(\d+(\.\d+)? s\)", "(time)", out.getvalue())
            self.runs[argv] = (rc, text, err.getvalue())
        return self.runs[argv]


def _probes(form: str, dest: str, action: argparse.Action) -> "list[tuple[dict, dict]]":
    """(the baseline's arguments, the probe's) for each value ``dest`` is tried with in ``form``."""
    command, base = FORMS[form]
    # A form that refuses the option is tried with it alone: what it needs beside it may be refused first.
    needs = {} if dest in REFUSED[form] else COMPANIONS.get((form, dest), COMPANIONS.get((command, dest),
                                                                                      COMPANIONS.get(dest, {})))
    given = {**base, **needs}
    if isinstance(action, argparse._StoreTrueAction):
        values: list = [None if given.get(dest) else True]
    else:
        values = VALUES.get((command, dest), VALUES.get(dest))
        if values is None and action.choices:
            values = [c for c in action.choices if c != given.get(dest, action.default)]
        assert values, f"{command} {_name(action)}: say in VALUES what to try it with"
    out = []
    for value in values:
        probe = {**given, dest: value}
        if dest == "generate" and value:  # a generation takes its own lengths, and no sequence length
            probe.update(GEN, seq_len=None, loop=None)  # --loop is a training step's
        elif dest == "generate":  # a training step: no generation's lengths; --hf's sequence length
            probe.update(prompt_len=None, new_tokens=None, seq_len="8" if "hf" in base else None,
                         loop="plain" if "hf" in base else None)  # the factory form's loop, to compare the two
        out.append((given, probe))
    return out


def _refused(outcome: "tuple[int, str, str]", action: argparse.Action) -> bool:
    """Whether the command refused, in one line (two with argparse's usage) that names the option."""
    rc, out, err = outcome
    if rc not in (1, 2) or not err.strip() or out.strip():
        return False
    lines = err.strip().splitlines()
    assert rc == 2 or len(lines) == 1, err  # memprof's own: one line; argparse's: its usage, then one line
    names = {_name(action), action.dest, action.dest.replace("_", "-"), *action.option_strings}
    return "error:" in lines[-1] and any(n.lower() in lines[-1].lower() for n in names)


CASES = [(form, dest) for form, (command, _) in FORMS.items() for dest in _actions(command)]


@pytest.mark.parametrize(("form", "dest"), CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_every_option_reaches_the_simulation_or_is_refused(walk, form, dest):
    command = FORMS[form][0]
    action = _actions(command)[dest]
    outcomes = []
    for given, probe in _probes(form, dest, action):
        baseline, result = walk.run(command, given), walk.run(command, probe)
        assert baseline[0] in (0, 1) and not baseline[2].strip(), (walk.argv(command, given), baseline[2])
        outcomes.append((result, result != baseline))
    if dest in REFUSED[form]:
        assert all(_refused(r, action) for r, _ in outcomes), (form, _name(action), outcomes)
        return
    for result, _ in outcomes:  # every value runs, or is refused naming the option (a kernel a target lacks)
        assert result[0] in (0, 1) and not result[2].strip() or _refused(result, action), (form, dest, result)
    assert any(changed and not result[2].strip() for result, changed in outcomes), \
        f"{command} {_name(action)} ({form}) changed nothing the command prints: {outcomes}"


INVALID_CASES = [(form, dest, value) for form, (command, _) in FORMS.items() if form in ("factory", "hf", "plan")
                 for (c, dest), values in INVALID.items() if c == command for value in values]


@pytest.mark.parametrize(("form", "dest", "value"), INVALID_CASES, ids=[f"{f}-{d}-{v}" for f, d, v in INVALID_CASES])
def test_a_bad_value_is_refused_naming_the_option(walk, form, dest, value):
    command, base = FORMS[form]
    action = _actions(command)[dest]
    needs = COMPANIONS.get((form, dest), COMPANIONS.get((command, dest), COMPANIONS.get(dest, {})))
    outcome = walk.run(command, {**base, **needs, dest: value})
    assert _refused(outcome, action), outcome


def test_routing_names_the_accepted_spellings(walk):
    rc, _, err = walk.run("estimate", {**FORMS["hf"][1], "routing": "banana"})
    assert rc == 1 and "banana" in err and "balanced" in err and "worst" in err and "capacity=" in err


SAME = ("peak_bytes", "breakdown", "peak_step", "peak_phase", "device_peak", "fits", "headroom", "precision",
        "world_size", "parallel")


@pytest.mark.parametrize("mode", ["", "-generate"])
def test_both_forms_give_the_same_figures_for_every_option(walk, mode):
    # The factory builds the very model --hf builds (from the same config, 8 tokens a sequence), so whatever
    # option both take must give the same figures: one that reached one form only differs here.
    compared = 0
    for dest, action in _actions("estimate").items():
        if dest in REFUSED["factory" + mode] | REFUSED["hf" + mode]:
            continue
        for (_, fprobe), (_, hprobe) in zip(_probes("factory" + mode, dest, action), _probes("hf" + mode, dest, action)):
            f, h = walk.run("estimate", fprobe), walk.run("estimate", hprobe)
            if f[0] == 0 and h[0] == 0 and fprobe.get("json") and hprobe.get("json"):
                fd, hd = json.loads(f[1]), json.loads(h[1])
                assert {k: fd[k] for k in SAME} == {k: hd[k] for k in SAME}, (dest, fprobe)
                compared += 1
    assert compared >= 10  # the walk compared most options, not none


def test_amp_is_mixed_on_the_command_line_as_everywhere(walk):
    # "amp", the older word for mixed precision that plan, the run file and the API take, was refused by estimate's
    # --precision: it gives the same figures as mixed.
    base = {**FORMS["hf"][1], "json": True}
    amp = walk.run("estimate", {**base, "precision": "amp"})
    mixed = walk.run("estimate", {**base, "precision": "mixed"})
    assert amp[0] == mixed[0] == 0, (amp[2], mixed[2])
    figures = [{k: v for k, v in json.loads(r[1]).items() if k in ("peak_bytes", "breakdown")} for r in (amp, mixed)]
    assert figures[0] == figures[1] and figures[0]["peak_bytes"] > 0
    assert json.loads(amp[1])["precision"] in ("amp", "mixed")  # taken, not ignored for the model's own fp32
