"""The ``memprof`` command: ``demo``, ``report``.

Exit codes: 0 success, 1 a memprof error (bad file, failed check), 2 bad usage
(argparse's own convention). Errors are one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from .errors import MemprofError

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch

    import memprof

    from .examples import TinyGPT, synthetic_tokens

    if args.device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device = args.device
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
    with memprof.profile(model, optimizer, mode=args.mode) as prof:
        for x, y in batches:
            loss = TinyGPT.loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
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

    report = memprof.load(args.file)
    print(report.to_text(top_modules=args.top))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memprof", description="Where does my PyTorch training memory go?")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

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
    demo.add_argument("--mode", choices=("auto", "full", "light"), default="auto",
                      help="full: exact, every storage; light: counters only; auto: full on CPU, light on GPU")
    demo.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1 ...")
    demo.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    demo.add_argument("--top", type=int, default=8, help="modules to list (default 8)")
    demo.add_argument("--save", metavar="PATH", help="also save the trace as JSON")
    demo.set_defaults(func=_cmd_demo)

    rep = sub.add_parser("report", help="print the report of a saved trace (JSON)")
    rep.add_argument("file", help="a JSON file written by report.save() or 'memprof demo --save'")
    rep.add_argument("--top", type=int, default=8, help="modules to list (default 8)")
    rep.set_defaults(func=_cmd_report)
    return parser


def main(argv: "Sequence[str] | None" = None) -> int:
    """Entry point of the ``memprof`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "layers", "hidden", "heads", "vocab", "threads"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    try:
        return int(args.func(args))
    except MemprofError as exc:
        print(f"memprof: error: {exc}", file=sys.stderr)
        return 1
    except FileNotFoundError as exc:
        print(f"memprof: error: no such file: {exc.filename}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
