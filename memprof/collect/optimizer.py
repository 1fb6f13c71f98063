"""Optimizers: the optimizer phase, optimizer state, and the optimizers a training loop really steps.

torch's global step hooks fire for every optimizer whose ``step()`` runs, the
innermost one of a wrapper. memprof follows wrappers to that optimizer
(accelerate's ``AcceleratedOptimizer`` and DeepSpeed's keep it as
``.optimizer``, Lightning's ``LightningOptimizer`` as ``._optimizer``), and
also measures any other optimizer that steps the model's parameters (created
inside the block, re-created, or never passed), naming it in a note. State
tensors become optimizer states when ``step()`` returns, moved back into the
step's peak if they were created during it (lazily created state).
"""

from __future__ import annotations

import operator
import threading
import weakref
from itertools import chain
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch

from ..vocabulary import Phase
from ..errors import InvalidArgumentError, error_text, is_interrupt
from ..record.specs import OptimizerSpec, ParamSpec, plain_config
from .hook_objects import hook_object
from .ledger import ACTIVATIONS, INPUTS, OPTIMIZER_STATES, TEMPORARIES, known_as, plain_storage_keys
from .moves import move
from .module_table import class_names
from .torch_compat import is_compiling as _is_compiling

if TYPE_CHECKING:
    from .aliases import Args, Kwargs
    from .carry import StepCarry
    from .dispatch import StorageTracker
    from .ledger import Ledger
    from .params import ParamTracker
    from .phases import PhaseTracker
    from .state import Run
    from .undo import UndoStack

__all__ = ["OptimizerTracker", "as_optimizers"]

_PLAIN = torch.Tensor
_STRIDED = torch.strided
_chain = chain.from_iterable


def _nothing() -> None:
    pass


class OptimizerTracker:
    """The optimizers of the model and their state.

    Two slots the profiler wires: ``sync_model`` adopts what the model gained (when the parameter tracker
    says it changed) before a step reads its parameters, ``while_paused`` is told of a step that ended
    while a schedule paused the profile.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], ledger: "Ledger", run: "Run",
                 storages: "StorageTracker", params: "ParamTracker", phases: "PhaseTracker",
                 stack: "UndoStack") -> None:
        self.ledger = ledger
        self.run = run
        self.storages = storages
        self.params = params
        self.phases = phases
        self.stack = stack
        self.sync_model: Callable[[], None] = _nothing
        self.while_paused: Callable[[], None] = _nothing
        self.given_ids = {id(o) for o in optimizers}
        self.given = [weakref.ref(o) for o in optimizers]
        self.discovered: list[weakref.ref[torch.optim.Optimizer]] = []
        self.cache: dict[int, tuple[weakref.ref[torch.optim.Optimizer], bool]] = {}
        self.class_name: "str | None" = None
        self.implementation: "str | None" = None
        self.carry: "StepCarry | None" = None  # exact mode's carried optimizer steps (carry.py), where on
        # Is a tensor on the profiled device's type (Tensor.is_cpu, is_cuda...)? Where torch has no such property,
        # None, and every step walks the state.
        flag = f"is_{run.device.type}"
        self.on_device = operator.attrgetter(flag) if hasattr(torch.Tensor, flag) else None

    def all(self) -> list[torch.optim.Optimizer]:
        """The optimizers passed to profile(), else those seen stepping the model."""
        given = [o for o in (r() for r in self.given) if o is not None]
        return given or [o for o in (r() for r in self.discovered) if o is not None]

    def start(self) -> None:
        stack = self.stack
        for opt in (r() for r in self.given):
            if opt is not None:
                self.note(opt)
                self.collect_state(opt, retro=False)
                register = getattr(opt, "register_load_state_dict_post_hook", None)
                if register is not None:
                    # State loaded inside the block (resuming from a checkpoint) is state before any step.
                    stack.callback(register(hook_object(self.loaded)).remove)

    def loaded(self, opt: torch.optim.Optimizer) -> None:
        if self.run.active:
            self.collect_state(opt, retro=False)

    def is_ours(self, opt: torch.optim.Optimizer) -> bool:
        """Does ``opt`` step the model: one passed to profile(), or any other holding its parameters
        (created inside the block, re-created, or not passed at all)?"""
        if id(opt) in self.given_ids:
            return True
        cached = self.cache.get(id(opt))
        if cached is not None and cached[0]() is opt:
            return cached[1]
        params = self.params
        known = any(params.holds(p) for g in opt.param_groups for p in g["params"])
        self.cache[id(opt)] = (weakref.ref(opt), known)
        return known

    # -- torch's global step hooks ----------------------------------------------------------

    def pre_hook(self, opt: torch.optim.Optimizer, args: "Args", kwargs: "Kwargs") -> "tuple[Args, Kwargs] | None":
        run = self.run
        if _is_compiling():
            return None
        if not run.active:
            if not run.paused or not self.is_ours(opt):
                return None
            # A step the schedule does not watch: its window may begin inside the closure's forward,
            # and an optimizer not passed to profile() must be known when a window begins.
            self.discover(opt)
            return self._wrapped(args, kwargs)
        self.ledger.settle()  # what torch released since: the step's start reads the totals
        if threading.get_ident() == run.thread:
            params = self.params
            if params.changed or params.pending:
                self.sync_model()
            params.resync_storages()
        if not self.is_ours(opt):
            return None
        phases = self.phases
        phases.optimizer_seen = True
        self.discover(opt)
        self.note(opt)
        wrapped = self._wrapped(args, kwargs)
        fresh = wrapped is None and run.phase is not Phase.OPTIMIZER
        if wrapped is None:
            self.params.walk_grads()
            if fresh:
                phases.begin(Phase.OPTIMIZER)
        if self.carry is not None:  # measured or carried (a closure's step is always measured)
            self.carry.step_begins(opt, args, kwargs, fresh=fresh, closure=wrapped is not None)
        return wrapped

    def discover(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer of the model stepped: measured from now on, also when not passed to profile()."""
        if id(opt) not in self.given_ids and all(r() is not opt for r in self.discovered):
            self.discovered.append(weakref.ref(opt))
            if self.given_ids:
                self.run.changes.append(
                    f"step {self.run.step}: {type(opt).__name__} not passed to profile() stepped the "
                    "model's parameters (its state is measured from its first step)")

    def _wrapped(self, args: "Args", kwargs: "Kwargs") -> "tuple[Args, Kwargs] | None":
        """``step(closure)`` runs forward and backward inside the step (Lightning's automatic optimisation,
        LBFGS): the optimizer phase begins when the closure returns. The wrapper returns what the closure
        returns; the step computes exactly as without it. None when there is no closure."""
        # args[0] is the optimizer itself (torch passes the step's own arguments through).
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if not callable(closure):
            return None
        kwargs = dict(kwargs)
        kwargs["closure"] = self._after(closure)
        return tuple(args[:1]), kwargs

    def _after(self, closure: Callable[[], object]) -> Callable[[], object]:
        run, params, phases = self.run, self.params, self.phases

        def closure_then_step() -> object:
            result = closure()
            if run.active and not _is_compiling():
                params.walk_grads()
                if run.phase is not Phase.OPTIMIZER:
                    phases.begin(Phase.OPTIMIZER)
            return result

        return closure_then_step

    def post_hook(self, opt: torch.optim.Optimizer, args: "Args", kwargs: "Kwargs") -> None:
        if not self.run.active:
            if self.run.paused and not _is_compiling() and self.is_ours(opt):
                self.phases.optimizer_seen = True
                self.while_paused()  # a step the schedule does not watch ended
            return None
        if _is_compiling() or not self.is_ours(opt):
            return None
        self.ledger.settle()  # what the step released: its state and its end read the ledger
        if self.carry is not None:  # a carried step's replay comes first, where its ops were
            self.carry.step_ends(opt, self.collect_state)
        self.collect_state(opt, retro=True)
        self.params.release_stale_grads()
        self.phases.optimizer_stepped()
        return None

    def collect_state(self, opt: torch.optim.Optimizer, *, retro: bool) -> None:
        led = self.ledger
        entries = led.entries
        storages = self.storages
        if self.on_device is not None:
            # The common case after the first step, every state tensor known, found without a Python loop. Only
            # the profiled device's tensors count (Adam keeps its step counts on the CPU for a GPU model); a
            # state that is not a dict, a value that is no tensor or a tensor of a subclass takes the walk.
            try:
                keys = plain_storage_keys(list(filter(self.on_device, _chain(map(dict.values, opt.state.values())))))
            except (TypeError, AttributeError) as failure:
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                keys = None
            if keys is not None and known_as(entries, keys, OPTIMIZER_STATES):
                return
        for state in opt.state.values():
            if not isinstance(state, dict):
                continue
            for value in state.values():
                # After every step, for every state tensor: a plain tensor already known is found with no
                # Python call (add_tensor's checks are for what is new, or not a plain strided tensor).
                if type(value) is _PLAIN and value.layout is _STRIDED:
                    try:
                        entry = entries.get(value.untyped_storage()._cdata)
                    except (RuntimeError, NotImplementedError) as failure:
                        if is_interrupt(failure):
                            raise  # a signal handler's exception (errors.is_interrupt) is the user's
                        entry = None
                    if entry is None:
                        entry = storages.add_tensor(value, OPTIMIZER_STATES)
                elif isinstance(value, torch.Tensor):
                    entry = storages.add_tensor(value, OPTIMIZER_STATES)
                else:
                    continue
                if entry is not None and entry.cat in (TEMPORARIES, INPUTS, ACTIVATIONS):
                    move(led, entry, OPTIMIZER_STATES, retro=retro)

    def note(self, opt: torch.optim.Optimizer) -> None:
        """The first optimizer's class and implementation, for the report."""
        if self.class_name is not None:
            return
        from ..anatomy.optimizers import param_group_implementations

        self.class_name = f"{type(opt).__module__}.{type(opt).__qualname__}"
        try:
            # Decided as torch decides it (foreach defaults, per-class rules), group by group.
            impls = set(param_group_implementations(opt))
            self.implementation = impls.pop() if len(impls) == 1 else "mixed"
        except Exception as failure:  # an unusual optimizer must never break the measurement
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            self.implementation = None

    def specs(self, whole: "Mapping[int, tuple[int, ...]] | None" = None) -> tuple[OptimizerSpec, ...]:
        """What the optimizer formulas need of each optimizer: class, groups, parameters (``whole``: the shape to
        record for a parameter that holds a rank's shard, by id)."""
        out = []
        for opt in self.all():
            try:
                out.append(optimizer_spec(opt, whole))
            except Exception as exc:  # an unusual optimizer must never break the measurement
                if is_interrupt(exc):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                # error_text(): the exception's own __str__ may fail too, and this runs while the profile closes.
                self.run.notes.append(f"could not record {type(opt).__name__} for its formula: {error_text(exc)}")
        return tuple(out)


def optimizer_spec(opt: torch.optim.Optimizer, whole: "Mapping[int, tuple[int, ...]] | None" = None) -> OptimizerSpec:
    """What the optimizer formulas need of ``opt``: its classes, groups and parameters (facts, no formula); a
    parameter in ``whole`` (FSDP1's flat shards, by id) is recorded at the shape given there."""
    from ..anatomy.optimizers import param_group_implementations

    params: list[ParamSpec] = []
    index: dict[int, int] = {}
    groups = []
    impls = param_group_implementations(opt)
    for group, impl in zip(opt.param_groups, impls):
        rows = []
        for p in group["params"]:
            if id(p) not in index:
                index[id(p)] = len(params)
                shape = whole.get(id(p)) if whole else None
                shape = tuple(p.shape) if shape is None else shape
                params.append(ParamSpec(shape, str(p.dtype).replace("torch.", ""), p.device.type,
                                        bool(p.requires_grad), type(p) in (torch.Tensor, torch.nn.Parameter)))
            rows.append(index[id(p)])
        groups.append((plain_config(group), tuple(rows), impl))
    args = getattr(opt, "args", None)
    return OptimizerSpec(class_names(type(opt), torch.optim.Optimizer), tuple(groups), tuple(params),
                         plain_config(vars(args)) if args is not None and hasattr(args, "__dict__") else ())


def as_optimizers(optimizer: object) -> list[torch.optim.Optimizer]:
    """What profile() was given as optimizer(s), unwrapped; a clear error for anything else."""
    if optimizer is None:
        return []
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    out = []
    for item in items:
        inner = unwrap_optimizer(item)
        if inner is None:
            raise InvalidArgumentError(
                f"optimizer must be a torch.optim.Optimizer (or a wrapper of one, such as accelerate's "
                f"AcceleratedOptimizer), a list of them, or None; got {type(item).__name__}"
            )
        out.append(inner)
    return out


def unwrap_optimizer(opt: object) -> "torch.optim.Optimizer | None":
    """The torch optimizer a wrapper drives: accelerate's AcceleratedOptimizer and DeepSpeed's wrap
    it as ``.optimizer``, Lightning's LightningOptimizer as ``._optimizer``. torch's step hooks fire
    for the optimizer whose step() runs, the innermost one, so that is the one memprof must follow."""
    chain = [opt]
    while len(chain) < 8:  # wrappers of wrappers; a cycle ends here too
        inner = next((c for c in (getattr(chain[-1], a, None) for a in ("optimizer", "_optimizer"))
                      if c is not None and all(c is not o for o in chain)), None)
        if inner is None:
            break
        chain.append(inner)
    # The innermost torch optimizer: an Optimizer subclass whose `optimizer` attribute is something
    # else (not an optimizer) is itself the one that steps.
    return next((o for o in reversed(chain) if isinstance(o, torch.optim.Optimizer)), None)
