"""The ``memprof`` command: ``demo``, ``report``, ``export``, ``diff``, ``estimate``.

Exit codes: 0 success, 1 a memprof error (bad file, failed check), 2 bad usage
(argparse's own convention). Errors are one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from ..errors import MemprofError, is_interrupt
from .common import device as _device
from .common import not_the_input as _not_the_input
from .common import writable as _writable
from ..simulate.loops import LOOPS
from .config import check_required as _check_required
from .config import with_config as _with_config
from .estimate import cmd_estimate as _cmd_estimate
from .estimate import cmd_plan as _cmd_plan

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch

    import memprof

    from ..demo import TinyGPT, synthetic_tokens

    if args.hidden % args.heads:
        raise MemprofError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads} (each head gets "
                           "hidden / heads dimensions)")
    if args.save:
        _writable(args.save)  # refuse before the run, not after it
    if args.device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device = str(_device(args.device))
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise MemprofError(f"--device {args.device}: this torch sees no CUDA device; use --device cpu")
    if device == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), args.threads)))
    torch.manual_seed(0)
    model = TinyGPT(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                    max_seq=max(args.seq_len, 8)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [synthetic_tokens(args.batch_size, args.seq_len, args.vocab, device=device, seed=i)
               for i in range(args.steps)]
    print(f"memprof demo: TinyGPT ({sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{args.layers} layers, hidden {args.hidden}) on {device}, batch {args.batch_size}, "
          f"sequence {args.seq_len}, AdamW, {args.steps} steps, mode {args.mode}")
    began = time.perf_counter()
    try:
        with memprof.profile(model, optimizer, mode=args.mode) as prof:
            for x, y in batches:
                loss = TinyGPT.loss(model(x), y)
                loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is untyped
                optimizer.step()
                optimizer.zero_grad()
    except (RuntimeError, MemoryError) as exc:  # an out-of-memory above all: a smaller demo fits
        if is_interrupt(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise MemprofError(f"the demo's training raised {type(exc).__name__}: {first}; try a smaller "
                           "--batch-size, --seq-len or --hidden") from None
    elapsed = time.perf_counter() - began
    report = prof.report()
    print(f"({elapsed:.1f} s)\n")
    print(report.to_text(top_modules=args.top))
    if args.save:
        report.save(args.save)
        print(f"\ntrace saved to {args.save}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    import memprof

    if args.html:
        _writable(args.html)
        _not_the_input(args.html, args.file)
    report = memprof.load(args.file)
    print(report.to_text(top_modules=args.top))  # first: a refused HTML file still leaves the text
    if args.html:
        report.export_html(args.html)
        print(f"\nHTML report written to {args.html}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    import memprof

    wanted = [(path, how) for path, how in ((args.chrome, "export_chrome_trace"),
                                            (args.memory_viz, "export_memory_viz"),
                                            (args.html, "export_html")) if path]
    if not wanted:
        raise MemprofError(
            "say what to write: --chrome trace.json, --memory-viz snapshot.pickle and/or --html out.html")
    for path, _ in wanted:
        _writable(path)  # all refused before any is written
        _not_the_input(path, args.file)
    outputs = [os.path.realpath(path) for path, _ in wanted]  # two links to one file are one output
    if len(set(outputs)) < len(outputs):
        raise MemprofError("two outputs name the same file; give each export its own file")
    report = memprof.load(args.file)
    for path, how in wanted:
        getattr(report, how)(path)
        print(f"wrote {path}")
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from ..report import diff

    print(diff(args.a, args.b, labels=(args.a, args.b)))
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from ..report import merge

    merged = merge(args.files)
    if args.json:
        import json

        print(json.dumps(merged.to_dict(), indent=1))
    else:
        print(merged)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memprof", description="Where does my PyTorch training memory go?")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _reading_commands(sub)
    _estimate_command(sub)
    _plan_command(sub)
    return parser


def _reading_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``demo``, and the commands that read saved traces: ``report``, ``export``, ``diff``, ``merge``."""
    demo = sub.add_parser("demo", help="profile a small built-in GPT for a few steps and print the anatomy",
                          description="Train a small built-in GPT-style model on synthetic tokens with AdamW "
                                      "(CUDA when available, else CPU) and print the measured anatomy.")
    demo.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    demo.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default 8)")
    demo.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    demo.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    demo.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    demo.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    demo.add_argument("--vocab", type=int, default=1000, help="vocabulary size (default 1000)")
    demo.add_argument("--mode", choices=("auto", "exact", "light"), default="auto",
                      help="exact: every storage, to the byte; light: counters only; auto: exact on CPU, light on GPU")
    demo.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1 ...")
    demo.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    demo.add_argument("--top", type=int, default=8, help="modules to list (default 8)")
    demo.add_argument("--save", metavar="PATH", help="also save the trace as JSON")
    demo.set_defaults(func=_cmd_demo, parser=demo)

    rep = sub.add_parser("report", help="print the report of a saved trace (JSON)")
    rep.add_argument("file", help="a JSON file written by report.save() or 'memprof demo --save'")
    rep.add_argument("--top", type=int, default=8, help="modules to list (default 8)")
    rep.add_argument("--html", metavar="PATH", help="also write the report as one self-contained HTML file")
    rep.set_defaults(func=_cmd_report)

    exp = sub.add_parser("export", help="write a saved trace for other viewers: Perfetto, memory_viz, HTML",
                         description="Write a saved trace as a Chrome trace (ui.perfetto.dev, chrome://tracing), "
                                     "a memory_viz snapshot (pytorch.org/memory_viz) and/or a standalone HTML "
                                     "report.")
    exp.add_argument("file", help="a JSON file written by report.save(), 'memprof demo --save' or an OOM dump")
    exp.add_argument("--chrome", metavar="PATH", help="Chrome/Perfetto trace (JSON)")
    exp.add_argument("--memory-viz", metavar="PATH", help="memory_viz snapshot (pickle)")
    exp.add_argument("--html", metavar="PATH", help="standalone HTML report")
    exp.set_defaults(func=_cmd_export)

    dif = sub.add_parser("diff", help="compare two saved traces: what grew and shrank, per category and phase")
    dif.add_argument("a", help="the baseline trace (JSON)")
    dif.add_argument("b", help="the trace to compare with it (JSON)")
    dif.set_defaults(func=_cmd_diff)

    mer = sub.add_parser("merge", help="the saved traces of the ranks of one distributed run, side by side")
    mer.add_argument("files", nargs="+", help="one trace (JSON) per rank")
    mer.add_argument("--json", action="store_true", help="the merge as JSON (worst rank, spread, each rank's peak)")
    mer.set_defaults(func=_cmd_merge)


def _estimate_command(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``estimate``: a training step or a generation simulated, from a factory, a config or a run file."""
    est = sub.add_parser("estimate", help="simulate a training step of a model from your factory (meta tensors)",
                         description="Call FACTORY(batch_size=N) from MODULE under torch.device('meta') and "
                                     "simulate two training steps without real memory. The factory returns a "
                                     "dict: model, inputs, and optionally targets, loss_fn, optimizer.")
    est.add_argument("factory", metavar="MODULE:FACTORY", nargs="?", help="for example mypkg.models:build")
    est.add_argument("--hf", metavar="PATH_OR_ID", help="instead of a factory: a transformers model from its config "
                     "(a folder holding config.json, the file, or a cached hub id), built on the meta device")
    est.add_argument("--seq-len", type=int, help="with --hf: tokens per sequence")
    est.add_argument("--checkpointing", action="store_true",
                     help="with --hf: transformers' activation checkpointing on every layer")
    est.add_argument("--json", action="store_true", help="print the result as JSON ('fits' is the verdict the exit "
                     "status gives)")
    est.add_argument("--config", metavar="RUN.toml", help="a TOML or JSON file of the run's sections (model or hf, "
                     "precision, [workload] or [generation], [target], [parallelism], [depth]: docs/cli.md); a flag "
                     "given beside it overrides the file's value")
    est.add_argument("--batch-size", type=int, help="batch size handed to the factory (required, here or in the "
                     "--config file)")
    est.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "none"), default=None,
                     help="optimizer when the factory gives none (default adamw); a training step's only")
    est.add_argument("--device", default="cuda", help="device the figures are for (default cuda: 512-byte blocks)")
    est.add_argument("--precision", choices=("fp32", "bf16", "fp16", "mixed", "amp", "mixed-fp16"), default=None,
                     help="cast the parameters (fp32, bf16, fp16), or keep them fp32 and run the forward under "
                          "autocast (mixed, or amp as plan and the run file also say it: bf16; mixed-fp16: fp16 with "
                          "a GradScaler); default: as built")
    est.add_argument("--attention", choices=("auto", "flash", "efficient", "math"), default="auto",
                     help="attention kernel of a CUDA target (default auto: the one torch's CUDA dispatcher picks)")
    est.add_argument("--world-size", type=int, default=1,
                     help="ranks of a data-parallel job: the figures are one rank's, --batch-size its batch")
    est.add_argument("--parallel", type=str.lower, choices=("ddp", "fsdp", "fsdp1", "zero1", "zero2", "zero3"),
                     default=None, help="how the ranks share the model (needed with --world-size above 1; fsdp1 runs "
                                        "FSDP1's own code on torch's fake process group)")
    est.add_argument("--parallelize", metavar="MODULE:FUNCTION",
                     help="your own fn(model, mesh) -> model (fully_shard, parallelize_module ...), run on a device "
                          "mesh of --world-size ranks on torch's fake process group; the factory's 'parallelize' "
                          "key does the same (and its 'pipeline' key takes a memprof.Pipeline)")
    est.add_argument("--step-context", metavar="MODULE:FUNCTION",
                     help="the context your loop enters around forward, loss and backward: a function returning it, "
                          "called with no argument (torch's loss_parallel) or with the step's parts (.model, .mesh, "
                          ".inputs, .targets, .optimizer: context_parallel(step.mesh, buffers=[step.inputs], ...)); "
                          "the factory's 'step_context' key does the same")
    est.add_argument("--train-step", metavar="MODULE:FUNCTION",
                     help="your own training step, fn(model, optimizer, inputs[, targets]), simulated in place of "
                          "memprof's loop (what it returns is held until its next call; the factory's 'loss_fn' is "
                          "not used: your step computes its loss); a class is made once, with no argument; the "
                          "factory's 'train_step' key does the same")
    est.add_argument("--loop", choices=LOOPS, default=None,
                     help="the training loop simulated, a framework's own step: hf-trainer (the default with --hf: "
                          "transformers' Trainer.training_step as installed, max_grad_norm 1.0), accelerate, plain "
                          "(memprof's own loop: the default with a factory), lightning or torchtitan (refused, "
                          "saying why); not with --train-step")
    est.add_argument("--routing", help="what MoE routers choose: balanced (default), worst or capacity=F; under expert "
                     "parallelism it also sizes the all-to-all's receive side (the factory's 'routing' key may give "
                     "a recorded routing)")
    est.add_argument("--mesh", help="the mesh's dimensions, e.g. pp=2,dp=64,tp=8 (default: one of --world-size)")
    est.add_argument("--rank", type=int, default=None,
                     help="the rank to simulate (default 0; with a pipeline, every stage and the worst)")
    est.add_argument("--extrapolate", type=int, default=None, metavar="K",
                     help="simulate the repeated blocks cut to K, K+1, K+2 (per stage) and extend to the full depth")
    est.add_argument("--processes", type=int, default=None, metavar="N",
                     help="processes simulating a pipeline's rank classes (a factory's 'pipeline' key), each forked "
                          "from this one (default: one per class, at most twice the cores; 1: all in this process); "
                          "the figures are the same")
    est.add_argument("--budget", help="exit 1 if the estimated peak exceeds this size (e.g. '80 GiB'); with --gpu "
                     "the device-level peak is judged against it")
    est.add_argument("--gpu", help="the CUDA GPU the figures are for (e.g. h100-80gb): the device-level peak "
                     "(allocator cache and memory outside torch included) against its memory; "
                     "exit 1 if it does not fit")
    est.add_argument("--alloc-conf", metavar="CONF", help="PYTORCH_CUDA_ALLOC_CONF for the allocator model (default: "
                     "the environment's), e.g. expandable_segments:True")
    est.add_argument("--generate", action="store_true",
                     help="simulate a generation (prefill and decoding, the KV cache) instead of a training step")
    est.add_argument("--prompt-len", type=int, help="with --generate: tokens in the prompt")
    est.add_argument("--new-tokens", type=int, help="with --generate: tokens to generate")
    est.set_defaults(func=_cmd_estimate, parser=est)


def _plan_command(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``plan``: the largest batch per layout, precision and checkpointing, for a config on a GPU."""
    pla = sub.add_parser("plan", help="the largest batch that fits a GPU, per layout, precision and checkpointing",
                         description="For the model a transformers config describes, built on the meta device: for "
                                     "each data-parallel layout of --world-size ranks, precision and activation "
                                     "checkpointing setting, the largest batch per rank whose device-level peak "
                                     "fits --gpu, found and confirmed by simulation.")
    pla.add_argument("--config", metavar="RUN.toml", help="a TOML or JSON file of the run's sections (hf, precision, "
                     "[workload] seq_len, optimizer, checkpointing, [target], [parallelism] world_size, parallel: "
                     "docs/cli.md); a flag given beside it overrides the file's value")
    pla.add_argument("--hf", metavar="PATH_OR_ID",
                     help="a folder holding config.json, the file, or a cached hub id (required, here or in the "
                          "--config file)")
    pla.add_argument("--seq-len", type=int, help="tokens per sequence (required, here or in the --config file)")
    pla.add_argument("--gpu", help="the CUDA GPU of every rank (e.g. h100-80gb; required, here or in the --config "
                     "file)")
    pla.add_argument("--world-size", type=int, default=1, help="ranks (default 1)")
    pla.add_argument("--parallel", metavar="LIST", help="layouts to plan, comma-separated (default: every layout "
                     "for the world size: ddp,fsdp,zero1,zero2,zero3)")
    pla.add_argument("--layouts", metavar="LIST", help="layouts to plan, comma-separated: names (ddp, fsdp, "
                     "zero1-3, tp8, fsdp4-tp2, pp2-fsdp4, pp4, fsdp-ep4 ...) and groups (dp: the data-parallel ones, "
                     "the default; tp: every tensor-parallel layout the model's TP plan allows on --world-size ranks; "
                     "pp: every pipeline layout its pipeline plan allows, whose batch is the micro-batch's size; ep: "
                     "every expert-parallel layout a mixture-of-experts model's EP plan allows, routed by the balanced "
                     "assumption; all)")
    pla.add_argument("--precision", metavar="LIST", default="bf16,mixed",
                     help="precisions to plan, comma-separated (default bf16,mixed): bf16, fp16, fp32 (parameters, "
                          "gradients and optimizer states in that dtype); bf16-params (FSDP2's MixedPrecisionPolicy("
                          "param_dtype=bf16, reduce_dtype=fp32) over fp32 shards: layouts with FSDP2 only); autocast "
                          "(fp32 parameters, the forward under bf16 autocast); mixed-fp16; mixed is bf16-params on a "
                          "layout with FSDP2 and autocast on the others, amp is autocast")
    pla.add_argument("--checkpointing", choices=("off", "on", "both"), default="both",
                     help="activation checkpointing (default both)")
    pla.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw",
                     help="the optimizer (default adamw): a plan is of training steps, which take one")
    pla.add_argument("--attention", choices=("auto", "flash", "efficient", "math"), default="auto",
                     help="attention kernel (default auto: the one torch's CUDA dispatcher picks)")
    pla.add_argument("--alloc-conf", metavar="CONF", help="PYTORCH_CUDA_ALLOC_CONF for the allocator model")
    pla.add_argument("--loop", choices=LOOPS, default=None,
                     help="the training loop simulated in every layout but a pipeline's (default hf-trainer: "
                          "transformers' Trainer.training_step as installed; plain: memprof's own loop)")
    pla.add_argument("--processes", type=int, default=None, metavar="N",
                     help="processes searching the rows (default: one per group of rows that share no simulation, a "
                          "precision and family of layouts, at most twice the cores; 1: every row in this process)")
    pla.add_argument("--json", action="store_true", help="print the rows as JSON")
    pla.add_argument("--html", metavar="PATH", help="also write the grid as a standalone HTML page")
    pla.set_defaults(func=_cmd_plan, parser=pla)


def main(argv: "Sequence[str] | None" = None) -> int:
    """Entry point of the ``memprof`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "config", None) is not None:  # the file's values are the defaults the flags override
            args = _with_config(parser, args, argv)
        _check_required(args)
        for name in ("steps", "batch_size", "seq_len", "layers", "hidden", "heads", "vocab", "threads", "top",
                     "world_size", "prompt_len", "new_tokens"):
            value = getattr(args, name, None)
            if value is not None and value < 1:
                getattr(args, "parser", parser).error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        return int(args.func(args))
    except BrokenPipeError as exc:
        # The reader went away (memprof report run.json | head): stop quietly, as a Unix tool killed by
        # SIGPIPE does, and keep Python from complaining about stdout at exit.
        if is_interrupt(exc):
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13
    except MemprofError as exc:
        if is_interrupt(exc):
            raise
        _error(str(exc))
        return 1
    except FileNotFoundError as exc:
        if is_interrupt(exc):
            raise
        _error(f"no such file: {exc.filename}")
        return 1
    except OSError as exc:
        if is_interrupt(exc):
            raise
        _error(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc))
        return 1


def _error(message: str) -> None:
    from ..units import one_line

    # One line, whatever the message quotes (a file name, a module's name with a newline in it).
    print(f"memprof: error: {one_line(message)}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
