"""``--config FILE``: a run file (:mod:`memprof.simulate.run_file`) gives ``memprof estimate`` and ``memprof plan``
their options. Each of the file's values becomes the default of the option of the same name, so that a flag given
beside ``--config`` overrides it (argparse takes a default only where the flag is absent); a key no flag takes
(``steps``, ``[generation]``'s sampling) goes to the simulation as the keyword argument of its name."""

from __future__ import annotations

import argparse
from typing import Callable, Sequence

from ..errors import InvalidArgumentError, MemprofError, is_interrupt

__all__ = ["with_config", "check_required", "FLAG_ONLY", "PLAN_KEYS"]

#: A file's key whose option has another name: (section, key) -> the option's dest.
_DESTS = {("", "model"): "factory", ("generation", "max_new_tokens"): "new_tokens"}

#: The options of ``memprof estimate`` no file key gives, each with why: they say what to print or judge, or which
#: file to read, not what runs.
FLAG_ONLY = {
    "config": "the file itself",
    "json": "how the result is printed, not what runs",
    "budget": "a limit the result is judged against, not part of the run",
    "generate": "a [generation] section in place of [workload] says it",
    "html": "where a plan's page is written, not part of the run",
    "layouts": "the layouts a plan compares (a grid, not one run); [parallelism] parallel names one",
    "processes": "how many processes search a plan's rows or simulate a pipeline's rank classes (the figures are the "
                 "same), not what runs",
}

#: What ``memprof plan`` takes from a file: a training step of a transformers config, the batch size searched.
PLAN_KEYS = {("", "hf"), ("", "precision"), ("workload", "seq_len"), ("workload", "optimizer"),
             ("workload", "checkpointing"), ("workload", "loop"), ("target", "gpu"), ("target", "attention"),
             ("target", "alloc_conf"),
             ("parallelism", "world_size"), ("parallelism", "parallel")}

#: The options a command needs, from the command line or the file: (dest, the flag, the file's key).
_REQUIRED = {"estimate": (("batch_size", "--batch-size", "[workload] or [generation] batch_size"),),
             "plan": (("hf", "--hf", "hf"), ("seq_len", "--seq-len", "[workload] seq_len"),
                      ("gpu", "--gpu", "[target] gpu"))}


def with_config(parser: argparse.ArgumentParser, args: argparse.Namespace,
                argv: "Sequence[str] | None") -> argparse.Namespace:
    """``args`` parsed again with the file ``args.config`` names giving the defaults of the options it sets."""
    from ..simulate.run_file import read_run_file

    run = read_run_file(args.config)
    sub: argparse.ArgumentParser = args.parser
    dests = {action.dest for action in sub._actions}
    defaults: dict[str, object] = {}
    rest: dict[str, object] = {}
    chosen = getattr(args, "factory", None) is not None or args.hf is not None  # the command line says which model
    for (section, key), value in run.given().items():
        if args.command == "plan":
            defaults.update(_plan_default(run.path, section, key, value))
            continue
        if key in ("model", "hf") and not section and chosen:
            continue
        dest = _DESTS.get((section, key), key)
        if dest in dests:
            defaults[dest] = _as_flag(dest, value)
        else:  # no flag: the simulation's keyword argument of that name
            rest[key] = _loaded(value) if key == "train_step" else value
    if run.generates and args.command == "estimate":
        defaults["generate"] = True
    sub.set_defaults(file_options=rest, **defaults)
    return parser.parse_args(argv)


def check_required(args: argparse.Namespace) -> None:
    """Refuse, as argparse refuses a missing option (exit status 2), what neither the command line nor the file
    gave."""
    for dest, flag, key in _REQUIRED.get(args.command, ()):
        if getattr(args, dest, None) is None and not (dest == "hf" and getattr(args, "factory", None)):
            where = f" (or {key} in the --config file)" if getattr(args, "config", None) else ""
            args.parser.error(f"the following arguments are required: {flag}{where}")


def _as_flag(dest: str, value: object) -> object:
    """A file's value as the option's own parsing gives it: a mesh as ``pp=2,dp=4``."""
    if dest == "mesh" and isinstance(value, dict):  # (the run file's reader made it a dict of sizes)
        return ",".join(f"{name}={size}" for name, size in value.items())
    return value


def _plan_default(path: str, section: str, key: str, value: object) -> "dict[str, object]":
    where = f"[{section}] {key}" if section else key
    if (section, key) not in PLAN_KEYS:
        raise InvalidArgumentError(
            f"{path}: {where} is not for memprof plan, which plans training steps of a transformers config (hf) "
            "over layouts, precisions and checkpointing, searching the batch size; leave it out, or run memprof "
            "estimate --config with this file; memprof plan takes "
            + ", ".join(f"[{s}] {k}" if s else k for s, k in sorted(PLAN_KEYS)))
    if key == "checkpointing":
        return {"checkpointing": "on" if value else "off"}
    if key == "optimizer" and value == "none":
        raise InvalidArgumentError(f"{path}: {where} = \"none\" is not for memprof plan: a plan is of training "
                                   "steps, which take an optimizer; give adamw, adam or sgd")
    return {key: value}


def _loaded(spec: str) -> Callable[..., object]:
    from .common import load_factory

    try:
        return load_factory(spec)
    except MemprofError as exc:
        if is_interrupt(exc):
            raise
        raise MemprofError(f"train_step: {exc}") from None
