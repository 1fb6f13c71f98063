"""Wiring a profile: each collector built with the few collaborators it uses, and every hook installed.

Collectors never reach each other through the profiler. A collector is handed the ledger, the run state
(:mod:`.state`) and the one or two collectors it calls; where a lower one must set off work in a higher one
(the phase tracker closing a backward lets the module frames close and the gradients be collected; a
schedule's windows pause and resume the profile), it exposes a slot or a list of callables, filled here.
So the import graph of ``memprof.collect`` runs one way, from :func:`wire` down.

Everything installed goes on the profile's undo stack the moment it is, so that a failure half-way removes
what was installed before it.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.optim.optimizer as _optim_mod
from torch import nn

from . import marks
from ..errors import InvalidArgumentError
from .capture import Capture
from .carry import StepCarry
from .dispatch import KEEPS_COMPILE, DispatchMode, StorageTracker
from .engine_watch import EngineWatch
from .frames import Frames
from .graph_saves import GraphSaves
from .kv_cache import CacheTracker, watch_encoder
from .ledger import BUFFERS, WEIGHTS
from .module_table import ModuleTable, attribute_tensors, unique_params
from .modules import ModuleTracker
from .operations import OperationLog
from .optimizer import OptimizerTracker
from .params import ParamTracker, is_lazy
from .phases import PhaseTracker
from .ranks import rank_info
from .routing import RoutingRecorder
from .saved import SavedTracker
from .flat_shards import FlatShardTracker, flat_sharding
from .shards import ShardTracker, sharding
from .state import EXACT, LIGHT
from .timeline import Timeline
from .windows import Windows

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..record.parts import RankInfo
    from .allocator_source import AllocatorSource
    from .device import DeviceProbe
    from .ledger import Ledger
    from .schedule import Schedule
    from .state import Run
    from .undo import UndoStack

__all__ = ["Collectors", "Wiring", "wire"]


@dataclasses.dataclass(eq=False)
class Collectors:
    """The collectors of one profile and what they share: what the record is built from."""

    run: "Run"
    ledger: "Ledger"
    probe: "DeviceProbe"
    stack: "UndoStack"
    timeline: Timeline
    storages: StorageTracker
    phases: PhaseTracker
    params: ParamTracker
    optimizers: OptimizerTracker
    table: ModuleTable
    capture: Capture
    frames: Frames
    saved: SavedTracker
    graph: GraphSaves
    kv: CacheTracker
    rank: "RankInfo | None"
    shards: "ShardTracker | None"
    modules: ModuleTracker
    #: FSDP1's flat parameters (a model wrapped in FullyShardedDataParallel).
    flat: "FlatShardTracker | None" = None
    schedule: "Schedule | None" = None
    windows: "Windows | None" = None
    #: With ``record_routing=True``: the router calls' per-expert counts.
    routing: "RoutingRecorder | None" = None
    #: With ``source="allocator"``: the allocator's events reduced per phase.
    allocator: "AllocatorSource | None" = None
    #: Exact mode's carried optimizer steps (None where carrying is off).
    carry: "StepCarry | None" = None
    #: The ledger's totals when the run began (what existed before its first phase).
    start_totals: list[int] = dataclasses.field(default_factory=list)
    param_dtypes: tuple[str, ...] = ()

    def register_existing(self) -> None:
        """What exists now: weights, buffers, gradients, optimizer state (at the start, and when a
        schedule resumes)."""
        model = self.table.root_ref()
        if model is None:
            return
        storages, params = self.storages, self.params
        weights = [p for p in unique_params(model) if not is_lazy(p)]
        for p in weights:
            storages.add_tensor(p, WEIGHTS)
        for p in weights:
            if p.grad is not None:
                params.add_grad(p.grad, retro=False)
        for b in model.buffers():
            storages.add_tensor(b, BUFFERS)
        for mod in model.modules():
            for t in attribute_tensors(mod):  # module state kept as plain attributes, like buffers
                storages.add_tensor(t, BUFFERS)
        for opt in self.optimizers.all():
            self.optimizers.collect_state(opt, retro=False)

    def restart(self) -> None:
        """The run starts from here: what was seen before is not this run's (a simulated rank's layout has just
        sharded the weights the profile registered whole)."""
        self.phases.start()
        marks.restart_peak(self.ledger)
        self.start_totals = self.ledger.totals.copy()

    def suspend(self) -> None:
        """A schedule pauses the profile: every hook returns at once, and the dispatch mode leaves the stack."""
        run = self.run
        # What autograd released while the hooks recorded still counts; what it releases while paused does not.
        self.ledger.settle()
        self.ledger.unsaving = False
        run.active = False
        if run.mode == EXACT:
            self.storages.uninstall(run.thread)

    def wake(self) -> None:
        """A schedule resumes the profile: what the unwatched steps made is registered, and the hooks record."""
        self.ledger.settle()  # frees while paused count, released slots do not (unsaving is still off)
        self.ledger.unsaving = True
        self.register_existing()
        if self.run.mode == EXACT:
            self.storages.install()
        self.run.active = True

    def close_saved_hooks(self) -> None:
        """Undo memprof's per-thread saved-tensor pushes."""
        if not self.saved.hooks.close() and threading.get_ident() == self.run.thread:
            self.run.notes.append(
                "saved_tensors_hooks entered inside the profile were still active when it ended (above "
                "memprof's own pair), so memprof's pair is left inert beneath them until they exit"
            )


@dataclasses.dataclass(frozen=True)
class Wiring:
    """How a profile measures, as its arguments decided: the mode asked for (``"auto"`` included), whether per-op
    records are kept, a simulation's fake-tensor mode (its tensors are the run's), the schedule and ``ready`` (which
    hands the run so far to ``on_trace_ready`` at the end of a window), whether routing is recorded, where exact
    mode's events come from (``source=`` of profile()), whether optimizer steps may be carried (:mod:`.carry`)
    where nothing else needs every op, and the collector's dispatch mode where not its own (a simulation's, which runs
    beneath the simulation's function mode: :class:`~memprof.collect.simulated.SimulatedDispatchMode`)."""

    mode_requested: str
    operations: bool
    fake_mode: "FakeTensorMode | None"
    schedule: "Schedule | None"
    ready: "Callable[[], None] | None"
    record_routing: bool = False
    allocator: str = "dispatch"
    carry: bool = True
    dispatch_mode: "type[DispatchMode] | None" = None


def wire(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], run: "Run", ledger: "Ledger",
         probe: "DeviceProbe", stack: "UndoStack", how: Wiring) -> Collectors:
    """Build the collectors of a profile of ``model`` and install everything, as ``how`` says."""
    from .allocator_source import attach

    c = build(model, optimizers, run, ledger, probe, stack, how.fake_mode)
    c.storages.mode_class = how.dispatch_mode
    install(c, model, mode_requested=how.mode_requested, operations=how.operations, carry=how.carry)
    # On CUDA: the allocator's events (source="allocator") and memprof's labels in its snapshot.
    c.allocator = attach(run, ledger, c.phases, c.table, stack, how.allocator)
    if how.schedule is not None:
        add_windows(c, how.schedule, how.ready)
    if how.record_routing:
        c.routing = RoutingRecorder(run, c.table)
        c.routing.__enter__()  # type: ignore[no-untyped-call]  # torch's TorchFunctionMode.__enter__ is untyped
        stack.callback(c.routing.__exit__, None, None, None)
    return c


def build(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], run: "Run", ledger: "Ledger",
          probe: "DeviceProbe", stack: "UndoStack", fake_mode: "FakeTensorMode | None") -> Collectors:
    """The collectors, each with its collaborators, and the slots through which lower ones call higher ones."""
    timeline = Timeline(ledger, run)
    storages = StorageTracker(ledger, run)
    storages.fake_mode = fake_mode  # a simulation's fake-tensor mode: its tensors are the run's
    phases = PhaseTracker(ledger, run, probe, timeline)
    params = ParamTracker(ledger, run, storages, phases, stack)
    opts = OptimizerTracker(optimizers, ledger, run, storages, params, phases, stack)
    phases.optimizer_seen = bool(optimizers)
    table = ModuleTable(model)
    capture = Capture(table, run)
    frames = Frames(ledger, run, table, phases, timeline)
    saved = SavedTracker(ledger, run, table, capture)
    graph = GraphSaves(ledger, run, saved, frames.node_hooks)
    kv = CacheTracker(model, ledger, run, storages, phases)
    rank = rank_info(model)
    shards = sharding(model, rank, ledger, run, params, stack)
    modules = ModuleTracker(run, ledger, table, capture, frames, timeline, storages, params, saved, phases, kv,
                            shards, stack)

    storages.backward_started = saved.backward_started = phases.backward_started
    storages.graph = graph
    opts.sync_model = modules.sync
    phases.on_begin.append(capture.phase_began)
    phases.release_grads.append(params.release_stale_grads)
    phases.grad_keys = params.grad_keys
    phases.on_step_end.append(frames.prune_hooks)
    phases.on_backward_end.append(frames.close_backward_frames)
    if shards is not None:
        # In the backward phase still: the reduce-scatter outputs were gradients at its peak.
        storages.after_collective = shards.new_grads
        phases.on_backward_end.append(shards.grads)
    flat = flat_sharding(model, run, params, rank, stack) if rank is not None and rank.layout == "fsdp1" else None
    if flat is not None:
        storages.after_collective = flat.new_grads  # its reduce-scatter outputs were gradients at backward's peak
    phases.on_backward_end.append(params.walk_grads)
    phases.on_backward_start.append(params.backward_began)
    if ledger.grad_arrived is not None:  # light mode's gradients are queued: a hook inside each backward
        modules.engine_watch = EngineWatch(ledger, run, phases, frames.node_hooks, params)
    return Collectors(run=run, ledger=ledger, probe=probe, stack=stack, timeline=timeline, storages=storages,
                      phases=phases, params=params, optimizers=opts, table=table, capture=capture, frames=frames,
                      saved=saved, graph=graph, kv=kv, rank=rank, shards=shards, modules=modules, flat=flat)


def install(c: Collectors, model: nn.Module, *, mode_requested: str, operations: bool, carry: bool = True) -> None:
    """Register what exists, start the first phase and install the hooks."""
    run, stack = c.run, c.stack
    # Two steps, so that a failure in one still runs the other.
    stack.callback(c.close_saved_hooks)
    stack.callback(c.frames.remove_hooks)

    c.param_dtypes = tuple(sorted({str(p.dtype).replace("torch.", "") for p in unique_params(model)
                                   if not is_lazy(p)}))
    c.register_existing()
    c.optimizers.start()
    c.ledger.settle()
    c.start_totals = c.ledger.totals.copy()
    c.phases.start()

    # Hooks. Each registration goes on the stack right away so that a
    # failure half-way still removes what was installed.
    c.modules.adopt(model)
    watch_encoder(model, run, c.phases, stack)  # after the module hooks: an encoder-decoder's prefill begins there
    compiled = c.table.compiled_paths
    if compiled and run.mode == EXACT and not KEEPS_COMPILE:
        # With this torch any dispatch mode makes compiled code run eagerly, and for the rest of
        # the process: exact mode would change the user's training.
        if mode_requested == EXACT:
            raise InvalidArgumentError(
                f"{compiled[0]} runs torch.compile'd code, and with torch {torch.__version__} exact mode's "
                "dispatch mode would make it run eagerly for the rest of the process; profile it with "
                "mode='light', or upgrade torch (2.9 and later keep compiled code compiled)"
            )
        run.mode = LIGHT
        run.backward_frames = c.saved.full = False
        run.notes.append(
            f"light mode: the model runs torch.compile'd code, which exact mode's dispatch mode would make "
            f"run eagerly with torch {torch.__version__}"
        )
    pre, post = c.optimizers.pre_hook, c.optimizers.post_hook
    if "torch._dynamo" in sys.modules:
        # A compiled optimizer.step() calls the global step hooks from its compiled frame: run them
        # eagerly, outside the graph, rather than have dynamo trace memprof's code into it (torch.compiler.disable
        # is untyped).
        pre, post = torch.compiler.disable(pre), torch.compiler.disable(post)  # type: ignore[no-untyped-call]
    _global_hook(stack, _optim_mod, "register_optimizer_step_pre_hook", "_global_optimizer_pre_hooks", pre)
    _global_hook(stack, _optim_mod, "register_optimizer_step_post_hook", "_global_optimizer_post_hooks", post)
    # The model may gain parameters or submodules inside the block (a new head, lazy modules).
    from torch.nn.modules import module as _module_mod

    for name, registry in (("register_module_parameter_registration_hook", "_global_parameter_registration_hooks"),
                           ("register_module_module_registration_hook", "_global_module_registration_hooks")):
        if getattr(_module_mod, name, None) is not None:
            _global_hook(stack, _module_mod, name, registry, c.modules.registration_hook)
    if operations and run.mode != EXACT:
        run.notes.append("operations=True needs mode='exact' (it sees ops through the dispatch mode)")
    if run.mode == EXACT:
        # What code outside the model's calls saved is found on the graph when backward starts.
        c.phases.on_backward_start.append(c.graph.find_outside_saves)
        if operations:
            c.storages.operations = OperationLog()
        c.storages.install()
        stack.callback(c.storages.uninstall, run.thread)
        # Every op is needed where its figures are kept (operations=True), where the allocation stream is
        # (record_allocations=True, a simulation's allocator replay), in a simulation, whose fake-tensor rules
        # apply per op, and for an OOM dump (what was live at the error; the profiler passes carry=False):
        # there every optimizer step is measured.
        if carry and not operations and c.ledger.stream is None and c.storages.fake_mode is None:
            add_carry(c)
    elif run.source == "allocator":
        pass  # no dispatch mode and no counters: the allocator's events give the figures (allocator_source.NOTE)
    else:
        c.probe.start_light()
        run.notes.extend(c.probe.light_notes())
        # Light mode has no dispatch mode: code outside the model's modules runs unseen.
        run.notes.append(
            "light mode sees no op outside the model's modules: what autograd saves there (the loss "
            "function's tensors) is not counted as activations, nor as inputs the tensors made before the "
            "profile that only code there uses (targets handed to the loss function, a metric accumulator "
            "such as acc += loss.detach()); on an accelerator both are among temporaries (exact mode counts "
            "them)")
    c.timeline.sample("start", "start")


def add_carry(c: Collectors) -> None:
    """Optimizer steps measured once and carried while nothing that decides them changes (:mod:`.carry`)."""
    steps = c.carry = StepCarry(c.ledger, c.run, c.storages, c.phases)
    c.optimizers.carry = steps
    c.phases.before_close = steps.before_close
    # Unwound before the dispatch mode's removal (the stack runs last in, first out): a carried step cut short
    # by the block's end puts the mode back where it was first.
    c.stack.callback(steps.abandon)


def add_windows(c: Collectors, schedule: "Schedule", ready: "Callable[[], None] | None") -> None:
    """A schedule: memprof records the steps it selects, and is off between them."""
    windows = Windows(schedule, c.phases, c.ledger, c.run, ready, suspend=c.suspend, wake=c.wake)
    c.schedule, c.windows = schedule, windows
    c.phases.gate = windows
    c.params.while_paused = windows.backward_ran_while_paused
    c.optimizers.while_paused = windows.optimizer_stepped_while_paused
    c.modules.at_forward = windows.at_forward
    windows.start()


def _global_hook(stack: "UndoStack", module: object, register: str, registry: str, hook: Callable[..., object]) -> None:
    """``hook`` registered with torch's global ``module.register(hook)``, its removal on ``stack`` first: a signal
    handler's exception (Ctrl-C) landing after the registration returned and before its handle reached the stack
    left the hook installed for the rest of the process (a suite's storm of interrupts found it). The removal
    takes out of torch's ``module.registry`` (an ordered dict of handle ids, torch/optim/optimizer.py,
    torch/nn/modules/module.py) every entry that is ``hook``; a torch without that dict gets the handle's removal
    after the registration, as before."""
    hooks = getattr(module, registry, None)
    if not isinstance(hooks, dict):
        stack.callback(getattr(module, register)(hook).remove)
        return
    stack.callback(_drop, hooks, hook)
    getattr(module, register)(hook)


def _drop(hooks: "dict[int, object]", hook: object) -> None:
    for key in [k for k, v in hooks.items() if v is hook]:
        del hooks[key]
