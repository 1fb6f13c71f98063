"""Hand-built Traces for tests that run no model: renderers, causes, the reconciler, file round trips.

Every figure in a factory-built trace is given by the test, so expected outputs can be written down
exactly. Categories not given are ``None`` (not measured), never 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memprof import Category, Phase
from memprof.record.stats import STAT_KEYS, PhaseStats, Stat
from memprof.record.specs import ModuleCall, OptimizerSpec, ParamSpec, TensorSpec
from memprof.record.trace import (Breakdown, DeviceInfo, ModelFacts, ModuleRecord, OperationRecord, PhaseRecord,
                           Sample, StepRecord, Trace, steps_held)

TENSOR = ("weights", "buffers", "gradients", "optimizer_states", "activations", "inputs", "temporaries")


def bd(total: "int | None | str" = "sum", **bytes_by_category: "int | None") -> Breakdown:
    """A Breakdown from keyword bytes (``weights=4096``); categories not named are not measured.
    ``total`` defaults to the sum of the measured ones; pass None for "total not measured"."""
    for name in bytes_by_category:
        Category(name)  # a typo is an error here, not a silent None
    if total == "sum":
        return Breakdown.from_mapping(bytes_by_category)
    return Breakdown.from_mapping(bytes_by_category, total, compute_total=False)


def cpu(**bytes_by_category: int) -> Breakdown:
    """A CPU exact-mode Breakdown: every tensor category measured (0 unless given), device rows not."""
    values = {name: bytes_by_category.pop(name, 0) for name in TENSOR}
    if bytes_by_category:
        raise TypeError(f"not tensor categories: {sorted(bytes_by_category)}")
    return Breakdown.from_mapping(values)


def phase(step: int, kind: "Phase | str", *, start: Breakdown, peak: Breakdown, end: Breakdown,
          occurrence: int = 0, tags_peak: "dict[str, int] | None" = None,
          tags_end: "dict[str, int] | None" = None, ops: int = 0) -> PhaseRecord:
    return PhaseRecord(step=step, phase=Phase.parse(kind), occurrence=occurrence, start=start, peak=peak,
                       end=end, ops=ops, tags_peak=tuple((tags_peak or {}).items()),
                       tags_end=tuple((tags_end or {}).items()))


def steps(*phases: PhaseRecord) -> tuple[StepRecord, ...]:
    """Group phase records into steps by their step index."""
    by_step: dict[int, list[PhaseRecord]] = {}
    for p in phases:
        by_step.setdefault(p.step, []).append(p)
    return tuple(StepRecord(i, tuple(ps)) for i, ps in sorted(by_step.items()))


def module(path: str, type_: str = "Linear", *, parameters: int = 0, gradients: "int | None" = 0,
           activations: "int | None" = 0, calls: int = 1, own: "int | None | str" = "same",
           **rest: Any) -> ModuleRecord:
    return ModuleRecord(path=path, type=type_, parameters=parameters, gradients=gradients,
                        activations=activations, peak_forward=rest.pop("peak_forward", None),
                        peak_backward=rest.pop("peak_backward", None),
                        temporaries_forward=rest.pop("temporaries_forward", None),
                        temporaries_backward=rest.pop("temporaries_backward", None), calls=calls,
                        own_activations=activations if own == "same" else own, **rest)


def trace(*, phases: tuple[PhaseRecord, ...] = (), peak: "Breakdown | None" = None,
          modules: tuple[ModuleRecord, ...] = (), device: str = "cpu", **fields: Any) -> Trace:
    """A Trace whose start is the first phase's start, end the last phase's end and peak (unless
    given) the highest phase peak; every other field is a keyword of :class:`Trace`."""
    recs = steps(*phases)
    ordered = [p for s in recs for p in s.phases]
    empty = cpu()
    if peak is None and ordered:
        best = max(ordered, key=lambda p: p.peak.total or 0)
        peak = best.peak
        fields.setdefault("peak_step", best.step)
        fields.setdefault("peak_phase", best.phase)
    values: dict[str, Any] = dict(
        mode="exact", device=DeviceInfo(type=device, name=device, rounding=512 if device == "cuda" else 1),
        torch_version="2.13.0", memprof_version="0.0.0",
        start=ordered[0].start if ordered else empty, peak=peak or empty,
        end=ordered[-1].end if ordered else empty, peak_step=None, peak_phase=None, peak_module=None,
        steps=recs, modules=modules,
    )
    values.update(fields)
    if "num_steps" in values:
        return Trace(**values)
    # Not given: as many as the trace holds and names, as the loader counts a file that does not say.
    counted = Trace(**values, num_steps=0)
    return dataclasses.replace(counted, num_steps=steps_held(counted))


def linear_call(path: str, in_features: int, out_features: int, batch: int, *, dtype: str = "float32",
                bias: bool = True) -> ModuleCall:
    """The recorded call of an nn.Linear, as the profiler records it for the per-module formula."""
    params = (("weight", True),) + ((("bias", True),) if bias else ())
    return ModuleCall(path=path, classes=("torch.nn.modules.linear.Linear",),
                      config=(("in_features", in_features), ("out_features", out_features), ("training", True)),
                      params=params, inputs=(TensorSpec((batch, in_features), dtype),),
                      output=TensorSpec((batch, out_features), dtype), grad=True, leaf=True)


def adamw_spec(*shapes: tuple[int, ...], dtype: str = "float32", implementation: str = "for-loop",
               **settings: Any) -> OptimizerSpec:
    """torch's AdamW over parameters of the given shapes, one group, its defaults unless given, as
    the profiler records it (classes from the class up, the implementation torch chose)."""
    group = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False, foreach=None,
                 fused=None, capturable=False, differentiable=False, maximize=False, decoupled_weight_decay=True)
    group.update(settings)
    params = tuple(ParamSpec(tuple(s), dtype, "cpu", True) for s in shapes)
    return OptimizerSpec(("torch.optim.adamw.AdamW", "torch.optim.adam.Adam"),
                         ((tuple(sorted(group.items())), tuple(range(len(params))), implementation),), params)


def facts(**values: Any) -> ModelFacts:
    return ModelFacts(**values)


def full_trace() -> Trace:
    """One of everything a trace can hold, every figure written out."""
    fwd = phase(0, "forward", start=cpu(weights=144), peak=cpu(weights=144, activations=96, temporaries=48),
                end=cpu(weights=144, activations=96), tags_end={"saved_outside_modules": 12}, ops=3)
    bwd = phase(0, "backward", start=cpu(weights=144, activations=96),
                peak=cpu(weights=144, gradients=144, activations=48), end=cpu(weights=144, gradients=144))
    opt = phase(0, "optimizer", start=cpu(weights=144, gradients=144),
                peak=cpu(weights=144, gradients=144, optimizer_states=296, temporaries=144),
                end=cpu(weights=144, gradients=144, optimizer_states=296))
    return trace(
        phases=(fwd, bwd, opt),
        modules=(module("<model>", "Net", parameters=144, gradients=144, activations=96, own=0),
                 module("fc", "Linear", parameters=144, gradients=144, activations=96, input_bytes=96,
                        peak_forward=288, peak_backward=432, temporaries_forward=48, temporaries_backward=0)),
        timeline=(Sample(1, 0, Phase.FORWARD, "fc", cpu(weights=144, activations=96)),),
        notes=("a note with \u00e9 and a newline\nin it",),
        optimizer="torch.optim.adamw.AdamW", optimizer_implementation="for-loop", param_dtypes=("float32",),
        peak_tags=(("saved_outside_modules", 12),),
        facts=facts(num_params=36, num_trainable=36, trainable_tensors=2, weight_bytes=144, trainable_bytes=144,
                    dims=(("fc", "in_features", 8), ("fc", "out_features", 4)), batch_size=3),
        operations=(OperationRecord("forward", "Linear", "aten.addmm", 1, 192, 288, 48),),
        module_calls=(linear_call("fc", 8, 4, 3),),
        optimizers=(adamw_spec((4, 8), (4,)),),
        num_steps=5,  # five steps ran; step 0 is kept in full, the others are in the statistics
        phase_stats=(PhaseStats(Phase.FORWARD, 0, 5, tuple((k, Stat(96, 96, 100) if k == "activations" else None)
                                                          for k in STAT_KEYS),
                                tuple((k, None) for k in STAT_KEYS), median_exact=True),),
    )


def timed_trace() -> Trace:
    """One timed step of a Linear (144 B of weights, a 96-byte batch), with the clock and one module call:
    the shape every time-axis renderer (curve, SVG, Chrome trace, memory_viz) draws.

    forward 0-50 us, its peak at 40 us: 144 + 96 + 48 saved + 32 temporaries = 320 B; ends at 288 B.
    backward 50-100 us, its peak at 70 us (the run's): 144 + 144 gradients + 96 + 48 = 432 B; ends at 384 B.
    ``fc`` runs from 10 to 45 us.
    """
    f = dataclasses.replace(
        phase(0, "forward", start=cpu(weights=144, inputs=96), peak=cpu(weights=144, inputs=96, activations=48,
                                                                        temporaries=32),
              end=cpu(weights=144, inputs=96, activations=48), ops=2), start_us=0.0, peak_us=40.0, end_us=50.0)
    b = dataclasses.replace(
        phase(0, "backward", start=cpu(weights=144, inputs=96, activations=48),
              peak=cpu(weights=144, gradients=144, inputs=96, activations=48),
              end=cpu(weights=144, gradients=144, inputs=96), ops=3), start_us=50.0, peak_us=70.0, end_us=100.0)
    return trace(phases=(f, b), num_steps=1, peak_module="fc",
                 modules=(module("fc", "Linear", parameters=144, gradients=144, activations=48),),
                 timeline=(Sample(0, 0, Phase.FORWARD, "fc", cpu(weights=144, inputs=96), time_us=10.0, event="enter"),
                           Sample(1, 0, Phase.FORWARD, "fc", cpu(weights=144, inputs=96, activations=48), time_us=45.0,
                                  event="exit")))
