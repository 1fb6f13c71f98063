"""Simulation: the same training step on meta tensors, through the same trackers.

``memprof.estimate(model, optimizer, inputs=..., loss_fn=...)`` copies the
model onto the ``meta`` device (no data is copied, so a 7-billion-parameter
configuration costs no real memory), rebuilds the optimizer on the copy,
and runs a few steps under :func:`memprof.profile` in exact mode. Autograd
saves exactly what it would save for real and every op output has its real
size, so saved activations and op-level temporaries are exact for this
PyTorch version. A CPU target runs on fake CPU tensors, whose kernels and
autocast are the CPU's, and gives the outputs of the few CPU kernels that keep
another storage than their shape that storage (:mod:`memprof.simulate.cpu_kernels`);
a CUDA target runs on meta tensors with CUDA's kernel
choices (:mod:`memprof.simulate.kernels`) and CUDA's autocast policy
(:mod:`memprof.simulate.autocast`) applied above them. The user's model, optimizer
and tensors are never modified.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..anatomy.params import infer_precision
from ..vocabulary import TENSOR_CATEGORIES
from ..errors import InvalidArgumentError, MemprofError, SimulationError, UnknownNameError, is_interrupt
from .autocast import CudaAutocast
from .modes import Rules
from .ranks import RankLayout, check_parallel
from .step import ScalerSteps, TrainingStep, check_step_context
from ..record.trace import Breakdown, Trace

if TYPE_CHECKING:
    from .device_memory import DeviceMemory

__all__ = ["Estimate", "estimate"]

_PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Mixed precision: fp32 parameters, the forward under autocast in this dtype ("amp": the older word).
_MIXED = {"mixed": torch.bfloat16, "amp": torch.bfloat16, "mixed-fp16": torch.float16}


@dataclass(frozen=True)
class Estimate:
    """A simulated run: its :class:`~memprof.record.trace.Trace`, the precision and device it was simulated
    for, and ``notes`` that say what the simulation could not reproduce. Plain data: ``memprof.estimate``
    returns it with its formula column, text and report (:mod:`memprof.report`)."""

    trace: Trace
    precision: str
    device: str
    notes: tuple[str, ...] = ()
    #: A CUDA target's device-level figures (the allocator replay, the memory outside torch); None for others.
    device_memory: "DeviceMemory | None" = None

    @property
    def device_peak(self) -> "int | None":
        """Peak bytes on the device: the replay's peak reserved plus the memory outside torch (None off CUDA)."""
        return None if self.device_memory is None else self.device_memory.device_peak

    @property
    def fits(self) -> "bool | None":
        """Does :attr:`device_peak` fit the ``gpu=`` given (None without one)?"""
        return None if self.device_memory is None else self.device_memory.fits

    @property
    def headroom(self) -> "int | None":
        """The GPU's capacity less :attr:`device_peak` (negative when it does not fit; None without a GPU)."""
        return None if self.device_memory is None else self.device_memory.headroom

    #: Under FSDP2's CPUOffloadPolicy (``parallelize=``): the rank's host bytes and its device peak; the trace's
    #: categories hold both together (the notes say how they were split). ``None`` otherwise.
    host_bytes: "int | None" = None
    device_peak_bytes: "int | None" = None
    #: With ``pipeline=`` and no ``rank=``: every rank class simulated (:class:`memprof.simulate.pipeline.RankClass`);
    #: the estimate itself is the worst one's.
    ranks: tuple = ()

    @property
    def peak(self) -> Breakdown:
        """The composition at the simulated peak (as :attr:`memprof.Report.peak` is a run's)."""
        return self.trace.peak

    @property
    def peak_bytes(self) -> int:
        """Simulated peak of tensor bytes (rounded as the target device's allocator rounds); the device's own
        figure, cache and outside torch included, is :attr:`device_peak`."""
        return sum(v or 0 for v in self.trace.peak.counts[:len(TENSOR_CATEGORIES)])


def estimate(
    model: nn.Module,
    optimizer: "torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None" = None,
    *,
    inputs: Any,
    targets: Any = None,
    loss_fn: "Callable[..., torch.Tensor] | None" = None,
    precision: "str | None" = None,
    device: "str | torch.device | None" = None,
    steps: int = 2,
    attention: str = "auto",
    world_size: int = 1,
    parallel: "str | None" = None,
    routing: Any = None,
    gpu: "str | Any | None" = None,
    alloc_conf: "str | Any | None" = None,
    parallelize: "Callable[..., Any] | None" = None,
    rank: "int | None" = None,
    mesh: Any = None,
    pipeline: Any = None,
    extrapolate: "int | None" = None,
    step_context: "Callable[..., Any] | None" = None,
    _run: Any = None,
) -> Estimate:
    """Simulate ``steps`` training steps of ``model`` on meta tensors and return an :class:`Estimate`.

    ``optimizer`` is an optimizer built on ``model`` (its class and parameter
    groups are rebuilt on the meta copy), or a factory called with the meta
    copy's parameters (``lambda params: torch.optim.AdamW(params)``), or
    ``None``. ``inputs`` is what ``model`` is called with: a tensor, a tuple
    (unpacked as positional arguments) or a dict (keyword arguments); only
    shapes and dtypes matter. The loss is ``loss_fn(output, targets)`` (or
    ``loss_fn(output)`` without targets); without ``loss_fn`` it is the sum of
    the first output tensor. ``precision`` ``"bf16"``/``"fp16"``/``"fp32"``
    casts the copy's parameters; by default they keep their dtypes.
    ``"mixed"`` (``"amp"``) keeps them and runs the forward and the loss
    under bf16 autocast with the target device's policy, ``"mixed-fp16"``
    under fp16 autocast with a GradScaler around each step.
    ``device`` is the device the figures are for: ``"cuda"`` rounds every
    allocation to 512 bytes as the caching allocator does, and runs attention
    and dropout as a CUDA device does (the fused attention kernel torch would
    pick, saving its output and logsumexp rather than the s x s scores; 1-byte
    dropout masks): :mod:`memprof.simulate.kernels`. ``attention`` forces the
    kernel on a CUDA target: ``"flash"``, ``"efficient"`` or ``"math"``.
    ``world_size`` and ``parallel`` (``"ddp"``, ``"fsdp"``, ``"zero1"``, ``"zero2"``, ``"zero3"``) make
    the figures one rank's of a data-parallel job, in this one process: ``inputs`` is that rank's batch,
    and the model states and collective buffers are sharded as the layout does (:mod:`memprof.simulate.ranks`).
    ``routing`` is what a mixture-of-experts model's routers choose, which shape-only tensors cannot decide:
    ``"balanced"`` (default), ``"worst"``, ``"capacity=1.25"``, or a real run's routing (a report profiled
    with ``record_routing=True``, or per-call expert counts) replayed (:mod:`memprof.simulate.routing`).
    ``parallelize=fn`` runs your own ``fn(model, mesh) -> model`` instead (``fully_shard``,
    ``parallelize_module``, with their arguments) on a device mesh of ``world_size`` ranks (``mesh``: a tuple of
    sizes or ``{name: size}``; one dimension by default) on torch's fake process group, and gives rank ``rank``'s
    figures (:mod:`memprof.simulate.parallel`). ``pipeline=Pipeline(split, schedule, microbatches)`` cuts the
    model into pipeline stages along the mesh's ``pp`` dimension and runs torch's schedule on this rank's stage(s)
    (:mod:`memprof.simulate.pipeline`); without ``rank=`` every stage is simulated and the worst rank returned,
    with all of them in ``ranks``. ``extrapolate=k`` simulates the repeated stack of blocks cut to ``k``, ``k + 1``
    and ``k + 2`` blocks (per pipeline stage) and extends the figures to the model's depth when they grow by the
    same bytes per block, as they do once the peak stays put (:mod:`memprof.simulate.depth`).
    ``step_context`` is a function returning the context manager your training loop enters around forward, loss
    and backward (``loss_parallel``, ``context_parallel(...)``, a profiler range): it is entered afresh at each
    simulated step, the optimizer step outside it. It is called with no argument when it takes none
    (``step_context=loss_parallel``), else with a :class:`~memprof.simulate.step.StepParts` holding the simulated
    ``model``, the ``mesh``, the step's ``inputs`` and ``targets`` and the ``optimizer``.
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"estimate() needs a torch.nn.Module, got {type(model).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidArgumentError(f"steps must be a positive int, got {steps!r}")
    world_size, parallel = check_parallel(world_size, parallel, parallelize is not None or pipeline is not None)
    context = check_step_context(step_context)
    if context is not None and pipeline is not None:
        raise InvalidArgumentError("step_context wraps a training step's forward and backward, which under pipeline= "
                                   "torch's schedule runs; leave one of them out")
    if rank not in (None, 0) and parallelize is None and pipeline is None:
        raise InvalidArgumentError(f"rank={rank!r} picks a rank of your parallelize function (or pipeline); the "
                                   "parallel= layouts are simulated for rank 0, the one holding the most rows")
    if _run is None and (extrapolate is not None or parallelize is not None or pipeline is not None):
        from .parallel import across_ranks

        options = dict(inputs=inputs, targets=targets, loss_fn=loss_fn, precision=precision, device=device,
                       steps=steps, attention=attention, world_size=world_size, routing=routing, gpu=gpu,
                       alloc_conf=alloc_conf, step_context=step_context)
        return across_ranks(estimate, model, optimizer, options, parallel=parallel, parallelize=parallelize,
                            mesh=mesh, pipeline=pipeline, rank=rank, extrapolate=extrapolate)
    from .device_memory import check_target, on_device

    gpu_spec, device = check_target(gpu, device, alloc_conf)
    if loss_fn is not None and not callable(loss_fn):
        raise InvalidArgumentError(f"loss_fn must be a function of the model's output (and targets), got "
                                   f"{type(loss_fn).__name__}")
    from ..collect.modules import tensors_in_args

    if not tensors_in_args(inputs, None):
        raise InvalidArgumentError(
            f"inputs must hold the model's input tensors (a tensor, a tuple of arguments or a dict of keyword "
            f"arguments), got {type(inputs).__name__} without a tensor")
    setup = _Target(model, precision, device, attention, routing, _run, gpu=gpu_spec)
    target, notes, meta_model, mapping = setup.target, setup.notes, setup.model, setup.mapping
    fake_mode, autocast, emulated = setup.fake_mode, setup.autocast, setup.emulated
    shadow, cast = setup.shadow, setup.cast
    scaler = ScalerSteps() if precision == "mixed-fp16" else None
    meta_opt = _meta_optimizer(optimizer, meta_model, mapping, notes)
    seen: dict[int, torch.Tensor] = {}  # one twin per tensor: inputs and targets may share one
    # Floating inputs and targets in the same dtype, as a run at that precision feeds them (integer
    # token ids and class labels stay as they are).
    data_maker = shadow if cast is None else _casting(shadow, cast)
    meta_inputs = _convert(inputs, data_maker, seen)
    meta_targets = _convert(targets, data_maker, seen)
    if target.type == "cpu" and any(isinstance(m, nn.RNNBase) for m in model.modules()):
        notes.append("LSTM/GRU/RNN: on a real CPU, oneDNN's RNN kernel also keeps a workspace for backward that "
                     "the shape-only kernels do not; their saved activations are underestimated")

    from ..collect.simulated import SimulatedProfile

    cuda = target.type == "cuda"  # the allocator's 512-byte blocks, and the stream for its replay
    prof = SimulatedProfile(meta_model, meta_opt, fake_mode=setup.fake_mode, rounding=512 if cuda else 1,
                            keep_stream=cuda)
    setup.moe.attach(prof)
    if target.type not in ("cpu", "cuda"):
        notes.append("fused attention kernels are chosen per device: on meta tensors scaled_dot_product_attention "
                     f"runs its math path (saves the s x s scores), where a {target.type} device may not")
    from .progress import Progress

    step: Any = TrainingStep(meta_model, meta_inputs, meta_targets, loss_fn, meta_opt, autocast, emulated, scaler,
                             context, _run.mesh if _run is not None else None,
                             _run.inside_step if _run is not None else None)
    if _run is not None and _run.pipelined:
        step = _run.step(loss_fn, meta_opt, meta_inputs, meta_targets, fake_mode)
    rules = setup.rules()
    # A very large model takes seconds per simulated step: worth a bar in a terminal.
    big = sum(p.numel() for p in model.parameters()) >= 1_000_000_000
    layout = RankLayout(meta_model, meta_opt, world_size, parallel) if parallel is not None else None
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(Progress(steps, "estimate")) if big else None
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        stack.enter_context(setup.op_rules())  # beneath the profiler: it counts what the rules return
        if _run is not None:
            stack.enter_context(_run.rules())
        stack.enter_context(prof)
        if layout is not None:  # one rank's shards and buffers, played on the run as it goes
            layout.attach(prof)
            stack.callback(layout.detach)
        stack.enter_context(rules)
        for i in range(steps):
            if bar is not None:
                bar.step(f"step {i + 1} of {steps}")
            try:
                step.run()
            except MemprofError:
                raise
            except (RuntimeError, NotImplementedError) as exc:  # torch's errors; the model's own pass as they are
                raise _simulation_error(exc, i) from exc
        step.loss = None  # the loop has ended: its last loss is released (inside the profiled run)
    notes.extend(setup.rule_notes())
    if _run is not None:
        notes.extend(_run.notes())
    notes.append(f"the training loop: {steps} step{'s' if steps > 1 else ''} of forward and loss, backward(), "
                 f"{'optimizer.step(), zero_grad(), ' if meta_opt is not None else ''}the loss held through the "
                 "step as a loop that logs it after the step holds it, released when the next step's loss "
                 "replaces it and when the loop ends")
    if context is not None:
        name = getattr(step_context, "__qualname__", type(step_context).__name__)
        notes.append(f"step context: each step's forward, loss and backward ran inside {name}'s context, entered "
                     "afresh at every step, the optimizer step outside it")
    if scaler is not None:
        notes.append("mixed-fp16: a GradScaler scaled the loss and unscaled the gradients in place before each "
                     "optimizer step (its scale, growth tracker and inf flag are 4-byte tensors); steps it would "
                     "skip on overflow are taken")
    resolved = precision or infer_precision(prof.trace)
    trace = prof.trace
    if layout is not None:
        trace = layout.finish(trace)
        notes.extend(layout.notes())
    split = _run.host_split(trace) if _run is not None else None
    if split is not None:
        notes.append(split[2])
    est = Estimate(trace=trace, precision=resolved, device=target.type, notes=tuple(notes),
                   host_bytes=split[0] if split else None, device_peak_bytes=split[1] if split else None)
    if target.type == "cuda":
        est = on_device(est, prof.recorded_stream(), gpu=gpu_spec, alloc_conf=alloc_conf, world_size=world_size,
                        model=model)
    return est


# ---------------------------------------------------------------------- helpers


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def _meta_maker(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def _casting(make: Any, dtype: torch.dtype) -> Any:
    """``make``, with floating tensors made in ``dtype`` (same shape and strides)."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dtype != dtype:
            t = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")
        return make(t)
    return cast


def _fake_maker(mode: Any) -> Any:
    def make(t: torch.Tensor) -> torch.Tensor:
        with mode:
            # Same shape, dtype and strides as the original, on the CPU, with no data.
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return make


def _shadow_copy(model: nn.Module, make: Any) -> tuple[nn.Module, dict[int, torch.Tensor]]:
    # deepcopy with a memo that maps every parameter and buffer to a data-less
    # twin (meta or fake): structure and tying are kept, no data is copied.
    memo: dict[int, Any] = {}
    mapping: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        if id(p) not in memo:
            twin = nn.Parameter(make(p.detach()), requires_grad=p.requires_grad)
            memo[id(p)] = twin
            mapping[id(p)] = twin
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = make(b)
    try:
        clone = copy.deepcopy(model, memo)
    except Exception as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise InvalidArgumentError(
            f"could not copy {type(model).__name__} without its data ({exc}); build the model under "
            "'with torch.device(\"meta\"):' and pass that instead"
        ) from None
    return clone, mapping


def _meta_optimizer(optimizer: Any, meta_model: nn.Module, mapping: dict[int, torch.Tensor],
                    notes: list[str]) -> "torch.optim.Optimizer | None":
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = []
        for g in optimizer.param_groups:
            params = [mapping[id(p)] for p in g["params"] if id(p) in mapping]
            hyper = {k: v for k, v in g.items() if k != "params"}
            if hyper.get("fused"):
                # Fused kernels do not run on meta tensors; their step keeps no temporaries (measured with torch 2.13,
                # see docs/anatomy.md#measured-optimizer-state-and-step-transients).
                hyper["fused"] = None
                notes.append("fused optimizer simulated unfused: its real step keeps no temporaries")
            groups.append({**hyper, "params": params})
        try:
            return type(optimizer)(groups)
        except Exception as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            notes.append(f"{type(optimizer).__name__} could not be rebuilt on meta tensors ({exc}); "
                         "optimizer state is from the formula only")
            return None
    if callable(optimizer):
        opt = optimizer(meta_model.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise InvalidArgumentError("the optimizer factory must return a torch.optim.Optimizer")
        return opt
    raise InvalidArgumentError(
        "optimizer must be a torch.optim.Optimizer, a factory taking parameters, or None; "
        f"got {type(optimizer).__name__}"
    )


def _convert(obj: Any, make: Any, seen: dict[int, torch.Tensor]) -> Any:
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen[id(obj)] = make(obj)
        return seen[id(obj)]
    if isinstance(obj, tuple):
        return tuple(_convert(o, make, seen) for o in obj)
    if isinstance(obj, list):
        return [_convert(o, make, seen) for o in obj]
    if isinstance(obj, dict):
        return {k: _convert(v, make, seen) for k, v in obj.items()}
    return obj



class _Target:
    """What a simulation for one target device and precision runs with: the model's data-less twin, the
    fake-tensor mode (CPU) or meta tensors (other devices), autocast, and the rules of
    :mod:`memprof.simulate.kernels` / :mod:`memprof.simulate.autocast`. Shared by :func:`estimate` and
    :func:`memprof.estimate_generation`."""

    def __init__(self, model: nn.Module, precision: "str | None", device: Any, attention: str,
                 routing: Any = None, run: Any = None, gpu: Any = None) -> None:
        if precision is not None and precision not in _PRECISION_DTYPES and precision not in _MIXED:
            raise UnknownNameError(f"unknown precision {precision!r}; use one of: fp32, bf16, fp16, mixed, mixed-fp16 "
                                   "(amp is mixed)")
        try:
            target = torch.device(device) if device is not None else _model_device(model)
        except (RuntimeError, ValueError, TypeError):
            raise InvalidArgumentError(f"unknown device {device!r}; use 'cpu', 'cuda', 'cuda:1', 'mps' ...") from None
        if target.type == "meta":
            target = torch.device("cpu")
        from .kernels import ATTENTION_KERNELS, CudaKernels, CustomOps, ValueDependentCode

        if attention not in ATTENTION_KERNELS:
            raise UnknownNameError(
                f"unknown attention kernel {attention!r}; use one of: {', '.join(ATTENTION_KERNELS)}")
        if attention != "auto" and target.type != "cuda":
            raise InvalidArgumentError(
                f"attention={attention!r} chooses a CUDA kernel, but the target is {target.type}, whose own kernels "
                "the simulation runs; leave attention='auto' or give device='cuda'")
        # The GPU's compute capability decides which attention kernels it can run (memprof.simulate.sdpa_rules).
        kernels = CudaKernels(attention, gpu.compute_capability if gpu is not None else None) \
            if target.type == "cuda" else None
        from .cpu_kernels import CpuKernels

        # The CPU's kernels where their outputs keep another storage than the fake kernels give them.
        cpu_kernels = CpuKernels() if target.type == "cpu" else None
        custom = CustomOps()
        # Only models built from transformers can reach its mask helpers: no cost for the others.
        watched = ValueDependentCode() if any(type(m).__module__.startswith("transformers.")
                                              for m in model.modules()) else None
        notes: list[str] = []

        fake_mode: Any = None
        if target.type == "cpu" or run is not None:
            # Fake CPU tensors: shapes only, like meta, but kernels are chosen as on the CPU
            # (fused attention, dropout), so the simulation matches a real CPU run op for op.
            from torch._subclasses.fake_tensor import FakeTensorMode

            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        shadow = _fake_maker(fake_mode) if fake_mode is not None else _meta_maker
        # bf16/fp16: the twins are made in that dtype, as model.to(dtype) would cast floating parameters and
        # buffers. (Casting the twins afterwards fails for fake CPU tensors: nn.Module._apply swaps tensor
        # subclasses, which FakeTensors refuse outside their mode.)
        cast = _PRECISION_DTYPES[precision] if precision in ("bf16", "fp16") else None
        if run is not None:  # the user's parallelize function on a meta twin, then fake CPU tensors
            meta = _meta_maker if cast is None else _casting(_meta_maker, cast)
            meta_model, mapping = run.parallelize(model, lambda m: _shadow_copy(m, meta), fake_mode)
        else:
            meta_model, mapping = _shadow_copy(model, shadow if cast is None else _casting(shadow, cast))
        autocast: Any = None
        emulated: "CudaAutocast | None" = None
        low = _MIXED.get(precision or "")
        if low is not None and target.type == "cpu":
            # Fake CPU tensors are CPU tensors to autocast: torch's own CPU policy (which ops run in 16 bits,
            # which in fp32, the weight casts it caches within a forward) applies as in a real run.
            autocast = lambda: torch.autocast("cpu", dtype=low)  # noqa: E731
            notes.append(f"mixed precision: the forward and the loss ran under CPU autocast ({_short(low)}) over the "
                         "parameters' dtype, as in a real CPU run")
        elif low is not None:
            # Autocast does not reach meta tensors: its CUDA policy is applied one level up (memprof.simulate.autocast).
            emulated = CudaAutocast(low)
            if target.type != "cuda":
                notes.append(f"autocast on {target.type} was simulated with CUDA's op lists")
        self.target, self.notes, self.model, self.mapping = target, notes, meta_model, mapping
        self.fake_mode, self.autocast, self.emulated = fake_mode, autocast, emulated
        self.kernels, self.watched, self.custom, self.shadow, self.cast = kernels, watched, custom, shadow, cast
        self.cpu_kernels = cpu_kernels
        from .moe import MoeRules

        self.moe = MoeRules(target.type, routing)

    def op_rules(self) -> Any:
        """The rules applied to aten ops (:mod:`memprof.simulate.cpu_kernels` on a CPU target, value shadows and
        ``_grouped_mm`` on every target: :mod:`memprof.simulate.moe`), dispatch modes to enter after the
        fake-tensor mode and before the profiler."""
        return _entered(*(m for m in (self.cpu_kernels, self.moe.shadows) if m is not None))

    def rules(self) -> Rules:
        # One mode, in this order: autocast's casts happen before the kernel choice sees the tensors; the router
        # sees the scores as the model made them.
        return Rules(*(r for r in (self.emulated, self.kernels, self.watched, self.custom, self.moe.router,
                                   self.moe.one_hot) if r is not None))

    def rule_notes(self) -> list[str]:
        out = []
        for rule in (self.kernels, self.cpu_kernels, self.watched, self.custom, self.emulated):
            if rule is not None:
                out.extend(rule.notes())
        return out + self.moe.notes()


@contextlib.contextmanager
def _entered(*modes: Any) -> Any:
    """``modes`` entered in order (the first lowest on the dispatch stack), exited in reverse."""
    with contextlib.ExitStack() as stack:
        for m in modes:
            stack.enter_context(m)
        yield


def _simulation_error(exc: BaseException, step: "int | str") -> SimulationError:
    """What failed in a simulated step (a training step's index, or the name of what ran: "generation"), in
    words a user can act on."""
    text = str(exc).strip()
    first = (text.splitlines()[0] if text else type(exc).__name__).rstrip(".")
    low = text.lower()
    import traceback

    frames = [f.filename.replace("\\", "/") for f in traceback.extract_tb(exc.__traceback__)]
    if any("/torch/optim/" in f for f in frames) and ("item()" in low or "data-dependent" in low
                                                      or "cannot be called on meta tensors" in low):
        fix = ("the optimizer's step reads tensor values (torch's own code does for this optimizer), which "
               "shape-only tensors do not have; simulate without it (optimizer=None) and add its state from the "
               "formula, or with an optimizer that does not")
    elif "no fake impl" in low or "fake impl" in low and "register" in low or (
            isinstance(exc, NotImplementedError) and "meta" in low):
        fix = ("an op of the model has no fake (meta) kernel, so it cannot run on shape-only tensors; register one "
               "with torch.library.register_fake, returning empty tensors of the output shapes")
    elif "sharding strategy" in low and "_for_cpu" in low:
        fix = ("context parallelism's ring attention has handlers for the CUDA attention kernels only (torch's "
               "_context_parallel/_attention.py): estimate for device='cuda', whose attention the simulation runs as "
               "the flash or efficient kernel")
    elif "item()" in low or "data-dependent" in low or "datadependent" in type(exc).__name__.lower() or \
            "cannot be called on meta tensors" in low:
        fix = ("the model reads tensor values (.item(), .tolist(), a tensor in an if), which shape-only tensors do "
               "not have; pass such values as Python numbers, or keep that code out of the training step")
    else:
        fix = ("the model must run on shape-only tensors (meta or fake): the same call with real tensors of these "
               "shapes is the way to check it")
    what = f"training step {step}" if isinstance(step, int) else step
    rule = _rule_frame(exc)
    if rule:  # memprof's own rule made the failing call: the model is not to blame
        return SimulationError(f"the simulated {what} failed inside memprof's own simulation rule {rule}, not in the "
                               f"model: {type(exc).__name__}: {first}. This is memprof's defect; please report it")
    where = _model_frame(exc)
    return SimulationError(f"the simulated {what} failed: {type(exc).__name__}: {first}"
                           f"{f' (at {where})' if where else ''}. {fix[0].upper()}{fix[1:]}")


# The modules of memprof's rules above and below the ops (memprof.simulate.modes, .shadows), and the frames of theirs
# that hand the model's own call on unchanged.
_RULE_MODULES = ("kernels", "sdpa_rules", "autocast", "cpu_kernels", "moe", "routers", "grouped_mm", "experts",
                 "shadows")
_PASSING_ON = frozenset({"__torch_dispatch__", "__torch_function__", "handle"})


def _rule_frame(exc: BaseException) -> str:
    """The rule, as ``memprof.simulate.module.function (line n)``, when the innermost frame of the failure outside
    torch is a memprof rule's own call rather than the model's call handed on; else ``""``."""
    import traceback

    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        name = f.filename.replace("\\", "/")
        if "/torch/" in name:
            continue
        module = name.rsplit("/", 1)[-1].removesuffix(".py")
        if "/memprof/simulate/" in name and module in _RULE_MODULES and f.name not in _PASSING_ON:
            return f"memprof.simulate.{module}.{f.name} (line {f.lineno})"
        return ""
    return ""


def _model_frame(exc: BaseException) -> str:
    """The innermost frame of the failure outside torch and memprof (the model's line), as ``file:line``."""
    import traceback

    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        name = f.filename.replace("\\", "/")
        if "/torch/" not in name and "/memprof/" not in name:
            parts = name.split("/site-packages/")
            return f"{parts[-1]}:{f.lineno}"
    return ""


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype).replace("torch.", ""))
