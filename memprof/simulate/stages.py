"""The simulation of a training run as named stages, each a small function of the run's configuration
(:class:`~memprof.simulate.run.RunConfig`) and what the stage before it made:

1. :func:`target_twin`: the model's data-less twin for the target device and precision, its optimizer, the
   step's inputs, and the rules the target applies above and beneath the ops (:mod:`memprof.simulate.twin`);
2. the rank layout: one rank of the user's ``parallelize`` function or pipeline on torch's fake process group
   (:class:`memprof.simulate.parallel.ParallelRun`, entered by :func:`simulate`), or a ``parallel=`` layout played
   on the run (:class:`memprof.simulate.ranks.RankLayout`);
3. :func:`profiled_steps`: the steps run under the collector (:class:`memprof.collect.simulated.SimulatedProfile`);
4. :func:`replayed`: for a CUDA target, the allocation stream replayed through the caching allocator's model, the
   memory outside torch, and the fit verdict (:mod:`memprof.simulate.device_memory`).

:func:`simulate` runs them for the rank(s) the configuration asks (every pipeline rank class, or a model cut to a
depth and extended: :mod:`memprof.simulate.depth`), with no recursion through the public function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..anatomy.params import infer_precision
from ..collect.mode_stack import mode_flags, restore_mode_flags
from ..errors import MemprofError, is_interrupt
from . import held_signals
from .abandoned import finish_abandoned
from .failures import simulation_error
from .frozen_heap import frozen
from .kept_caches import caches_left_real
from .ranks import RankLayout, uneven_shard
from .run import RunConfig, Workload
from .step import ScalerSteps, StepParts, TrainingStep, check_step_context
from .twin import (Twin, casting, converted, meta_optimizer, whole_storages, refuse_closure_step,
                   refuse_value_driven_step)
from .user_step import LoopValues, UserStep

if TYPE_CHECKING:
    from types import TracebackType
    from typing import Callable

    from ..anatomy.gpus import GpuSpec
    from ..collect.simulated import RecordedStream, SimulatedProfile
    from .depth import Kept
    from .estimated import Estimate
    from .parallel import ParallelRun
    from .pipeline import PipelineStep

__all__ = ["simulate", "in_processes", "target_twin", "profiled_steps", "replayed", "Prepared"]


@dataclass
class Prepared:
    """What the first stages made for one rank: the target twin, its optimizer, the step it runs, and the notes."""

    twin: Twin
    optimizer: "torch.optim.Optimizer | None"
    step: "TrainingStep | UserStep | PipelineStep"
    notes: list[str]
    gpu: "GpuSpec | None"
    layout: "RankLayout | None"


def simulate(config: "RunConfig[Workload]") -> "Estimate":
    """The estimate ``config`` describes: one rank, every pipeline rank class (the worst returned, all listed), and
    with ``extrapolate=`` the model cut to three depths and extended; the heap there before kept out of the garbage
    collector's full passes meanwhile (:mod:`memprof.simulate.frozen_heap`), and the model code's ``functools``
    caches it filled emptied after (:mod:`memprof.simulate.kept_caches`)."""
    w = config.workload
    with caches_left_real(w.model, w.loss_fn, w.train_step), frozen():
        return _simulated(config)


def _simulated(config: "RunConfig[Workload]") -> "Estimate":
    from .depth import NOT_ALIKE, extrapolated
    from .parallel import ParallelRun, depth_unit
    from .rank_classes import pipeline_ranks

    p = config.parallelism

    def at_rank(cfg: "RunConfig[Workload]", r: "int | None", kept: "Kept | None" = None) -> "Estimate":
        if not p.on_fake_ranks:
            return one_rank(cfg, None, kept)
        w = cfg.workload
        with ParallelRun(p.parallelize, p.world_size, 0 if r is None else r, p.mesh, p.pipeline, w.inputs) as ranks:
            return one_rank(cfg.with_parallelism(rank=r), ranks, kept)

    def at_depth(r: "int | None") -> "Estimate":
        k = config.depth.extrapolate
        if k is False:  # the whole model, asked for
            return at_rank(config, r)
        w = config.workload
        run = _depth_key(config, r) if k is None else None
        failed = _not_cut(w.model)
        if run is not None and run in failed:
            est = at_rank(config, r)  # the default's cuts of this run did not check before: whole at once
            return dataclasses.replace(est, notes=(*est.notes, "depth: simulated whole: the cuts of this model did "
                                                               "not check for this run before (another batch)"))
        est = extrapolated(w.model, w.optimizer, k, depth_unit(p.world_size, p.mesh, p.pipeline),
                           lambda m, opt, kept=None: at_rank(config.with_workload(model=m, optimizer=opt), r, kept),
                           auto=k is None, uneven=lambda blocks: uneven_shard(blocks, p.world_size, p.parallel))
        # Blocks not alike are seen again at each call (a hook removed, train() called again: the run's key does
        # not hold those), so only what the cuts found is remembered.
        if run is not None and any(n.startswith("depth:") and " was simulated whole, since " in n
                                   and NOT_ALIKE not in n for n in est.notes):
            _remember_not_cut(w.model, run)
        return est

    if p.pipeline is not None and p.rank is None:
        return pipeline_ranks(p.world_size, p.mesh, p.pipeline, at_depth,
                              many=lambda ranks: in_processes(at_depth, config.workload.model, ranks, config.processes))
    return at_depth(p.rank)


def in_processes(one: "Callable[[int], Estimate]", model: nn.Module, ranks: "list[int]", processes: "int | None"
                 ) -> "list[Estimate]":
    """``one(r)`` for each of ``ranks`` (a pipeline's rank classes: independent simulations), each in a process
    forked from this one where ``processes`` and the cores allow (:mod:`memprof.simulate.forked`), with a note
    saying so; what a forked simulation learnt of ``model``'s cuts (:data:`_NOT_CUT`) is learnt here too."""
    from .forked import forked, processes_for

    n = processes_for(processes, len(ranks))
    if n <= 1:
        return [one(r) for r in ranks]

    def reporting(r: int) -> "Callable[[], tuple[Estimate, frozenset[RunKey]]]":
        return lambda: (one(r), frozenset(_not_cut(model)))

    note = (f"pipeline: the {len(ranks)} rank classes were simulated by {n} processes forked from this one "
            "(processes=1 keeps them in this one); the figures are the same")
    out = []
    for est, runs in forked([reporting(r) for r in ranks], n, "a pipeline's rank classes"):
        for run in runs:
            _remember_not_cut(model, run)
        out.append(dataclasses.replace(est, notes=(*est.notes, note)))
    return out


#: What a run is, the batch aside (:func:`_depth_key`): its settings, and its objects by identity.
RunKey = tuple[object, ...]

#: Per model, the runs (:func:`_depth_key`) whose cuts by the default did not check: a plan simulates one run at
#: many batches, and a run whose stream does not repeat per block at one batch does not at the next. A model
#: changed in place since is another run only where what the key holds changed; the cost of a stale entry is
#: the whole model simulated, the figures the same.
#: Kept by id with a plain weak reference (no callback, so no Python finaliser of memprof's runs when a model
#: dies: a WeakKeyDictionary's would), entries of dead models dropped when another is added.
_NOT_CUT: "dict[int, tuple[weakref.ref[nn.Module], set[RunKey]]]" = {}


def _not_cut(model: nn.Module) -> "set[RunKey]":
    entry = _NOT_CUT.get(id(model))
    return entry[1] if entry is not None and entry[0]() is model else set()


def _remember_not_cut(model: nn.Module, run: "RunKey") -> None:
    for key in [k for k, (ref, _runs) in _NOT_CUT.items() if ref() is None]:
        del _NOT_CUT[key]
    entry = _NOT_CUT.get(id(model))
    if entry is None or entry[0]() is not model:
        entry = _NOT_CUT[id(model)] = (weakref.ref(model), set())
    entry[1].add(run)


def _depth_key(config: "RunConfig[Workload]", rank: "int | None") -> "RunKey":
    """What a run is, the batch aside, for :data:`_NOT_CUT`: every setting but the inputs, objects by identity."""
    w, t, p = config.workload, config.target, config.parallelism
    return (config.precision, str(t.device), str(t.gpu), str(t.alloc_conf), t.attention, p.world_size, p.parallel,
            id(p.parallelize), repr(p.mesh), id(p.pipeline), rank, id(w.optimizer), id(w.loss_fn), w.steps,
            id(w.step_context), repr(w.routing), id(w.train_step), w.loop,
            tuple((n, tuple[int, ...](q.shape), q.dtype, q.requires_grad) for n, q in w.model.named_parameters()))


def one_rank(config: "RunConfig[Workload]", ranks: "ParallelRun | None", kept: "Kept | None" = None) -> "Estimate":
    """Stages 1, 3 and 4 for one rank (``ranks``: the rank's fake process group, entered; None for a single
    process or a ``parallel=`` layout). With ``kept`` (a list) a CUDA target's stream is not replayed: its
    recorded stream and the replay to run on a stream like it are appended to ``kept`` instead
    (:mod:`memprof.simulate.depth` extends the stream of a model cut short and replays that); any other target's
    stream is appended too, with a replay that adds nothing (depth checks the extended figures against it)."""
    with NothingLeftBehind():
        prepared = target_twin(config, ranks)
        prof = profiled_steps(config, prepared, ranks, keep_stream=kept is not None)
        return replayed(config, prepared, prof, ranks, kept)


def target_twin(config: "RunConfig[Workload]", ranks: "ParallelRun | None") -> Prepared:
    """Stage 1: the twin, its optimizer, the step's inputs and the step itself."""
    from .device_memory import check_target

    w, t = config.workload, config.target
    gpu, device = check_target(t.gpu, t.device, t.alloc_conf)
    twin = Twin(w.model, config.precision, device, t.attention, w.routing, ranks, gpu=gpu)
    notes = twin.notes
    optimizer = meta_optimizer(w.optimizer, twin.model, twin.mapping, notes, twin.target, twin.fake_mode)
    refuse_value_driven_step(optimizer)  # first: LBFGS needs a closure too, and is refused in either loop
    if w.train_step is None and optimizer is not None:
        refuse_closure_step(optimizer)
    seen: dict[int, torch.Tensor] = {}  # one twin per tensor: inputs and targets may share one
    # Floating inputs and targets in the same dtype, as a run at that precision feeds them (integer token ids
    # and class labels stay as they are).
    make = twin.shadow if twin.cast is None else casting(twin.shadow, twin.cast)
    if twin.target.type == "cpu":  # the user's own tensors are the run's; on another device a copy of them is
        make = whole_storages(make)
    inputs, targets = converted(w.inputs, make, seen), converted(w.targets, make, seen)
    if twin.target.type == "cuda" and any(isinstance(m, nn.RNNBase) for m in w.model.modules()):
        notes.append("LSTM/GRU/RNN: on a GPU torch runs cuDNN's fused RNN kernel, whose reserve space for backward "
                     "(cudnnGetRNNTrainingReserveSize) depends on the cuDNN version and torch's meta kernel leaves "
                     "empty; the simulation runs torch's per-step cell path instead, so these layers' activations "
                     "are that path's, not cuDNN's (not checked on a GPU)")
    if twin.target.type not in ("cpu", "cuda"):
        notes.append("fused attention kernels are chosen per device: on meta tensors scaled_dot_product_attention "
                     f"runs its math path (saves the s x s scores), where a {twin.target.type} device may not")
    scaler = ScalerSteps() if config.precision == "mixed-fp16" else None
    context = check_step_context(w.step_context)
    step: "TrainingStep | UserStep | PipelineStep"
    step = TrainingStep(twin.model, inputs, targets, w.loss_fn, optimizer, twin.autocast, twin.emulated, scaler,
                        context, ranks.mesh if ranks is not None else None,
                        ranks.inside_step if ranks is not None else None)
    if w.train_step is not None:  # the user's own step in place of memprof's loop (run.py refuses it with pipeline=)
        step = UserStep(w.train_step, twin.model, optimizer, inputs, targets, twin.autocast, twin.emulated)
    elif ranks is not None and ranks.pipelined:
        step = ranks.step(w.loss_fn, optimizer, inputs, targets, twin.fake_mode)
        if context is not None:  # the rank's stage modules, its mesh and the inputs its first stage splits
            stages = ranks.stage_modules()
            step.enter_each_step(context, StepParts(stages[0] if len(stages) == 1 else nn.ModuleList(stages),
                                                    ranks.mesh, step.inputs, step.targets, optimizer))
    p = config.parallelism
    layout = RankLayout(twin.model, optimizer, p.world_size, p.parallel) if p.parallel is not None else None
    return Prepared(twin, optimizer, step, notes, gpu, layout)


def profiled_steps(config: "RunConfig[Workload]", prepared: Prepared, ranks: "ParallelRun | None",
                   keep_stream: bool = False) -> "SimulatedProfile":
    """Stage 3: the steps, under the collector, with the twin's rules above and beneath the ops and a ``parallel=``
    layout played on the run. The allocation stream is kept for a CUDA target (its replay) and where
    ``keep_stream`` asks (a model cut short, whose stream :mod:`memprof.simulate.depth` extends and checks)."""
    from ..collect.simulated import SimulatedProfile

    twin, steps = prepared.twin, config.workload.steps
    cuda = twin.target.type == "cuda"  # the allocator's 512-byte blocks, and the stream for its replay
    prof = SimulatedProfile(twin.model, prepared.optimizer, fake_mode=twin.fake_mode, rounding=512 if cuda else 1,
                            keep_stream=cuda or keep_stream)
    twin.moe.attach(prof)
    # A very large model takes seconds per simulated step: worth a bar in a terminal.
    big = sum(p.numel() for p in config.workload.model.parameters()) >= 1_000_000_000
    try:
        _run_steps(prof, prepared, ranks, steps, big)
    except BaseException:
        if prof.running:  # an interrupt between the profile's entry and the registration of its exit
            prof.__exit__(*sys.exc_info())
        raise
    return prof


def _run_steps(prof: "SimulatedProfile", prepared: Prepared, ranks: "ParallelRun | None", steps: int,
               big: bool) -> None:
    from .progress import Progress

    twin = prepared.twin
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(Progress(steps, "estimate")) if big else None
        # beneath the profiler: it counts what the rules return
        stack.enter_context(twin.beneath(*(ranks.rules() if ranks is not None else ())))
        step = prepared.step
        user = step if isinstance(step, UserStep) else None
        # The step's value reads answered beneath the profiler, as they are ops a real run's profiler sees, by the value
        # shadows' rule (a mode of its own would cost every op a Python call): the user's step's reads outside the
        # model; in memprof's loop the optimizer step's own (ASGD's counters, Adafactor's norms), anything else
        # still refused.
        if user is not None:
            twin.moe.shadows.reads = user.answering(prof).answer
        elif isinstance(step, TrainingStep) and prepared.optimizer is not None:
            step.values = LoopValues(lambda: prof.innermost_module() is not None, optimizer_only=True)
            twin.moe.shadows.reads = step.values.answer
        stack.enter_context(prof)
        if user is not None:  # after the profiler: its hooks of each model call run inside the autocast region
            stack.enter_context(user.model_autocast())
        layout = prepared.layout
        if layout is not None:  # one rank's shards and buffers, played on the run as it goes
            layout.attach(prof)
            stack.callback(layout.detach)
        stack.enter_context(twin.rules())
        for i in range(steps):
            if bar is not None:
                bar.step(f"step {i + 1} of {steps}")
            try:
                step.run()
            except MemprofError:
                raise
            except (RuntimeError, NotImplementedError) as exc:  # torch's errors; the model's own pass as they are
                if is_interrupt(exc):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                raise simulation_error(exc, i) from exc
        if isinstance(step, UserStep):
            step.release()  # the loop has ended: the step's last result is released (inside the profiled run)
        elif isinstance(step, TrainingStep):
            step.loss = None  # the loop has ended: its last loss is released (inside the profiled run)


def replayed(config: "RunConfig[Workload]", prepared: Prepared, prof: "SimulatedProfile",
             ranks: "ParallelRun | None", kept: "Kept | None" = None) -> "Estimate":
    """Stage 4: the record of the run as the rank holds it, its notes, and for a CUDA target the device replay and
    the fit verdict."""
    from .device_memory import on_device
    from .estimated import Estimate

    w, twin, notes = config.workload, prepared.twin, prepared.notes
    notes.extend(twin.rule_notes())
    if ranks is not None:
        notes.extend(ranks.notes())
    notes.extend(_loop_notes(config, prepared))
    trace = prof.trace
    resolved = config.precision or infer_precision(trace)
    if prepared.layout is not None:
        trace = prepared.layout.finish(trace)
        notes.extend(prepared.layout.notes())
    split = ranks.host_split(trace) if ranks is not None else None
    if split is not None:
        notes.append(split[2])
    est = Estimate(trace=trace, precision=resolved, device=twin.target.type, notes=tuple(notes),
                   host_bytes=split[0] if split else None, device_peak_bytes=split[1] if split else None)
    if twin.target.type != "cuda":
        if kept is not None:  # no replay: the stream only checks the figures extended in depth
            kept.append((prof.recorded_stream(), _unchanged))
        return est
    gpu, conf, world = prepared.gpu, config.target.alloc_conf, config.parallelism.world_size

    def replay(e: "Estimate", recorded: "RecordedStream") -> "Estimate":
        out: Estimate = on_device(e, recorded, gpu=gpu, alloc_conf=conf, world_size=world, model=w.model)
        return out

    if kept is not None:
        kept.append((prof.recorded_stream(), replay))
        return est
    return replay(est, prof.recorded_stream())


def _unchanged(est: "Estimate", recorded: "RecordedStream") -> "Estimate":
    """A target with no allocator replay: the estimate as it is."""
    return est


def _loop_notes(config: "RunConfig[Workload]", prepared: Prepared) -> list[str]:
    """What the notes say of the training loop the simulation ran."""
    w = config.workload
    if isinstance(prepared.step, UserStep):
        return prepared.step.notes()
    values = prepared.step.values if isinstance(prepared.step, TrainingStep) else None
    answered = values.notes() if values is not None else []
    steps = w.steps
    out = [f"the training loop: {steps} step{'s' if steps > 1 else ''} of forward and loss, backward(), "
           f"{'optimizer.step(), zero_grad(), ' if prepared.optimizer is not None else ''}the loss held through the "
           "step as a loop that logs it after the step holds it, released when the next step's loss replaces it and "
           "when the loop ends"]
    if w.step_context is not None:
        name = getattr(w.step_context, "__qualname__", type(w.step_context).__name__)
        out.append(f"step context: each step's forward, loss and backward ran inside {name}'s context, entered "
                   "afresh at every step, the optimizer step outside it")
    if config.precision == "mixed-fp16":
        out.append("mixed-fp16: a GradScaler scaled the loss and unscaled the gradients in place before each "
                   "optimizer step (its scale, growth tracker and inf flag are 4-byte tensors); steps it would skip on "
                   "overflow are taken")
    return out + answered


class NothingLeftBehind:
    """Around one simulated rank: whatever ends it (a failure, the user's Ctrl-C landing between a mode's entry and
    the registration of its exit, where Python's ``with`` cannot cover it), the thread's dispatch and function
    mode stacks are as they were, and torch's thread-local dispatch keys (the fake kernels' switch among them) too.
    An interrupted simulation must not leave a fake-tensor mode on, under which the user's later code would run,
    nor autograd excluded: a context manager of torch's that the interrupt abandoned is finished first
    (:mod:`memprof.simulate.abandoned`), since finished later, when the traceback dies, it put back a dispatch key
    set from inside an op's dispatch."""

    def __enter__(self) -> "NothingLeftBehind":
        self.depths = (torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack())
        self.flags = mode_flags()  # torch's process-wide "a dispatch mode is in" flags, which a mode's exit puts back
        # An interrupt inside a no_grad region's exit (the optimizer's step) leaves grad mode off.
        self.grad = torch.is_grad_enabled()
        self.signals = held_signals.entered()
        # The thread's included and excluded dispatch keys, put back whole at the exit (the fake kernels' switch,
        # Meta in the included set, among them; an uninterrupted simulation leaves them as they were, so this
        # changes nothing then).
        self.keys = torch._C._PreserveDispatchKeyGuard()
        self.keys.__enter__()  # type: ignore[no-untyped-call]  # torch._C declares it untyped
        return self

    def __exit__(self, kind: object, exc: object, tb: "TracebackType | None") -> None:
        try:
            if tb is not None:
                finish_abandoned(tb)
        finally:
            self._put_back()

    def _put_back(self) -> None:
        dispatch, function = self.depths
        while torch._C._len_torch_function_stack() > function:
            torch._C._pop_torch_function_stack()
        while torch._C._len_torch_dispatch_stack() > dispatch:
            torch._C._pop_torch_dispatch_stack(None)
        # As the popped modes' exits would have, or one an interrupt cut short between its pop and its flags: with
        # the stack as it was, so are they (unchanged where the run was not cut short).
        restore_mode_flags(self.flags)
        self.keys.__exit__(None, None, None)
        torch.set_grad_enabled(self.grad)
        held_signals.leave_to(self.signals)  # the user's signal handlers, as they were
