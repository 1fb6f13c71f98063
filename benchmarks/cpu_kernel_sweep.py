"""Which CPU kernels return outputs whose storage is larger (or smaller) than the shape-only kernels' own.

A simulation for a CPU target runs every op on fake CPU tensors: torch's meta kernels and decompositions,
which allocate exactly the output's shape. A real CPU kernel may keep more: ``F.mse_loss`` returns a
0-dim loss whose storage is the whole elementwise buffer. This sweep finds every such op in torch's own
operator samples and checks memprof's CPU rules (:mod:`memprof.simulate.cpu_kernels`) against them.

Run from the repository root::

    python benchmarks/cpu_kernel_sweep.py                               # every OpInfo, fp32 and bf16
    python benchmarks/cpu_kernel_sweep.py --ops nn.functional.mse_loss  # some OpInfos (names as in op_db)
    python benchmarks/cpu_kernel_sweep.py --ops ... --max-samples 12    # a few samples of each, spread out
    python benchmarks/cpu_kernel_sweep.py --mixed                       # bf16 inputs, fp32 parameters
    python benchmarks/cpu_kernel_sweep.py --json benchmarks/results/cpu-kernel-sweep.json \\
        --markdown benchmarks/results/cpu-kernel-sweep.md

What is compared
----------------
For each OpInfo of ``torch.testing._internal.common_methods_invocations.op_db``, each dtype asked for
that the OpInfo supports on CPU, and each of its ``sample_inputs(device="cpu", dtype=...)``: the sample
runs forward without gradients, and, where the OpInfo supports autograd in that dtype, forward and
backward with them (``torch.autograd.grad`` of its floating outputs, with gradients of ones); each once
on real CPU tensors and once on fake CPU tensors (``FakeTensorMode``, as ``memprof.estimate`` runs them),
under a dispatch mode that records every aten op and, for each tensor it returns, the
``untyped_storage().nbytes()`` memprof's exact mode counts and the strides (a layout that makes a later
op copy on one side only changes the bytes too). The two records are compared op by op, and a second
time with memprof's CPU rules (:mod:`memprof.simulate.cpu_kernels`) applied to the fake run. ``--mixed``
runs the float32 samples with their input in bfloat16 instead: the mixed dtypes CPU kernels meet under
autocast. The exit status is 1 when, with the rules, an output still differs in bytes, a rule breaks a
fake kernel, or a sample calls other ops and allocates other bytes.

A sample whose fake run fails (data-dependent output shapes, ops without fake kernels) cannot be
simulated at all and is counted apart; so is a sample whose real and fake runs call different ops.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import types
import unittest
import warnings
from typing import Any

from _machine import command_line, import_memprof, write_results  # run as a script from this folder

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


def _load_op_db() -> list[Any]:
    """torch's operator samples. Its test helpers import ``expecttest`` for a TestCase base class with
    inline expectations, which the samples never use: a stand-in serves where it is not installed."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        sys.modules["expecttest"] = types.SimpleNamespace(TestCase=unittest.TestCase, ACCEPT=False)  # type: ignore
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def _storage(t: torch.Tensor, known: "set[int]") -> "tuple[int, tuple, int, bool] | None":
    """The storage bytes of ``t``, its layout in memory (the strides of the dimensions longer than 1,
    which decide whether a later ``view``/``reshape``/``contiguous`` copies), its element count, and
    whether its storage is new (not in ``known``, the storages of the op's arguments)."""
    if t.layout != torch.strided or t.is_nested:
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return None
    return (st.nbytes(), tuple(s if n > 1 else None for n, s in zip(t.shape, t.stride())), t.numel(),
            st._cdata not in known)


def _storages(tensors: Any) -> "set[int]":
    out = set()
    for t in tree_leaves(tensors):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            try:
                out.add(t.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):
                pass
    return out


class _Recorder(TorchDispatchMode):
    """Every aten op called beneath it, with the storage of each tensor it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        known = _storages((args, kwargs))
        made = tuple(_storage(t, known) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        if made:  # queries that return no tensor (fake tensors answer prim.device through dispatch) are no ops
            self.ops.append((func, made))
        return out


def _run(op: Any, sample: Any, backward: bool) -> None:
    """The sample forward, and backward through its floating outputs where asked."""
    out = op(sample.input, *sample.args, **sample.kwargs)
    if not backward:
        return
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None
            and (t.is_floating_point() or t.is_complex())]
    leaves = [t for t in tree_leaves((sample.input, sample.args, sample.kwargs))
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs and leaves:
        torch.autograd.grad(outs, leaves, grad_outputs=[torch.ones_like(t) for t in outs], allow_unused=True)


def _record_real(op: Any, sample: Any, backward: bool) -> list[tuple[Any, tuple]]:
    rec = _Recorder()
    torch.manual_seed(0)
    with rec:
        _run(op, sample, backward)
    return rec.ops


def _record_fake(op: Any, sample: Any, backward: bool, rules: Any) -> list[tuple[Any, tuple]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(x: Any) -> Any:
        return mode.from_tensor(x) if isinstance(x, torch.Tensor) else x

    faked = types.SimpleNamespace(input=tree_map(fake, sample.input), args=tree_map(fake, sample.args),
                                  kwargs=tree_map(fake, sample.kwargs))
    rec = _Recorder()
    torch.manual_seed(0)
    # The fake mode is an infrastructure mode, beneath every plain one: the recorder sees the ops as
    # memprof's profiler does in a simulation, above the rules when they are given.
    with mode, (rules() if rules is not None else _Nothing()), rec:
        _run(op, faked, backward)
    return rec.ops


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _describe(sample: Any) -> str:
    def one(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"T{tuple(x.shape)}:{str(x.dtype).replace('torch.', '')}"
        return repr(x)[:40]

    parts = [one(sample.input)] + [one(a) for a in sample.args] + [f"{k}={one(v)}" for k, v in sample.kwargs.items()]
    return ", ".join(parts)


class _Sweep:
    """What the sweep found, op by op."""

    def __init__(self) -> None:
        self.samples = 0
        self.fake_failed: collections.Counter[str] = collections.Counter()
        self.real_failed: collections.Counter[str] = collections.Counter()
        # OpInfo -> [samples whose fake run called other ops than the real one, bytes of outputs the fake runs
        # made more (negative: fewer)], without and with the rules
        self.diverged: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        self.diverged_ruled: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        # aten op -> list of (OpInfo, dtype, sample, real bytes, fake bytes)
        self.differ: dict[str, list[tuple[str, str, str, int, int]]] = collections.defaultdict(list)
        self.residual: dict[str, list[tuple[str, str, str, int, int]]] = collections.defaultdict(list)
        self.ruled_samples: collections.Counter[str] = collections.Counter()
        self.ruled_failed: collections.Counter[str] = collections.Counter()
        # aten op -> list of (OpInfo, dtype, sample, real strides, fake strides), after the rules when given
        self.strides: dict[str, list[tuple[str, str, str, Any, Any]]] = collections.defaultdict(list)
        self.checked = False  # whether the fake runs were repeated with memprof's rules

    @staticmethod
    def compare(real: list, fake: list, what: int = 0) -> "list[tuple[str, Any, Any]] | None":
        """The outputs whose storage bytes (``what=0``) or strides (``what=1``; of tensors with elements)
        differ, as (``op[index]``, real, fake), or None where the two runs did not call the same ops."""
        if [f for f, _ in real] != [f for f, _ in fake]:
            return None
        out = []
        for (func, rs), (_, fs) in zip(real, fake):
            for i, (r, f) in enumerate(zip(rs, fs)):
                if r is not None and f is not None and r[what] != f[what] and (what == 0 or r[2] and f[2]):
                    out.append((f"{func}[{i}]" if len(rs) > 1 else str(func), r[what], f[what]))
        return out

    def add(self, name: str, dtype: str, sample: Any, real: list, fake: list, ruled: "list | None") -> None:
        """One sample's records: real, fake, and fake with memprof's rules (None: not checked)."""
        self.samples += 1
        what = _describe(sample)
        found = self.compare(real, fake)
        if found is None:
            _count(self.diverged[name], _bytes(fake) - _bytes(real))
        for func, r, f in found or ():
            self.differ[func].append((name, dtype, what, r, f))
        final = fake if ruled is None else ruled
        for func, r, f in self.compare(real, final, 1) or ():
            self.strides[func].append((name, dtype, what, r, f))
        if ruled is None:
            return
        self.checked = True
        left = self.compare(real, ruled)
        if left is None:
            _count(self.diverged_ruled[name], _bytes(ruled) - _bytes(real))
            return
        if found:
            self.ruled_samples[name] += 1
        for func, r, f in left:
            self.residual[func].append((name, dtype, what, r, f))


def _count(tally: list[int], extra: int) -> None:
    tally[0] += 1
    tally[1] += extra


def _bytes(record: list) -> int:
    """The bytes of the new storages the ops of a record made (views and in-place results are not new):
    where the two runs called other ops, the difference says which run allocated more."""
    return sum(o[0] for _, outs in record for o in outs if o is not None and o[3])


def _spread(samples: list, most: "int | None") -> list:
    """At most ``most`` of ``samples``, spread over the list (OpInfos order their samples by kind)."""
    if most is None or len(samples) <= most:
        return samples
    return [samples[i * len(samples) // most] for i in range(most)]


def _mixed(sample: Any) -> Any:
    """``sample`` with its input in bf16 and every other tensor as it is (fp32): what a bf16 activation meets
    in fp32 parameters, under CPU autocast (BatchNorm after a bf16 convolution) or in a model that keeps its
    norms in fp32. None where the input is not a floating tensor."""
    x = sample.input
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        return None
    low = x.detach().to(torch.bfloat16).requires_grad_(x.requires_grad)
    return types.SimpleNamespace(input=low, args=sample.args, kwargs=sample.kwargs)


def sweep(names: "set[str] | None", dtypes: list[torch.dtype], backward: bool, rules: Any,
          progress: bool, most: "int | None" = None, mixed: bool = False) -> _Sweep:
    result = _Sweep()
    ops = [op for op in _load_op_db() if names is None or _name(op) in names or op.name in names]
    for i, op in enumerate(ops):
        name = _name(op)
        if progress:
            print(f"[{i + 1}/{len(ops)}] {name}", file=sys.stderr, flush=True)
        for dtype in dtypes:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            grad = backward and op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")
            # Without gradients (inference; some kernels take another path) and, where autograd applies,
            # forward and backward with gradients.
            for with_grad in (False, True) if grad else (False,):
                try:
                    samples = list(op.sample_inputs("cpu", dtype, requires_grad=with_grad))
                except Exception:  # a sample generator torch's own tests skip on this build
                    result.real_failed[name] += 1
                    continue
                for sample in _spread(samples, most):
                    if mixed:
                        sample = _mixed(sample)
                        if sample is None:
                            continue
                    _one(result, op, name, dtype, sample, with_grad, rules, "bf16 input, " if mixed else "")
    return result


def _one(result: _Sweep, op: Any, name: str, dtype: torch.dtype, sample: Any, grad: bool, rules: Any,
         label: str = "") -> None:
    """One sample, really and on fake tensors (with and without the rules), into ``result``."""
    try:
        real = _record_real(op, sample, grad)
    except Exception:  # a sample this kernel refuses: nothing to compare
        result.real_failed[name] += 1
        return
    try:
        fake = _record_fake(op, sample, grad, None)
    except Exception:  # no fake kernel, data-dependent shapes: not simulable
        result.fake_failed[name] += 1
        return
    ruled = None
    # The rules change only the ops they name: a run that calls none of them is the plain fake run again.
    if rules is not None and any(func in rules.ops for func, _ in real + fake):
        try:
            ruled = _record_fake(op, sample, grad, rules.mode)
        except Exception:  # a rule that breaks a fake kernel: reported, and the exit status is 1
            result.ruled_failed[name] += 1
            return
    elif rules is not None:
        ruled = fake
    result.add(name, label + str(dtype).replace("torch.", "") + (" grad" if grad else ""), sample, real, fake, ruled)
    return result


def _markdown(result: _Sweep, command: str, seconds: float) -> str:
    lines = ["# CPU kernels against shape-only kernels: output storage bytes", "",
             f"`{command}`, torch {torch.__version__}, {seconds:.0f} s; {result.samples} samples compared "
             f"({sum(result.fake_failed.values())} not runnable on fake tensors, "
             f"{sum(n for n, _ in result.diverged.values())} calling other ops on fake tensors).", "",
             "| aten op | outputs that differ | OpInfos | real / fake bytes (first case) | after memprof's rules |",
             "| --- | --- | --- | --- | --- |"]
    for func, cases in sorted(result.differ.items()):
        infos = sorted({c[0] for c in cases})
        n, d, what, r, f = cases[0]
        left = len(result.residual.get(func, []))
        after = "not checked" if not result.checked else "exact" if not left else f"{left} still differ"
        lines.append(f"| `{func}` | {len(cases)} | {', '.join(infos)} | {r} / {f} ({n}, {d}: {what}) | {after} |")
    extra = sorted(set(result.residual) - set(result.differ))
    for func in extra:
        lines.append(f"| `{func}` | 0 | | | {len(result.residual[func])} differ only with the rules |")
    if result.strides:
        lines += ["", f"Outputs laid out otherwise in memory{' (with the rules)' if result.checked else ''}:", "",
                  "| aten op | outputs | OpInfos | real / fake strides (first case) |", "| --- | --- | --- | --- |"]
        for func, cases in sorted(result.strides.items()):
            n, d, what, r, f = cases[0]
            lines.append(f"| `{func}` | {len(cases)} | {', '.join(sorted({c[0] for c in cases}))} | {r} / {f} "
                         f"({n}, {d}: {what}) |")
    for title, tallies in (("Samples whose fake run called other ops", result.diverged),
                           ("... and still with the rules", result.diverged_ruled if result.checked else {})):
        if tallies:
            lines += ["", f"{title} (OpInfo x samples, bytes of outputs the fake runs made more): " + ", ".join(
                f"{k} x{n} ({b:+d} B)" for k, (n, b) in sorted(tallies.items()))]
    if result.ruled_failed:
        lines += ["", "Samples whose fake run failed with the rules: "
                  + ", ".join(f"{k} x{v}" for k, v in sorted(result.ruled_failed.items()))]
    return "\n".join(lines) + "\n"


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=None, help="comma-separated OpInfo names (default: all of op_db)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: " + ", ".join(_DTYPES))
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--no-rules", action="store_true", help="do not check memprof's CPU rules")
    parser.add_argument("--mixed", action="store_true",
                        help="the float32 samples with their input in bfloat16 (mixed dtypes), instead of --dtypes")
    parser.add_argument("--max-samples", type=int, default=None,
                        help="at most this many samples per OpInfo, dtype and gradient mode, spread over its list")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    rules = None
    if not args.no_rules:
        import_memprof()
        from memprof.simulate.cpu_kernels import RULES, CpuKernels

        rules = types.SimpleNamespace(mode=CpuKernels, ops=frozenset(RULES))
    names = set(args.ops.split(",")) if args.ops else None
    dtypes = [torch.float32] if args.mixed else [_DTYPES[d] for d in args.dtypes.split(",")]
    start = time.perf_counter()
    result = sweep(names, dtypes, not args.no_backward, rules, not args.quiet, args.max_samples, args.mixed)
    seconds = time.perf_counter() - start
    command = command_line(__file__, argv)
    text = _markdown(result, command, seconds)
    data = {"command": command, "torch": torch.__version__, "seconds": round(seconds, 1), "samples": result.samples,
            "fake_failed": dict(result.fake_failed), "real_failed": dict(result.real_failed),
            "diverged": dict(result.diverged), "diverged_with_rules": dict(result.diverged_ruled),
            "ruled_samples": dict(result.ruled_samples),
            "ruled_failed": dict(result.ruled_failed),
            "strides": {k: [[*c[:3], list(map(str, c[3])), list(map(str, c[4]))] for c in v]
                        for k, v in result.strides.items()},
            "differ": {k: [list(c) for c in v] for k, v in result.differ.items()},
            "residual": {k: [list(c) for c in v] for k, v in result.residual.items()}}
    write_results(args.json, data, args.markdown, text)
    print(text)
    # Whatever the rules leave different, or break, fails the run; so does a requested OpInfo that is not there.
    missing = sorted(names - {_name(op) for op in _load_op_db()} - {op.name for op in _load_op_db()}) if names else []
    if missing:
        print(f"no such OpInfo in op_db: {', '.join(missing)}", file=sys.stderr)
    # A sample that still calls other ops with the rules fails the run where its fake run made other bytes.
    unequal = any(b for _, b in result.diverged_ruled.values())
    return 1 if result.residual or result.ruled_failed or unequal or missing else 0


if __name__ == "__main__":
    sys.exit(main())
