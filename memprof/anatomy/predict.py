"""The formula side of a recorded run: the per-module saved-bytes rules and the optimizer formulas,
applied to what the Trace recorded (never to live objects, never inside the collector).

A trace records each module call of its first grad-enabled forward (classes,
plain configuration, parameters' ``requires_grad``, tensor shapes) and each
optimizer (class, groups, parameter shapes, the implementation torch chose).
The rules and formulas of :mod:`.activations` and :mod:`.optimizers` read
stand-ins built from those records: a module whose attributes are its
recorded configuration, an optimizer whose parameters are meta tensors of the
recorded shapes. Where the trace's facts hold a formula (traces of schema 1
carried the collector's own results; an estimate extended in depth carries its
cuts' formulas extended, its records being the cut model's:
:class:`~memprof.record.parts.ModelFacts`), that is the formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Iterator

from ..errors import is_interrupt
from .activations import TensorMeta, rule_for_classes
from .optimizers import ParamGroup, predict_optimizer_state_bytes, step_transient_bytes_by_group

if TYPE_CHECKING:
    from ..record.specs import ModuleCall, OptimizerSpec, TensorSpec
    from ..record.trace import Trace

__all__ = ["ActivationPrediction", "OptimizerPrediction", "predict_activations", "predict_optimizers",
           "ModuleView", "OptimizerView"]


@dataclass(frozen=True)
class ActivationPrediction:
    """The per-module formula over the first forward: saved bytes, or ``None`` without a recorded forward."""

    saved_bytes: "int | None"
    #: Module types with no saved-bytes rule that saved something (measured, not predicted).
    modules_without_rule: tuple[str, ...] = ()
    #: Rules that raised, as "Type: error" (their modules are left out of the formula).
    failed_rules: tuple[str, ...] = ()
    #: Of ``saved_bytes``, what modules under torch.utils.checkpoint would save (they keep nothing).
    checkpointed_bytes: int = 0


@dataclass(frozen=True)
class OptimizerPrediction:
    """Optimizer state after the first step and the steady step's temporaries (``None``: no formula)."""

    state_bytes: "int | None"
    transient_bytes: "int | None"
    #: Formulas that raised, as "Optimizer: error".
    failed: tuple[str, ...] = ()
    #: Each parameter group's step temporaries, every optimizer's groups in order (``transient_bytes`` is their
    #: maximum); empty where the transients are not known per group (a formula missing, a trace's facts).
    transient_by_group: tuple[int, ...] = ()


def predict_activations(trace: "Trace") -> ActivationPrediction:
    """Sum the saved-bytes rules of the leaf module calls of the trace's first grad-enabled forward; where the
    trace's facts hold the sums (:class:`~memprof.record.parts.ModelFacts`), those, with the calls' rule names."""
    facts = trace.facts
    if not trace.module_calls:
        return ActivationPrediction(facts.activation_formula, facts.modules_without_rule, (),
                                    facts.activation_checkpointed_formula or 0)
    computed = _from_calls(trace)
    if facts.activation_formula is None:
        return computed
    # An estimate extended in depth: its calls are the cut model's, the sums the whole model's.
    return ActivationPrediction(facts.activation_formula, computed.modules_without_rule, computed.failed_rules,
                                facts.activation_checkpointed_formula or 0)


def _from_calls(trace: "Trace") -> ActivationPrediction:
    """The saved-bytes rules of the recorded calls, summed."""
    device = "cuda" if trace.device.type == "cuda" else "cpu"
    own = {m.path: m.own_activations for m in trace.modules}
    total = checkpointed = 0
    without: set[str] = set()
    failed: list[str] = []
    for call in trace.module_calls:
        if not call.grad or not call.leaf:
            continue  # containers: their children carry the rules
        name = call.classes[0].rpartition(".")[2] if call.classes else "?"
        rule = rule_for_classes(call.classes)
        if rule is None:
            if own.get(call.path):  # a module that saved nothing needs no rule (Identity)
                without.add(name)
            continue
        try:
            value = rule(ModuleView(call), [_meta(t) for t in call.inputs],
                         _meta(call.output) if call.output is not None else None, device, call.grad)
        except Exception as exc:  # a user's rule that fails is reported, never guessed around
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            failed.append(f"{name}: {exc!r}")
            continue
        total += value
        if call.checkpointed:
            checkpointed += value
    return ActivationPrediction(total, tuple(sorted(without)), tuple(dict.fromkeys(failed)), checkpointed)


def predict_optimizers(trace: "Trace") -> OptimizerPrediction:
    """The formulas of the optimizers that stepped the model: states summed, transients the largest; where the
    trace's facts hold them (:class:`~memprof.record.parts.ModelFacts`), those."""
    facts = trace.facts
    if not trace.optimizers or facts.optimizer_state_formula is not None \
            or facts.optimizer_transient_formula is not None:
        return OptimizerPrediction(facts.optimizer_state_formula, facts.optimizer_transient_formula)
    states: list["int | None"] = []
    groups: "list[int] | None" = []
    failed = []
    for spec in trace.optimizers:
        view = OptimizerView(spec)
        try:
            states.append(predict_optimizer_state_bytes(view))
            mine = step_transient_bytes_by_group(view)
        except Exception as exc:  # a formula must never break a reconciliation
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            failed.append(f"{spec.classes[0] if spec.classes else '?'}: {exc!r}")
            states.append(None)
            mine = None
        groups = None if groups is None or mine is None else [*groups, *mine]
    known_states = [v for v in states if v is not None]
    state = None if len(known_states) < len(states) else sum(known_states)
    if groups is None:
        return OptimizerPrediction(state, None, tuple(failed))
    return OptimizerPrediction(state, max(groups, default=0), tuple(failed), tuple(groups))


def _meta(spec: "TensorSpec") -> TensorMeta:
    import torch

    return TensorMeta(spec.shape, getattr(torch, spec.dtype))


class _ParamView:
    """A recorded parameter as a rule reads it: whether it needs a gradient."""

    __slots__ = ("requires_grad",)

    def __init__(self, requires_grad: bool) -> None:
        self.requires_grad = requires_grad


class ModuleView(SimpleNamespace):
    """A recorded module call's module, as a saved-bytes rule reads it: its recorded configuration as
    attributes (``training``, ``p``, ``normalized_shape`` ...) and its own parameters (``weight`` ...)
    with ``requires_grad``."""

    def __init__(self, call: "ModuleCall") -> None:
        config = {k: v for k, v in call.config if not k.startswith("tensor:")}
        params = {name: _ParamView(grad) for name, grad in call.params}
        super().__init__(**config, **params)
        self._memprof_params = params

    def parameters(self, recurse: bool = False) -> Iterator[_ParamView]:
        return iter(self._memprof_params.values())

    def named_parameters(self, prefix: str = "", recurse: bool = False) -> Iterator[tuple[str, _ParamView]]:
        return iter(self._memprof_params.items())


class OptimizerView:
    """A recorded optimizer, as the optimizer formulas read it: parameter groups whose parameters are
    meta tensors of the recorded shapes and dtypes (no memory), and the implementation torch chose."""

    def __init__(self, spec: "OptimizerSpec") -> None:
        import torch

        self.class_names = spec.classes
        params = []
        for p in spec.params:
            t = torch.empty(p.shape, dtype=getattr(torch, p.dtype), device="meta")
            params.append(t.requires_grad_(p.requires_grad) if t.is_floating_point() or t.is_complex() else t)
        self.param_groups: list[ParamGroup] = [
            {**dict(config), "params": [params[i] for i in rows], "memprof_implementation": impl}
            for config, rows, impl in spec.groups
        ]
        self.args = SimpleNamespace(**dict(spec.args)) if spec.args else None
        self.state: dict[object, object] = {}  # what a formula may look up on a live optimizer: empty
