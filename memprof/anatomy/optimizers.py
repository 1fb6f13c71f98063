"""Optimizer state and step-temporary formulas for real optimizer objects: the formula record, its
registry, and how torch picks an implementation. The formulas of torch.optim's and bitsandbytes'
classes are :mod:`.optimizer_rules`', registered when :mod:`memprof.anatomy` is imported.

Given a constructed optimizer (``torch.optim`` or a registered third-party
class), predict

* the persistent state bytes after its first step, exactly, as torch 2.13
  creates them (``torch/optim/*.py``; see
  ``docs/anatomy.md#how-torch-optimizers-allocate-state``), and
* the transient bytes that ``optimizer.step()`` allocates on top of that in a
  steady-state step: exact for the foreach implementation, an upper bound for
  the for-loop one, zero for fused kernels.

Assumption: a parameter receives state only if it has a gradient when
``step()`` runs (torch skips ``p.grad is None``). By default every parameter
with ``requires_grad`` is assumed to get one; pass ``params_with_grad`` to say
otherwise. Adagrad is the exception: it creates its ``sum`` and ``step`` for
every parameter in ``__init__``.

0-dim scalars that live for one op (a ``norm().item()``, the ``1.0`` added to
CPU step counters) are ignored unless a formula says otherwise; they are a few
bytes each.

An optimizer with no formula gives ``None`` ("no formula"), never a guess.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from ..errors import InvalidArgumentError, RegistryError

__all__ = [
    "OptimizerFormula",
    "OptimizerLike",
    "ParamGroup",
    "Implementation",
    "register_optimizer_formula",
    "optimizer_formula",
    "optimizer_implementation",
    "param_group_implementations",
    "predict_optimizer_state_bytes",
    "predict_optimizer_step_transient_bytes",
    "step_transient_bytes_by_group",
]

Implementation = Literal["foreach", "for-loop", "fused"]

#: One parameter group, as torch types it (``Optimizer.param_groups: list[dict[str, Any]]``): Any is torch's own
#: type of a group's options (floats, bools, tuples, tensors, the parameter list).
ParamGroup = dict[str, Any]


class OptimizerLike(Protocol):
    """What the formulas read of an optimizer: a ``torch.optim.Optimizer`` (or a third-party one), or a recorded
    one (:class:`memprof.anatomy.predict.OptimizerView`); a formula reads anything else by name (``args``)."""

    @property
    def param_groups(self) -> list[ParamGroup]: ...

# --------------------------------------------------------------------------- implementation choice


def _foreach_devices() -> list[str]:
    # torch/utils/_foreach_utils.py::_get_foreach_kernels_supported_devices (torch 2.13)
    return ["cuda", "xpu", "mtia", torch._C._get_privateuse1_backend_name()]


def _default_foreach(params: Sequence[torch.Tensor], differentiable: bool, device: "str | None" = None) -> bool:
    """torch/optim/optimizer.py ``_default_to_fused_or_foreach(params, differentiable, use_fused=False)``; with
    ``device``, for the parameters held on that device type (a simulation's shape-only twins of them)."""
    if differentiable:
        return False
    devices, types = _foreach_devices(), _foreach_types()
    return all(type(p) in types and (device or p.device.type) in devices for p in params)


def _foreach_types() -> tuple[type, ...]:
    # torch/utils/_foreach_utils.py::_foreach_supported_types, which torch.distributed.tensor extends with DTensor
    # when it is imported (a parameter's type: Parameter passes as Tensor does)
    from torch.utils._foreach_utils import _foreach_supported_types

    return (torch.nn.Parameter, *_foreach_supported_types)


# --------------------------------------------------------------------------- the formula record


@dataclass(frozen=True)
class OptimizerFormula:
    """How to predict one optimizer class's memory.

    ``state_bytes(optimizer, group, params)`` gives the persistent state bytes
    of the parameters ``params`` (those of ``group`` that will have state);
    ``transient_bytes(optimizer, group, params, implementation)`` the step
    temporaries of one parameter group, or ``None`` when unknown.
    ``foreach_none`` says how ``foreach=None`` resolves: ``"default"`` (torch's
    device rule) or ``"loop"``. ``exact_transient`` names the implementations for
    which the transient figure is exact rather than an upper bound.
    """

    name: str
    source: str
    state_bytes: Callable[[OptimizerLike, ParamGroup, Sequence[torch.Tensor]], int]
    transient_bytes: Callable[[OptimizerLike, ParamGroup, Sequence[torch.Tensor], str], int | None] | None = None
    foreach_none: str = "default"
    state_for_all_params: bool = False
    shared_state_bytes: Callable[[OptimizerLike, Sequence[torch.Tensor]], int] | None = None
    exact_transient: tuple[str, ...] = field(default=("foreach", "fused"))


_REGISTRY: dict[type | str, OptimizerFormula] = {}


def _class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_optimizer_formula(cls: type | str, formula: OptimizerFormula) -> None:
    """Register ``formula`` for an optimizer class.

    ``cls`` is a class, or its dotted ``"module.QualName"`` string for a class
    memprof must not import (bitsandbytes). Registering a class twice raises
    :class:`~memprof.errors.RegistryError`.
    """
    if not isinstance(formula, OptimizerFormula):
        raise InvalidArgumentError(f"formula must be an OptimizerFormula, not {type(formula).__name__}")
    key = cls if isinstance(cls, str) else cls
    name_key = cls if isinstance(cls, str) else _class_key(cls)
    if key in _REGISTRY or name_key in _REGISTRY:
        raise RegistryError(
            f"an optimizer formula for {name_key} is already registered; register each class once "
            "(subclasses inherit their base class's formula unless registered themselves)"
        )
    _REGISTRY[key] = formula


def optimizer_formula(optimizer: object) -> OptimizerFormula | None:
    """The formula for ``optimizer``'s class: the exact class first, then its MRO; ``None`` if none.

    A recorded optimizer (:class:`memprof.anatomy.predict.OptimizerView`) is looked up by the
    ``module.QualName`` of its classes.
    """
    names = getattr(optimizer, "class_names", None)
    if names is not None:
        by_name = {(_class_key(k) if isinstance(k, type) else k): f for k, f in _REGISTRY.items()}
        return next((by_name[n] for n in names if n in by_name), None)
    for klass in type(optimizer).__mro__:
        if klass in _REGISTRY:
            return _REGISTRY[klass]
        found = _REGISTRY.get(_class_key(klass))
        if found is not None:
            return found
    return None


# --------------------------------------------------------------------------- helpers on groups


def _group_params(group: ParamGroup, params_with_grad: set[int] | None) -> list[torch.Tensor]:
    out = []
    for p in group["params"]:
        if params_with_grad is None:
            if p.requires_grad:
                out.append(p)
        elif id(p) in params_with_grad:
            out.append(p)
    return out


def _grad_set(params_with_grad: Iterable[torch.Tensor] | None) -> set[int] | None:
    if params_with_grad is None:
        return None
    return {id(p) for p in params_with_grad}


def param_group_implementations(optimizer: OptimizerLike,
                                params_with_grad: Iterable[torch.Tensor] | None = None,
                                device: "str | None" = None) -> list[str]:
    """The implementation (``"foreach"``, ``"for-loop"``, ``"fused"``) each parameter group will use; with
    ``device`` (a device type), where its parameters are on that device whatever theirs is now."""
    formula = optimizer_formula(optimizer)
    none_rule = formula.foreach_none if formula is not None else "default"
    wanted = _grad_set(params_with_grad)
    return [
        _resolve(optimizer, group, none_rule, _group_params(group, wanted), device) for group in optimizer.param_groups
    ]


def _resolve(optimizer: OptimizerLike, group: ParamGroup, none_rule: str, params: Sequence[torch.Tensor],
             device: "str | None" = None) -> str:
    recorded = group.get("memprof_implementation")
    if recorded is not None:
        return str(recorded)  # a recorded group: torch decided when the run happened
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:
        if none_rule == "loop":
            return "for-loop"
        if group.get("fused") is not None:
            # adam.py/sgd.py/adagrad.py apply the default only ``if fused is None and foreach is None``;
            # an explicit fused=False leaves foreach False, i.e. the for-loop.
            return "for-loop"
        foreach = _default_foreach(params, bool(group.get("differentiable", False)), device)
        if foreach and isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable", False):
            foreach = False  # adam.py: no foreach with a Tensor lr unless capturable
    return "foreach" if foreach else "for-loop"


def optimizer_implementation(optimizer: OptimizerLike, params_with_grad: Iterable[torch.Tensor] | None = None) -> str:
    """``"foreach"``, ``"for-loop"`` or ``"fused"``, decided as torch decides it.

    ``foreach=None, fused=None`` (the default) resolves to foreach only when all
    parameters are on a foreach-capable device (CUDA, XPU, MTIA, the
    privateuse1 backend), so CPU training runs the for-loop. Raises
    :class:`~memprof.errors.InvalidArgumentError` if parameter groups differ; use
    :func:`param_group_implementations` then.
    """
    impls = set(param_group_implementations(optimizer, params_with_grad))
    if len(impls) != 1:
        raise InvalidArgumentError(
            f"parameter groups use different implementations {sorted(impls)}; "
            "call param_group_implementations(optimizer) for one per group"
        )
    return impls.pop()


def predict_optimizer_state_bytes(
    optimizer: OptimizerLike, params_with_grad: Iterable[torch.Tensor] | None = None
) -> int | None:
    """Persistent optimizer-state bytes after the first ``step()``; ``None`` if there is no formula.

    ``params_with_grad`` is the set of parameters that will have ``.grad`` at
    the step (default: every parameter with ``requires_grad``).
    """
    formula = optimizer_formula(optimizer)
    if formula is None:
        return None
    wanted = _grad_set(params_with_grad)
    total = 0
    everyone: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        params = list(group["params"]) if formula.state_for_all_params else _group_params(group, wanted)
        everyone.extend(params)
        total += formula.state_bytes(optimizer, group, params)
    if formula.shared_state_bytes is not None:
        total += formula.shared_state_bytes(optimizer, everyone)
    return total


def predict_optimizer_step_transient_bytes(
    optimizer: OptimizerLike, params_with_grad: Iterable[torch.Tensor] | None = None
) -> int | None:
    """Peak bytes ``step()`` allocates above the persistent state, in a steady-state step.

    Parameter groups run one after another, so the result is the maximum over
    groups. Within a group: foreach is exact (the full-size lists of each
    device/dtype group, including the previous group's lists still referenced
    when the next is built); for-loop is an upper bound (a small multiple of the
    largest parameter); fused is 0. ``None`` if there is no formula.
    """
    by_group = step_transient_bytes_by_group(optimizer, params_with_grad)
    return None if by_group is None else max(by_group, default=0)


def step_transient_bytes_by_group(
    optimizer: OptimizerLike, params_with_grad: Iterable[torch.Tensor] | None = None
) -> list[int] | None:
    """What :func:`predict_optimizer_step_transient_bytes` takes the maximum of: each parameter group's bytes
    (0 for a group with no parameter to step), in the optimizer's order; ``None`` if there is no formula. A
    model extended in depth (:mod:`memprof.simulate.depth`) extends each group's in a line, then takes the
    maximum: the largest group at a few blocks need not be the largest at full depth."""
    formula = optimizer_formula(optimizer)
    if formula is None or formula.transient_bytes is None:
        return None
    wanted = _grad_set(params_with_grad)
    out = []
    for group in optimizer.param_groups:
        params = _group_params(group, wanted)
        if not params:
            out.append(0)
            continue
        impl = _resolve(optimizer, group, formula.foreach_none, params)
        value = formula.transient_bytes(optimizer, group, params, impl)
        if value is None:
            return None
        out.append(value)
    return out
