"""The target twin, the simulation's first stage: the model's data-less copy and what runs above and beneath it.

A simulation runs the user's step on a twin of the model whose parameters and buffers hold no data (``meta``
tensors, or fake CPU tensors for a CPU target, whose kernels are the CPU's), with the rules the target device
applies above the ops: its attention kernel (:mod:`memprof.simulate.kernels`), its autocast policy
(:mod:`memprof.simulate.autocast`), the CPU kernels that keep another storage than their shape
(:mod:`memprof.simulate.cpu_kernels`), value-dependent code and MoE routing (:mod:`memprof.simulate.moe`). The
user's model, optimizer and tensors are never modified.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ..errors import InvalidArgumentError, UnknownNameError, is_interrupt
from .autocast import CudaAutocast
from .fused_counters import counters_on_device
from .held_signals import deepcopy_held
from .modes import Rule, Rules

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..anatomy.gpus import GpuSpec
    from .aliases import UserValue
    from .autocast import AutocastFactory
    from .cpu_kernels import CpuKernels
    from .op_chain import OpRule
    from .parallel import ParallelRun
    from .sparse_kernels import SparseKernels

__all__ = ["Twin", "PRECISION_DTYPES", "MIXED", "meta_optimizer", "converted", "casting", "refuse_closure_step",
           "refuse_value_driven_step"]

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Mixed precision: fp32 parameters, the forward under autocast in this dtype ("amp": the older word).
MIXED = {"mixed": torch.bfloat16, "amp": torch.bfloat16, "mixed-fp16": torch.float16}


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


#: How a data-less twin of a tensor is made (on meta, or fake on the CPU).
Maker = Callable[[torch.Tensor], torch.Tensor]


def _meta_maker(t: torch.Tensor) -> torch.Tensor:
    if t.layout is torch.sparse_coo:
        return _sparse_twin(t, _meta_maker)
    return torch.empty_like(t, device="meta")


def _sparse_twin(t: torch.Tensor, make: Maker) -> torch.Tensor:
    """A sparse COO tensor's twin: its indices' and values' twins (``make``), as many elements as it holds. A
    strided twin of its shape held none (a sparse buffer of 320 B counted as 4 B, a review's finding)."""
    indices, values = make(t._indices()), make(t._values())
    twin: torch.Tensor = torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors.default(
        t.sparse_dim(), t.dense_dim(), list(t.shape), indices, values, dtype=values.dtype, layout=torch.sparse_coo,
        device=values.device, is_coalesced=t.is_coalesced())
    return twin


def casting(make: Maker, dtype: torch.dtype) -> Maker:
    """``make``, with floating tensors made in ``dtype`` (same shape and strides)."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.layout is torch.sparse_coo:
            return _sparse_twin(t, cast)  # its values cast, its indices as they are
        if t.is_floating_point() and t.dtype != dtype:
            t = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")
        return make(t)
    return cast


def _fake_maker(mode: FakeTensorMode) -> Maker:
    def make(t: torch.Tensor) -> torch.Tensor:
        if t.layout is torch.sparse_coo:
            return _sparse_twin(t, make)
        with mode:
            # Same shape, dtype and strides as the original, on the CPU, with no data.
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return make


def _shadow_copy(model: nn.Module, make: Maker) -> tuple[nn.Module, dict[int, torch.Tensor]]:
    # deepcopy with a memo that maps every parameter and buffer to a data-less
    # twin (meta or fake): structure and tying are kept, no data is copied.
    memo: dict[int, object] = {}
    mapping: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        if id(p) not in memo:
            twin = nn.Parameter(make(p.detach()), requires_grad=p.requires_grad)
            memo[id(p)] = twin
            mapping[id(p)] = twin
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = make(b)
    for module in model.modules():
        for name, value in vars(module).items():
            # A tensor an autograd graph made, kept as a plain attribute (the deprecated nn.utils.weight_norm's
            # weight, recomputed by its pre-hook at every call): deepcopy refuses it ("Only Tensors created
            # explicitly by the user support the deepcopy protocol"); its data-less twin stands for it where a
            # forward pre-hook can make it again. One the forward uses as it is would carry its parameters'
            # gradients through a graph the twin does not have: refused, not simulated without them.
            if isinstance(value, torch.Tensor) and not value.is_leaf and id(value) not in memo:
                if not module._forward_pre_hooks:
                    raise InvalidArgumentError(
                        f"{type(module).__name__}.{name} is a tensor an autograd graph made (from parameters, at "
                        "construction) and the module keeps it as a plain attribute, which no forward pre-hook "
                        "makes again: its data-less copy would have no graph to its parameters, whose gradients "
                        "the estimate would lose; compute it in forward (or in a forward pre-hook) instead")
                memo[id(value)] = make(value.detach())
    try:
        clone = deepcopy_held(model, memo)  # a Ctrl-C in it could be dropped (held_signals)
    except Exception as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise InvalidArgumentError(
            f"could not copy {type(model).__name__} without its data ({exc}); build the model under "
            "'with torch.device(\"meta\"):' and pass that instead"
        ) from None
    return clone, mapping


def meta_optimizer(optimizer: object, meta_model: nn.Module, mapping: dict[int, torch.Tensor],
                    notes: list[str], target: "torch.device | None" = None,
                    fake_mode: "FakeTensorMode | None" = None) -> "torch.optim.Optimizer | None":
    """The optimizer rebuilt (or built, from a factory) on the twin's parameters, stepping as it steps on
    ``target`` (:func:`_stepping_as_on`), its constructor's scalars lifted into ``fake_mode`` (:func:`_lifted`)."""
    opt = _built(optimizer, meta_model, mapping, notes, target)
    if opt is not None and target is not None:
        _stepping_as_on(opt, target, notes)
    if opt is not None and fake_mode is not None:
        _lifted(opt, fake_mode)
    return opt


def _lifted(optimizer: torch.optim.Optimizer, fake_mode: "FakeTensorMode") -> None:
    """Each real scalar in ``optimizer``'s state (made by its constructor: Adagrad's step counters,
    ``torch.tensor(0.0)`` in its ``__init__``, torch/optim/adagrad.py) made again as the fake tensor a step makes
    of the same call: the fake mode lifts a real scalar into a fake tensor that keeps its value
    (``aten.lift_fresh_copy``, ``FakeTensor.constant``), as Adam's counter made in its first step is. Left real,
    the mode fakes it without its value at its first op, and the step's ``_get_value(step)`` (``.item()``) fails
    where a real run reads the count. Only the states of the twin's own (fake) parameters: an optimizer built on the
    user's parameters (a factory that returns the user's own optimizer) is the user's, refused later and never
    changed. A scalar several states share stays one tensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    lifted: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        # A hyperparameter given as a tensor (momentum=torch.tensor(0.9), a tensor lr): torch.optim branches on
        # its value (`if momentum != 0` makes the momentum buffer), which a faked copy would not hold.
        if not all(isinstance(p, FakeTensor) for p in group["params"]):
            continue
        for key, value in list(group.items()):
            if key != "params" and _real_scalar(value):
                group[key] = _lift(value, lifted, fake_mode)
    for param, state in optimizer.state.items():
        if not isinstance(param, FakeTensor) or not isinstance(state, dict):
            continue  # the user's parameter, or a class of the user's own keeping what it likes: not ours to change
        for key, value in list(state.items()):
            if _real_scalar(value):
                state[key] = _lift(value, lifted, fake_mode)


def _real_scalar(value: object) -> bool:
    """A real (not fake) one-element CPU tensor: what the fake mode lifts with its value."""
    from torch._subclasses.fake_tensor import FakeTensor

    return (type(value) is torch.Tensor and value.numel() == 1 and value.device.type == "cpu"
            and not isinstance(value, FakeTensor))


def _lift(value: torch.Tensor, lifted: dict[int, torch.Tensor], fake_mode: "FakeTensorMode") -> torch.Tensor:
    """``value`` lifted into ``fake_mode`` keeping its value, once per tensor (``lifted``, by id)."""
    made = lifted.get(id(value))
    if made is None:
        with fake_mode:
            made = lifted[id(value)] = torch.ops.aten.lift_fresh_copy.default(value)
    return made


def _built(optimizer: object, meta_model: nn.Module, mapping: dict[int, torch.Tensor],
           notes: list[str], target: "torch.device | None") -> "torch.optim.Optimizer | None":
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        _refuse_capturable(optimizer)
        groups = [{**g, "params": [mapping[id(p)] for p in g["params"] if id(p) in mapping]}
                  for g in optimizer.param_groups]
        opt = _rebuilt(optimizer, groups, notes, target)
        if opt is not None and optimizer.state:
            from .warm_state import carry_state

            carry_state(optimizer, opt, mapping, notes)
        return opt
    if callable(optimizer):
        opt = optimizer(meta_model.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise InvalidArgumentError("the optimizer factory must return a torch.optim.Optimizer")
        _refuse_capturable(opt)
        # A factory's fused torch optimizer (lambda ps: AdamW(ps, fused=True)) is rebuilt unfused as an instance is:
        # torch refuses a fused step on meta tensors. A class of the user's own is left as built: its constructor may
        # need more than its groups, and its step is its own.
        if _fused(opt.param_groups) and type(opt).__module__.startswith("torch.optim"):
            return _rebuilt(opt, [dict(g) for g in opt.param_groups], notes, target)
        return opt
    raise InvalidArgumentError(
        "optimizer must be a torch.optim.Optimizer, a factory taking parameters, or None; "
        f"got {type(optimizer).__name__}"
    )


def refuse_closure_step(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer whose ``step`` cannot be called without arguments (one that must be given a closure that
    evaluates the model) refused for memprof's own loop, which calls ``step()`` as a training loop does for any
    other optimizer: the fix is the user's own step, which calls ``step(closure)`` as their loop does. torch's
    LBFGS is refused in any loop, before this (:func:`refuse_value_driven_step`)."""
    import inspect

    try:
        inspect.signature(optimizer.step).bind()
    except TypeError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise InvalidArgumentError(
            f"{type(optimizer).__name__}.step() needs an argument (a closure that evaluates the model), which "
            "memprof's own loop does not give: give train_step=fn, where fn(model, optimizer, batch) (with "
            "targets=: fn(model, optimizer, batch, targets)) calls optimizer.step(closure) as your loop does "
            "(memprof estimate --train-step module:fn)") from None
    except ValueError as failure:  # a step with no signature Python can read (a C function): nothing to check
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return


def refuse_value_driven_step(optimizer: "torch.optim.Optimizer | None") -> None:
    """torch's LBFGS refused, in memprof's loop and the user's: its step evaluates the model as many times as its
    line search and stopping tests decide from the loss's and the gradients' values, and keeps a history of
    directions whose length follows them (torch/optim/lbfgs.py). Shape-only tensors hold no values: answered 0
    they stop it after one evaluation, and a 2-step estimate came out 4.9 times under the real run's peak."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InvalidArgumentError(
            "LBFGS cannot be simulated: how many times its step evaluates the model and how much history it keeps "
            "follow the loss's and the gradients' values, which shape-only tensors do not hold; measure a real "
            "step with memprof.profile(model, optimizer) instead")


def _refuse_capturable(optimizer: torch.optim.Optimizer) -> None:
    """A torch optimizer built ``capturable=True`` is refused, saying why and what to estimate instead: its step
    asserts that every parameter is on a device CUDA graphs capture (``torch/optim/adam.py`` and the others), which
    the simulation's shape-only tensors are not, and its step counters on the device are not simulated."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return  # a class of the user's own: its step is its own
    if any(g.get("capturable") for g in optimizer.param_groups):
        raise InvalidArgumentError(
            f"{type(optimizer).__name__}(capturable=True) cannot be simulated: its step asserts every parameter is on "
            "a device CUDA graphs capture, which shape-only tensors are not (a run on the CPU fails the same "
            "assertion). Estimate with capturable=False: the same states, where a CUDA run with capturable=True holds "
            "one more 512-byte block per parameter tensor (its step counter, kept on the device) and small "
            "temporaries of its step")


#: torch's optimizers whose foreach step runs on shape-only tensors (tests/integration/test_sim_foreach.py runs
#: each); ASGD's reads its step counters' values (``_multi_tensor_asgd``'s ``_get_value(step)``), answered 0 in the
#: simulation (:class:`memprof.simulate.user_step.LoopValues`) as the for-loop's are.
_FOREACH_SIMULATED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad,
                      torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax, torch.optim.Adadelta, torch.optim.Rprop,
                      torch.optim.ASGD)


def _stepping_as_on(optimizer: torch.optim.Optimizer, target: torch.device, notes: list[str]) -> None:
    """Each parameter group left to torch's choice (``foreach=None``) given the implementation torch chooses for
    parameters on ``target``: on CUDA the foreach step (``_default_to_fused_or_foreach``, torch/optim/optimizer.py),
    whose temporaries are a list of every parameter's, where the twin's meta or fake CPU parameters would choose the
    for-loop, one parameter's at a time (an AdamW step on CUDA holds a square root of every state at once)."""
    from ..anatomy.optimizers import param_group_implementations

    chosen = param_group_implementations(optimizer, device=target.type)
    left = [g for g, how in zip(optimizer.param_groups, chosen) if how == "foreach" and g.get("foreach", False) is None]
    if not left:
        return
    if not isinstance(optimizer, _FOREACH_SIMULATED):
        notes.append(f"{type(optimizer).__name__}'s step on {target.type} is torch's foreach implementation, which "
                     "reads values shape-only tensors do not hold: simulated with its for-loop, whose temporaries "
                     "are one parameter's at a time where the foreach step's are a list of every parameter's")
        return
    for group in left:
        group["foreach"] = True
    notes.append(f"optimizer step: {type(optimizer).__name__}'s foreach implementation, as torch chooses it for "
                 f"parameters on {target.type} (foreach=None)")


def _fused(groups: "list[dict[str, object]]") -> bool:
    return any(g.get("fused") for g in groups)


def _rebuilt(optimizer: torch.optim.Optimizer, groups: "list[dict[str, object]]", notes: list[str],
             target: "torch.device | None") -> "torch.optim.Optimizer | None":
    """``optimizer``'s class built on ``groups`` (the meta model's parameters), unfused: fused kernels do not run on
    meta tensors, and their step keeps no temporaries (measured with torch 2.13, see
    docs/anatomy.md#measured-optimizer-state-and-step-transients), so the unfused step's are an upper bound; on a
    CUDA ``target`` the fused step's counters on the device are made beside the unfused step's on the host
    (:mod:`memprof.simulate.fused_counters`). None, with a note, where the class cannot be built so."""
    fused = [i for i, g in enumerate(groups) if g.get("fused")]
    if fused:
        # Only the fused groups: a group's fused=False with foreach unset runs torch's for-loop step, where None
        # would let torch choose foreach.
        # foreach=False: the for-loop step, whose temporaries (one parameter's at a time) are the least that bound
        # the fused step's on any target (foreach's are a list of every parameter's).
        groups = [{**g, "fused": None, "foreach": False} if g.get("fused") else g for g in groups]
        notes.append("fused optimizer simulated unfused: its real step keeps no temporaries")
    # The optimizer's own class, built as a user builds it: its constructor (not Optimizer's) gives the defaults.
    rebuilt: Callable[..., torch.optim.Optimizer] = type(optimizer)
    try:
        opt = rebuilt(groups)
    except Exception as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        notes.append(f"{type(optimizer).__name__} could not be rebuilt on meta tensors ({exc}); "
                     "optimizer state is from the formula only")
        return None
    if target is not None and target.type == "cuda" and counters_on_device(opt, fused):
        notes.append("fused optimizer: its step counters are on the device, as the fused step keeps them (the "
                     "unfused step's on the host beside them)")
    return opt


def whole_storages(make: Maker) -> Maker:
    """``make`` for the run's inputs on the CPU target, where a tensor is the user's own: a view of a larger storage
    (a batch sliced from a dataset held as one tensor, ``data[:2]``) is made as the same view of a twin of the whole
    storage, one per storage, as the real run holds the whole storage. ``make`` alone made the view's extent only:
    the estimate's inputs were under by the rest of the storage (5,952 B for 2 rows of a 64-row tensor, a new
    user's sweep). A storage whose bytes are not whole elements of the view's dtype is made as bytes, viewed in it."""
    bases: dict[int, torch.Tensor] = {}

    def made(t: torch.Tensor) -> torch.Tensor:
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return make(t)
        storage = t.untyped_storage()
        size, item = storage.nbytes(), t.element_size()
        if t.storage_offset() == 0 and t.is_contiguous() and t.nbytes == size:
            return make(t)
        base = bases.get(storage._cdata)
        if base is None:
            if size % item:  # bytes that are no whole element of t's dtype (a float view of a byte buffer)
                raw = make(torch.empty(size, dtype=torch.uint8, device="meta"))
                base = raw[:size - size % item].view(t.dtype)
            else:
                base = make(torch.empty(size // item, dtype=t.dtype, device="meta"))
            bases[storage._cdata] = base
        return base.as_strided(t.shape, t.stride(), t.storage_offset())
    return made


def converted(obj: UserValue, make: Maker, seen: dict[int, torch.Tensor]) -> UserValue:
    """``obj`` with each tensor in its tuples, lists and dicts replaced by its data-less twin (one per tensor,
    through ``seen``); other values as they are."""
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            made = seen[id(obj)] = make(obj)
            if obj.requires_grad and made.is_leaf and not made.requires_grad:
                # An input the user asks the gradient of holds it after backward, as the real one does (its twin
                # held none: a review found the estimate 1,024 B under from the first backward).
                made.requires_grad_(True)
            _carry_grad(obj, made, make, seen)
        return seen[id(obj)]
    if isinstance(obj, tuple):
        return tuple(converted(o, make, seen) for o in obj)
    if isinstance(obj, list):
        return [converted(o, make, seen) for o in obj]
    if isinstance(obj, dict):
        return {k: converted(v, make, seen) for k, v in obj.items()}
    return obj


def _carry_grad(obj: torch.Tensor, made: torch.Tensor, make: Maker, seen: dict[int, torch.Tensor]) -> None:
    """An input whose gradient the user's process already holds (a warm-up step outside the run): its twin holds
    that gradient's twin, into which backward accumulates as it does into the real one, live from the start (a
    fresh one made by the first backward was 20,480 B over the real run there, a new user's sweep)."""
    grad = obj.grad if obj.is_leaf and obj.requires_grad else None
    if grad is None or not made.is_leaf or not made.requires_grad:
        return
    twin = converted(grad, make, seen)
    if isinstance(twin, torch.Tensor) and (twin.shape, twin.dtype, twin.device) == (made.shape, made.dtype,
                                                                                  made.device):
        made.grad = twin  # (else, a gradient autograd would refuse: the first backward makes a fresh one)


class Twin:
    """What a simulation for one target device and precision runs with: the model's data-less twin, the
    fake-tensor mode (CPU) or meta tensors (other devices), autocast, and the rules of
    :mod:`memprof.simulate.kernels` / :mod:`memprof.simulate.autocast`. Shared by :func:`estimate` and
    :func:`memprof.estimate_generation`."""

    def __init__(self, model: nn.Module, precision: "str | None", device: "str | torch.device | None",
                 attention: str, routing: object = None, run: "ParallelRun | None" = None,
                 gpu: "GpuSpec | None" = None) -> None:
        if precision is not None and precision not in PRECISION_DTYPES and precision not in MIXED:
            raise UnknownNameError(f"unknown precision {precision!r}; use one of: fp32, bf16, fp16, mixed, mixed-fp16 "
                                   "(amp is mixed)")
        try:
            target = torch.device(device) if device is not None else _model_device(model)
        except (RuntimeError, ValueError, TypeError) as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
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
        cpu_kernels, sparse_kernels = _storage_rules(model, target)
        custom = CustomOps()
        # Only models built from transformers can reach its mask helpers: no cost for the others.
        watched = ValueDependentCode() if any(type(m).__module__.startswith("transformers.")
                                              for m in model.modules()) else None
        notes: list[str] = []

        fake_mode: "FakeTensorMode | None" = None
        if target.type == "cpu" or run is not None:
            # Fake CPU tensors: shapes only, like meta, but kernels are chosen as on the CPU
            # (fused attention, dropout), so the simulation matches a real CPU run op for op.
            from torch._subclasses.fake_tensor import FakeTensorMode

            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        shadow = _fake_maker(fake_mode) if fake_mode is not None else _meta_maker
        # bf16/fp16: the twins are made in that dtype, as model.to(dtype) would cast floating parameters and
        # buffers. (Casting the twins afterwards fails for fake CPU tensors: nn.Module._apply swaps tensor
        # subclasses, which FakeTensors refuse outside their mode.)
        cast = PRECISION_DTYPES[precision] if precision in ("bf16", "fp16") else None
        if run is not None:  # the user's parallelize function on a meta twin, then fake CPU tensors
            meta = _meta_maker if cast is None else casting(_meta_maker, cast)
            assert fake_mode is not None  # made above for every run
            meta_model, mapping = run.parallelize(model, lambda m: _shadow_copy(m, meta), fake_mode)
        else:
            meta_model, mapping = _shadow_copy(model, shadow if cast is None else casting(shadow, cast))
            if fake_mode is not None:
                from .conversions import convert_as_real_modules

                convert_as_real_modules(meta_model)
        autocast: "AutocastFactory | None" = None
        emulated: "CudaAutocast | None" = None
        low = MIXED.get(precision or "")
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
        self.cpu_kernels, self.sparse_kernels = cpu_kernels, sparse_kernels
        from .moe import MoeRules

        self.moe = MoeRules(target.type, routing)

    def beneath(self, *outer: "OpRule") -> _entered:
        """What a simulated run enters beneath the collector, the rules in one dispatch mode
        (:mod:`memprof.simulate.op_chain`), the first applied first: ``outer`` (a parallel run's), value shadows
        and ``_grouped_mm`` on every target (:mod:`memprof.simulate.moe`), the storage the CPU's kernels give their
        outputs on a CPU target (:mod:`memprof.simulate.cpu_kernels`) or the sparse kernels' on another where the
        model makes sparse gradients (:mod:`memprof.simulate.sparse_kernels`), and the meta kernels' answers kept
        (:mod:`memprof.simulate.meta_kernels`); over the fake-tensor mode where the run has one. The collector
        counts what the rules return."""
        from .failures import QuietMetaFailures
        from .meta_kernels import MetaKernelCache, answerable
        from .op_chain import OpChain

        mode = self.fake_mode
        rules = [*outer, *(r for r in (self.moe.shadows, self.cpu_kernels, self.sparse_kernels) if r is not None)]
        if mode is None:
            rules.append(MetaKernelCache())
        elif answerable(mode):  # else its answers depend on more than the arguments' metadata: none is kept
            rules.append(MetaKernelCache(mode))
        chain = OpChain(*rules)
        return _entered(QuietMetaFailures(), mode, chain) if mode is not None else _entered(chain)

    def rules(self) -> Rules:
        # One mode, in this order: autocast's casts happen before the kernel choice sees the tensors; the router
        # sees the scores as the model made them.
        return Rules(*(r for r in (self.emulated, self.kernels, self.watched, self.custom, self.moe.router,
                                   self.moe.values, self._foreach()) if r is not None))

    def _foreach(self) -> "Rule | None":
        """The DTensor foreach rule (:mod:`memprof.simulate.dtensor_foreach`), where the twin holds DTensors."""
        from torch.distributed.tensor import DTensor

        from .dtensor_foreach import DTensorForeach

        return DTensorForeach() if any(isinstance(p, DTensor) for p in self.model.parameters()) else None

    def rule_notes(self) -> list[str]:
        out = []
        for rule in (self.kernels, self.cpu_kernels, self.sparse_kernels, self.watched, self.custom, self.emulated):
            if rule is not None:
                out.extend(rule.notes())
        return out + self.moe.notes()


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype).replace("torch.", ""))


def _storage_rules(model: nn.Module, target: torch.device) -> "tuple[CpuKernels | None, SparseKernels | None]":
    """The rules of what the target's kernels give their outputs: the CPU's where they keep another storage than
    the fake kernels give them; on another target, ATen's device-independent sparse code, where the model makes
    sparse gradients (a mode costs a Python call per op: none for the others)."""
    from .cpu_kernels import CpuKernels
    from .sparse_kernels import SparseKernels, in_model

    if target.type == "cpu":
        return CpuKernels(), None
    return None, SparseKernels() if in_model(model) else None


class _entered:
    """``modes`` entered in order (the first lowest on the dispatch stack), exited in reverse.

    A class, not a generator: a Ctrl-C landing in a generator-based context manager's entry left the generator
    suspended, and the garbage collector later ran its exit, popping a mode stack the simulation's cleanup had
    already emptied ("Exception ignored ... trying to pop from empty mode stack")."""

    def __init__(self, *modes: AbstractContextManager[object]) -> None:
        self.modes = modes
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        try:
            for m in self.modes:
                self.stack.enter_context(m)
        except BaseException:
            self.stack.close()
            raise

    def __exit__(self, kind: "type[BaseException] | None", exc: "BaseException | None",
                 tb: "TracebackType | None") -> "bool | None":
        return self.stack.__exit__(kind, exc, tb)
