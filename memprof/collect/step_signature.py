"""What decides an optimizer step's allocations, as one comparable value: when two steps' signatures are
equal, the second allocates and frees what the first did (memprof.collect.carry).

An optimizer's ``step()`` (torch/optim/adam.py, sgd.py ...) chooses its code path from the param groups'
settings (``foreach``, ``fused``, ``capturable``, ``amsgrad``, ``maximize``, ``differentiable``, whether
``weight_decay`` or ``momentum`` is 0) and from its tensors' types, devices and dtypes
(``_default_to_fused_or_foreach`` and ``_group_tensors_by_device_and_dtype``, torch/optim/optimizer.py),
and sizes every temporary from the shapes of the parameters, gradients and state it is handed. So the
signature holds, for each group, every setting (numbers that only scale an update, such as ``lr``, by
type only), every parameter (identity, shape, dtype, device, layout) with its gradient's layout and which
gradients share a storage, every state tensor's shape, dtype and storage, the step's keyword arguments
(GradScaler's for a fused step), and what around the step changes ops: grad mode, autocast, the default
dtype, deterministic algorithms, and the dispatch and function modes on the stack.

``None`` means "never carry": a tensor subclass (DTensor, FSDP's and quantisation libraries' tensors),
a sparse or otherwise non-strided tensor, whose step memprof does not verify exact when carried.
"""

from __future__ import annotations

import operator
from itertools import chain
from typing import TYPE_CHECKING

import torch

from ..errors import is_interrupt
from .ledger import STORAGE_KEY, UNTYPED_STORAGE
from .torch_compat import dispatch_mode_at, dispatch_stack_len

if TYPE_CHECKING:
    from ..anatomy.optimizers import ParamGroup
    from .aliases import Kwargs
    from .dispatch import DispatchMode

#: What a signature is: plain values, compared with == (never read back).
Signature = tuple[object, ...]

__all__ = ["step_signature", "state_signature", "NUMERIC_ONLY", "ZERO_OR_NOT"]

#: Settings whose value only scales an update, never picks a code path or a size: compared by type (a
#: tensor-valued ``lr`` for a capturable step is a different path: compared by shape, dtype and device).
NUMERIC_ONLY = frozenset({"lr", "initial_lr", "betas", "eps", "alpha", "lr_decay", "rho", "lambd", "t0",
                          "momentum_decay", "max_lr", "min_lr", "base_lr", "base_momentum", "max_momentum",
                          "etas", "step_sizes", "beta2_decay"})
#: Settings whose code path depends only on whether they are 0 (``if weight_decay != 0: grad = grad.add(...)``,
#: ``if momentum != 0:`` keeps a momentum buffer): a scheduler cycling them keeps the step carried.
ZERO_OR_NOT = frozenset({"weight_decay", "momentum"})

_PLAIN = torch.Tensor
_PARAMETER = torch.nn.Parameter
_STRIDED = torch.strided
_SCALARS = (bool, int, float, str, type(None))
_ONLY_PLAIN = frozenset((_PLAIN,))
_ONLY_STRIDED = frozenset((_STRIDED,))
_chain = chain.from_iterable
_LAYOUT = operator.attrgetter("layout")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_NBYTES = operator.methodcaller("nbytes")


def _tensor(t: torch.Tensor) -> "Signature | None":
    """A tensor's metadata (no values); None for a subclass or a non-strided layout."""
    if type(t) is not _PLAIN and type(t) is not _PARAMETER or t.layout is not _STRIDED:
        return None
    return (tuple(t.shape), t.dtype, t.device, tuple(t.stride()), t.storage_offset())


_NEVER = object()


def _setting(key: str, value: object) -> object:
    """One setting as the signature compares it; ``_NEVER`` for a tensor the signature cannot hold."""
    if isinstance(value, torch.Tensor):
        meta = _tensor(value)
        return ("tensor", meta) if meta is not None else _NEVER
    if key in NUMERIC_ONLY:
        if isinstance(value, (tuple, list)):
            out = []
            for v in value:
                one = _setting(key, v)
                if one is _NEVER:
                    return _NEVER
                out.append(one)
            return tuple(out)
        return type(value)
    if key in ZERO_OR_NOT and isinstance(value, (int, float)):
        return value == 0
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _SCALARS) for v in value):
        return tuple(value)
    # Anything else (a callable, an object of the user's): the same object, compared by identity.
    return (type(value).__qualname__, id(value))


def _settings(group: "ParamGroup") -> "Signature | None":
    out = []
    # Runs for every group at every step: plain settings (flags, None, a float lr) without a call each.
    for key in sorted(group):
        value = group[key]
        kind = type(value)
        if key == "params":
            continue
        if kind is bool or value is None or kind is str:
            out.append((key, value))
        elif kind is float and key in NUMERIC_ONLY:
            out.append((key, float))
        else:
            value = _setting(key, value)
            if value is _NEVER:
                return None
            out.append((key, value))
    return tuple(out)


def state_signature(opt: torch.optim.Optimizer) -> "Signature | None":
    """Every state tensor's key, metadata and storage (and the type of every other state value), by
    parameter identity; None when one is a tensor subclass or not strided. Compared after a carried step:
    a state tensor replaced or resized is a change the carried step did not make."""
    states = opt.state
    try:
        rows = list(states.values())
        values = list(_chain(map(dict.values, rows)))
    except TypeError as failure:  # a state that is not a dict
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        values = None
    if values is not None and _ONLY_PLAIN.issuperset(map(type, values)) and (
            _ONLY_STRIDED.issuperset(map(_LAYOUT, values))):
        # The common case at every step, every state value a plain strided tensor: the same facts as the
        # rows below, column by column through C iterators, with no Python bytecode per tensor. (Never equal
        # to a signature of rows: a step whose state changed form is measured.)
        storages = list(map(UNTYPED_STORAGE, values))
        return ("columns", tuple(map(id, states)), tuple(map(len, rows)), tuple(_chain(rows)),
                tuple(map(_SHAPE, values)), tuple(map(_DTYPE, values)), tuple(map(_DEVICE, values)),
                tuple(map(STORAGE_KEY, storages)), tuple(map(_NBYTES, storages)))
    out: list[object] = []
    for param, state in opt.state.items():
        if not isinstance(state, dict):
            out.append((id(param), type(state).__qualname__))
            continue
        row: list[object] = [id(param)]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if type(value) is not _PLAIN or value.layout is not _STRIDED:
                    return None
                st = value.untyped_storage()
                row.append((key, tuple(value.shape), value.dtype, value.device, st._cdata, st.nbytes()))
            else:
                # A Python counter (a step count kept as a number): its value changes every step and only
                # enters the arithmetic; its type is compared.
                row.append((key, type(value).__qualname__))
        out.append(tuple(row))
    return tuple(out)


def _params(group: "ParamGroup", shared: dict[int, int]) -> "Signature | None":
    out = []
    # Every parameter at every step: _tensor() inlined.
    for p in group["params"]:
        if type(p) is not _PARAMETER and type(p) is not _PLAIN or p.layout is not _STRIDED:
            return None
        g = p.grad
        if g is None:
            grad: object = None
        else:
            if type(g) is not _PLAIN or g.layout is not _STRIDED:
                return None
            key = g.untyped_storage()._cdata
            # Which earlier gradient shares this one's storage (DDP's gradient_as_bucket_view): a pattern,
            # not an identity, since a backward after zero_grad(set_to_none=True) makes new gradients.
            grad = (g.shape, g.dtype, g.device, g.stride(), g.storage_offset(), shared.setdefault(key, len(shared)))
        out.append((id(p), p.shape, p.dtype, p.device, p.stride(), p.storage_offset(), p.requires_grad, grad))
    return tuple(out)


def _modes(own: "DispatchMode | None") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The dispatch and function modes on the stack (by identity), memprof's own dispatch mode (``own``) left
    out: a mode of the user's may change what the step's ops allocate."""
    dispatch = []
    for i in range(max(dispatch_stack_len(), 0)):
        mode = dispatch_mode_at(i)
        if mode is not own:
            dispatch.append(id(mode))
    functions = []
    length = getattr(torch._C, "_len_torch_function_stack", None)
    at = getattr(torch._C, "_get_function_stack_at", None)
    if length is not None and at is not None:
        for i in range(length()):
            functions.append(id(at(i)))
    return tuple(dispatch), tuple(functions)


def _autocast() -> tuple[tuple[str, "bool | None", "torch.dtype | None"], ...]:
    out: list[tuple[str, "bool | None", "torch.dtype | None"]] = []
    for dev in ("cpu", "cuda"):
        try:
            enabled = torch.is_autocast_enabled(dev)
            out.append((dev, enabled, torch.get_autocast_dtype(dev) if enabled else None))
        except (RuntimeError, TypeError) as failure:  # a torch without that device's autocast
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            out.append((dev, None, None))
    return tuple(out)


def step_signature(opt: torch.optim.Optimizer, kwargs: "Kwargs | None", own_mode: "DispatchMode | None"
                   ) -> "Signature | None":
    """All that decides ``opt.step(**kwargs)``'s allocations now (the module docstring lists it); None when
    the step must be measured whatever happened before (a tensor subclass, a non-strided tensor)."""
    groups: list[object] = []
    shared: dict[int, int] = {}
    for group in opt.param_groups:
        settings = _settings(group)
        params = _params(group, shared)
        if settings is None or params is None:
            return None
        groups.append((settings, params))
    state = state_signature(opt)
    defaults = _settings(opt.defaults) if isinstance(opt.defaults, dict) else None
    if state is None or defaults is None:
        return None
    step_kwargs = []
    given = kwargs or {}
    for key in sorted(given):
        value = _setting(key, given[key])
        if value is _NEVER:
            return None
        step_kwargs.append((key, value))
    dispatch, functions = _modes(own_mode)
    return (type(opt), tuple(groups), state, defaults, tuple(step_kwargs), dispatch, functions,
            torch.is_grad_enabled(), _autocast(), torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled(), len(opt.param_groups))
