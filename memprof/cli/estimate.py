"""``memprof estimate`` (a factory's model or a config's, a training step or a generation) and ``memprof plan``:
which option goes with which form, the simulations they run, and the one verdict their text, JSON and exit status
give."""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING, Callable, Iterable

from ..errors import MemprofError, is_interrupt
from .common import device as _device
from .common import load_factory as _load_factory
from .common import mesh as _mesh
from .common import writable as _writable

if TYPE_CHECKING:
    import torch

    from ..record.estimate import Estimate

__all__ = ["cmd_estimate", "cmd_plan"]


def cmd_estimate(args: argparse.Namespace) -> int:
    from ..units import parse_size

    try:
        budget = parse_size(args.budget) if args.budget is not None else None  # refused before simulating
    except MemprofError as exc:
        if is_interrupt(exc):
            raise
        raise MemprofError(f"--budget: {exc}") from None
    if (args.hf is None) == (args.factory is None):
        raise MemprofError("give MODULE:FACTORY or --hf PATH_OR_ID (a model's config.json), one of them")
    _refuse_misplaced(args)
    from ..simulate.device_memory import check_target
    from ..simulate.routing import routing_of

    _device(args.device)
    check_target(args.gpu, args.device, args.alloc_conf)  # an unknown GPU or a bad conf, before simulating
    if args.routing is not None:
        routing_of(args.routing)  # 'banana' is refused with the spellings, before anything is built
    if args.hf is not None:
        return _estimate_hf(args, budget)
    return _estimate_factory(args, budget)


#: A training step's options, refused with ``--generate``: a generation runs on one device, with no backward and no
#: optimizer step.
_TRAINING = ("--seq-len", "--checkpointing", "--optimizer", "--step-context", "--world-size", "--parallel",
             "--parallelize", "--mesh", "--rank", "--extrapolate", "--train-step", "--loop", "--processes")


def _given(args: argparse.Namespace, flag: str) -> bool:
    value = getattr(args, flag[2:].replace("-", "_"))
    return value is not None and value is not False and not (flag == "--world-size" and value == 1)


#: Why ``--processes`` goes with a pipeline only.
_PROCESSES = "--processes says how many processes simulate a pipeline's rank classes (a factory's 'pipeline' key)"


def _refuse_misplaced(args: argparse.Namespace) -> None:
    """Refuse, naming it, an option of ``memprof estimate`` that does not apply to the form given (a factory or
    ``--hf``, a training step or ``--generate``): taken silently, it would change nothing."""
    if args.generate:
        for flag in (f for f in _TRAINING if _given(args, f)):
            raise MemprofError(f"{flag} is a training step's: leave it out with --generate (a generation runs on one "
                               "device with no backward or optimizer step; its lengths are --prompt-len and "
                               "--new-tokens)")
        if args.prompt_len is None or args.new_tokens is None:
            raise MemprofError("--generate needs --prompt-len N (the prompt's tokens) and --new-tokens M (tokens to "
                               "generate)")
    for flag in (f for f in ("--prompt-len", "--new-tokens") if not args.generate and _given(args, f)):
        raise MemprofError(f"{flag} goes with --generate (a generation's lengths); a training step generates nothing")
    for flag in (f for f in ("--seq-len", "--checkpointing") if args.hf is None and _given(args, f)):
        raise MemprofError(f"{flag} goes with --hf (the model a config describes); a factory builds its own batch "
                           "and model")
    for flag in (f for f in ("--mesh", "--rank") if args.hf is not None and not args.parallelize and _given(args, f)):
        raise MemprofError(f"{flag} goes with --parallelize MODULE:FUNCTION (the device mesh your function runs "
                           "on, and its rank to simulate; the --parallel layouts are simulated for rank 0)")
    if args.hf is not None and _given(args, "--processes"):
        raise MemprofError(f"{_PROCESSES}; --hf simulates no pipeline (memprof plan --processes searches a plan's "
                           "rows)")
    if args.loop is not None and args.train_step:
        raise MemprofError(f"--loop {args.loop} and --train-step each name the step to simulate: give one of them")
    if args.hf is not None and not args.generate and args.seq_len is None:
        raise MemprofError("--hf needs --seq-len N (tokens per sequence)")


def _estimate_factory(args: argparse.Namespace, budget: "int | None") -> int:
    """``memprof estimate MODULE:FACTORY``: a training step (or with ``--generate`` a generation) of what the
    factory builds on the meta device."""
    import torch

    from ..simulate.ranks import check_parallel

    parallelize = _load_factory(args.parallelize) if args.parallelize else None
    step_context = _load_factory(args.step_context) if args.step_context else None
    mesh = _mesh(args.mesh) if args.mesh else None
    # Without --parallel the factory may still say how the ranks share the model: checked once it is read.
    custom = parallelize is not None or args.parallel is None
    world_size, parallel = check_parallel(args.world_size, args.parallel, custom)
    factory = _load_factory(args.factory)
    # Built on the meta device: a 7B configuration costs no memory here.
    try:
        with torch.device("meta"):
            spec = factory(batch_size=args.batch_size)
    except Exception as exc:
        if is_interrupt(exc):
            raise
        raise MemprofError(f"{args.factory}(batch_size={args.batch_size}) raised {type(exc).__name__}: {exc}") from None
    if args.generate:
        return _estimate_generation(args, spec, budget)
    if isinstance(spec, torch.nn.Module):
        raise MemprofError(f"{args.factory} returned a model only; return a dict with 'model' and 'inputs' "
                           "(and optionally 'targets', 'loss_fn', 'optimizer'), or pass --generate to simulate "
                           "a generation with it")
    if not isinstance(spec, dict) or "model" not in spec or "inputs" not in spec:
        raise MemprofError(f"{args.factory} must return a dict with 'model' and 'inputs' keys")
    # The factory may say how the ranks share the model; the command line's flags win.
    parallelize = parallelize or spec.get("parallelize")
    mesh = mesh or spec.get("mesh")
    pipeline = spec.get("pipeline")
    if (parallelize is not None or pipeline is not None) and parallel is not None:
        raise MemprofError("--parallel and a parallelize function (or pipeline) both say how the ranks share the "
                           "model: give one")
    if mesh is not None and parallelize is None and pipeline is None:
        raise MemprofError("--mesh shapes the device mesh a parallelize function (or pipeline) runs on; give "
                           "--parallelize MODULE:FUNCTION (or the factory's 'parallelize' key) with it")
    if world_size > 1 and parallel is None and parallelize is None and pipeline is None:
        check_parallel(world_size, None)  # says what is missing
    if args.processes is not None and pipeline is None:
        raise MemprofError(f"{_PROCESSES}; {args.factory} gives none")
    train_step = _train_step(args) or spec.get("train_step")
    # The factory's loss_fn is memprof's loop's (and a named loop's but the HF Trainer's, which computes its own).
    loop = None if train_step is not None else args.loop
    options = dict(targets=spec.get("targets"), world_size=world_size, train_step=train_step, loop=loop,
                   loss_fn=None if train_step is not None or loop == "hf-trainer" else spec.get("loss_fn"),
                   parallel=parallel, parallelize=parallelize, mesh=mesh, pipeline=pipeline, processes=args.processes,
                   step_context=step_context or spec.get("step_context"),
                   routing=args.routing if args.routing is not None else spec.get("routing"))
    optimizer = spec.get("optimizer") or _optimizer(args.optimizer or "adamw")
    est = _simulated(args.factory, lambda: _estimate(args, spec["model"], optimizer, spec["inputs"], **options))
    return _emit(est, args, budget)


def _estimate(args: argparse.Namespace, model: object, optimizer: object, inputs: object, **options: object
              ) -> "Estimate":
    """:func:`memprof.estimate` with the options both forms take from the command line."""
    import memprof

    return memprof.estimate(model, optimizer, inputs=inputs, device=args.device, precision=args.precision,
                            attention=args.attention, gpu=args.gpu, alloc_conf=args.alloc_conf, rank=args.rank,
                            extrapolate=args.extrapolate, **options, **_from_file(args))


def _from_file(args: argparse.Namespace) -> "dict[str, object]":
    """What a ``--config`` file gives that no flag takes (``steps``, a generation's sampling): the simulation's
    keyword arguments of those names (:mod:`memprof.cli.config`)."""
    return dict(getattr(args, "file_options", None) or {})


def _simulated(source: str, run: "Callable[[], Estimate]") -> "Estimate":
    """``run()``, where anything but memprof's own refusal is one error naming what the factory returned."""
    try:
        return run()
    except MemprofError:
        raise
    except Exception as exc:
        if is_interrupt(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise MemprofError(f"simulating a step of what {source} returned raised {type(exc).__name__}: "
                           f"{first}; check that the model runs on its inputs (and loss_fn on its output)") from None


def _estimate_hf(args: argparse.Namespace, budget: "int | None") -> int:
    """``memprof estimate --hf``: a training step (or with ``--generate`` a generation) of the model a config
    describes, built on the meta device; every option of the factory form reaches it."""
    from ..report import planning
    from ..simulate import hf
    from ..simulate.hf_limits import check_sequence
    from ..simulate.ranks import check_parallel

    config = hf.load_config(args.hf)
    if args.generate:
        est = planning.estimate_hf_generation(config, batch_size=args.batch_size, prompt_len=args.prompt_len,
                                              max_new_tokens=args.new_tokens, precision=args.precision,
                                              device=args.device, attention=args.attention, gpu=args.gpu,
                                              alloc_conf=args.alloc_conf, routing=args.routing,
                                              names=("--prompt-len", "--new-tokens"), **_from_file(args))
        return _emit(est, args, budget)
    check_sequence(config, args.seq_len, "--seq-len")  # before building: named as the command line names it
    parallelize = _load_factory(args.parallelize) if args.parallelize else None
    step_context = _load_factory(args.step_context) if args.step_context else None
    world_size, parallel = check_parallel(args.world_size, args.parallel, parallelize is not None)
    est = planning.estimate_hf(config, seq_len=args.seq_len, batch_size=args.batch_size,
                               optimizer=_optimizer(args.optimizer or "adamw"), precision=args.precision,
                               checkpointing=args.checkpointing, device=args.device, attention=args.attention,
                               world_size=world_size, parallel=parallel, gpu=args.gpu, alloc_conf=args.alloc_conf,
                               routing=args.routing, parallelize=parallelize,
                               mesh=_mesh(args.mesh) if args.mesh else None, rank=args.rank,
                               extrapolate=args.extrapolate, step_context=step_context,
                               loop=args.loop or "hf-trainer", **_with_train_step(args, _from_file(args)))
    return _emit(est, args, budget)


def _train_step(args: argparse.Namespace) -> object:
    """The step ``--train-step`` names (a class made once, with no argument: a step that keeps state), or None."""
    if not args.train_step:
        return None
    step = _load_factory(args.train_step)
    return step() if isinstance(step, type) else step


def _with_train_step(args: argparse.Namespace, options: "dict[str, object]") -> "dict[str, object]":
    """``options`` with the step ``--train-step`` names (the flag over a run file's key)."""
    step = _train_step(args)
    return {**options, "train_step": step} if step is not None else options


def _optimizer(name: str) -> "Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None":
    """The optimizer factory ``--optimizer`` names (None for ``none``)."""
    import torch

    if name == "none":
        return None
    cls = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}[name]
    kwargs = {"lr": 0.1, "momentum": 0.9} if cls == "SGD" else {}
    # A partial of the class, which a plan's notes can name (a lambda read "as given").
    factory: "Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]" = functools.partial(
        getattr(torch.optim, cls), **kwargs)
    return factory


def cmd_plan(args: argparse.Namespace) -> int:
    from ..report.planning import plan_grid
    from ..simulate.device_memory import check_target

    if args.html is not None:
        _writable(args.html)
    check_target(args.gpu, None, args.alloc_conf)
    layouts: object = None
    if args.layouts and args.parallel:
        raise MemprofError("give --layouts or --parallel, not both (--layouts takes every name --parallel takes)")
    if args.layouts:
        layouts = args.layouts  # names and groups, resolved against the model once it is built
    elif args.parallel:
        from ..simulate.plan import data_parallel_layouts

        wanted = [p.strip().lower() for p in args.parallel.split(",") if p.strip()]
        known = {lay.name: lay for lay in data_parallel_layouts(args.world_size)}
        unknown = [p for p in wanted if p not in known]
        if unknown:
            raise MemprofError(f"--parallel: unknown layout {unknown[0]!r} for {args.world_size} rank(s); use "
                               + ", ".join(known))
        layouts = [known[p] for p in wanted]
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    ckpt = {"off": (False,), "on": (True,), "both": (False, True)}[args.checkpointing]
    from ..simulate import hf
    from ..simulate.hf_limits import check_sequence

    config = hf.load_config(args.hf)
    check_sequence(config, args.seq_len, "--seq-len")  # named as the command line names it
    try:
        grid = plan_grid(config, seq_len=args.seq_len, gpu=args.gpu, world_size=args.world_size, layouts=layouts,
                         precisions=precisions, checkpointing=ckpt, optimizer=_optimizer(args.optimizer),
                         alloc_conf=args.alloc_conf, attention=args.attention, loop=args.loop or "hf-trainer",
                         processes=args.processes)
    except MemprofError as exc:  # the names --layouts gave are resolved once the model is built
        if args.layouts and str(exc).startswith("unknown layout"):
            raise MemprofError(f"--layouts: {exc}") from None
        raise
    if args.html is not None:
        grid.export_html(args.html)
    if args.json:
        import json

        print(json.dumps(grid.to_dict()["rows"], indent=2))
    else:
        print(grid)
        if args.html is not None:
            print(f"\nplan written to {args.html}")
    return 0


def _estimate_generation(args: argparse.Namespace, spec: object, budget: "int | None") -> int:
    """``memprof estimate MODULE:FACTORY --generate``: prefill and decoding of the factory's model."""
    import torch

    import memprof

    model = spec.get("model") if isinstance(spec, dict) else spec
    if not isinstance(model, torch.nn.Module):
        raise MemprofError(f"{args.factory} must return a model (or a dict with 'model') for --generate")
    est = memprof.estimate_generation(model, batch_size=args.batch_size, prompt_len=args.prompt_len,
                                      max_new_tokens=args.new_tokens, precision=args.precision, device=args.device,
                                      attention=args.attention, gpu=args.gpu, alloc_conf=args.alloc_conf,
                                      routing=args.routing, **_from_file(args))
    return _emit(est, args, budget)


def _judged(est: "Estimate", budget: "int | None") -> "tuple[bool | None, int, int | None, str, str]":
    """What ``memprof estimate`` judges, one way for its text, its JSON and its exit status: (fits, the peak
    judged, the limit, the limit in words, why it does not fit beyond the figures). With ``--gpu`` the device-level
    peak (tensors, the allocator's cache, memory outside torch) against the GPU's memory or ``--budget``, whichever
    is smaller, and a batch whose simulated allocator runs out of memory never fits; without it the tensors' peak
    against ``--budget``; with neither, nothing is judged (fits None)."""
    from ..units import format_bytes

    memory = getattr(est, "device_memory", None)
    if memory is not None and memory.capacity is not None:
        gpu = f"{memory.gpu.name} ({format_bytes(memory.capacity)})"
        if budget is not None and budget < memory.capacity:
            limit, where = budget, format_bytes(budget)
        else:
            limit, where = memory.capacity, gpu
        oom = f": the {gpu} runs out of memory first" if memory.oom is not None else ""
        return memory.oom is None and memory.device_peak <= limit, memory.device_peak, limit, where, oom
    if budget is not None:
        return est.peak_bytes <= budget, est.peak_bytes, budget, format_bytes(budget), ""
    return None, est.peak_bytes, None, "", ""


def _emit(est: "Estimate", args: argparse.Namespace, budget: "int | None") -> int:
    """Print the estimate (its table, or with ``--json`` its data with ``fits`` and ``headroom`` as judged here)
    and return the exit status: 1 exactly when what :func:`_judged` judges does not fit."""
    fits, peak, limit, where, why = _judged(est, budget)
    if args.json:
        import json

        from ..render.plan import estimate_data

        data = estimate_data(est)
        if limit is not None:  # the verdict the exit status gives, and its headroom, against the same limit
            data.update(fits=fits, headroom=limit - peak)
        data["budget"] = budget
        print(json.dumps(data, indent=2))
        return 1 if fits is False else 0
    print(est)
    if limit is not None:
        from ..units import format_bytes

        memory = getattr(est, "device_memory", None)
        device = memory is not None and memory.capacity is not None
        print(f"\nbatch size {args.batch_size}: {'device' if device else 'estimated'} peak {format_bytes(peak)} "
              f"{'fits' if fits else 'does NOT fit'} in {where}"
              + (f", headroom {format_bytes(limit - peak)}" if device else "") + why)
    return 1 if fits is False else 0
