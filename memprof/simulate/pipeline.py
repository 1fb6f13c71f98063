"""Pipeline parallelism, simulated one rank at a time: ``estimate(..., pipeline=Pipeline(...))``.

A :class:`Pipeline` says how the model is cut (the user's ``split(model, stage_index, num_stages) -> module``,
torchtitan's way: the stage keeps its layers), which schedule of ``torch.distributed.pipelining`` runs the
stages (GPipe, 1F1B, interleaved 1F1B) and over how many micro-batches. A pipeline rank holds stage ``p`` (its
coordinate along the mesh's ``pp`` dimension) or, interleaved, stages ``p, p + pp, ...``; memprof builds those
stages' modules from the model's twin, runs the user's ``parallelize`` function on them if there is one, and
runs the real schedule on them on torch's fake process group (:mod:`memprof.simulate.parallel`). What a stage
holds then is the schedule's own doing: GPipe keeps every micro-batch's activations until its backward, 1F1B
at most ``pp - p`` on stage ``p`` (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", §2.2), and the P2P receive buffers are the stage's own allocations
(``torch/distributed/pipelining/stage.py``).

Two things a fake process group needs that real peers do not:

- The stages' input and output shapes (``PipelineStage(input_args=, output_args=)``) come from a forward of
  the stages one after another on ``meta`` tensors of one micro-batch, and are marked as needing gradients,
  so that the backward receives and sends exist (``torch/distributed/pipelining/_utils.py``).
- The schedule's warm-up, which asks the previous stage whether its shapes are static, receives nothing from
  a fake peer and would pick dynamic shape inference (which needs real peers): with the shapes given, static
  is right, and is set (``_PipelineSchedule._warmup_p2p`` is replaced for the block and restored after it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from typing import TYPE_CHECKING, Callable, ContextManager, Iterable, Iterator

import torch
from torch import nn

from ..errors import InvalidArgumentError, MemprofError, UnknownNameError, is_interrupt

if TYPE_CHECKING:
    import torch.distributed.pipelining.schedules
    from torch.distributed import ProcessGroup
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.pipelining.stage import PipelineStage

    from ..record.trace import Trace
    from .aliases import UserValue
    from .step import StepParts

__all__ = ["Pipeline", "RankClass", "SCHEDULES", "StageSet", "PipelineStep"]

#: The schedules by name: ``torch.distributed.pipelining``'s classes.
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """How the model is cut into pipeline stages and run.

    ``split(model, stage_index, num_stages)`` returns the stage's module (built from ``model``'s own modules);
    ``schedule`` is ``"gpipe"``, ``"1f1b"`` or ``"interleaved1f1b"`` (or a schedule class of
    ``torch.distributed.pipelining``); ``microbatches`` is the number the rank's batch is split into (along dim
    0); ``stages_per_rank`` is more than 1 for interleaved schedules (rank ``p`` holds stages ``p, p + pp, ...``)."""

    split: Callable[[nn.Module, int, int], nn.Module]
    # Spelled from torch's root, so the API reference files it with torch's names (it is imported for typing only).
    schedule: "str | type[torch.distributed.pipelining.schedules._PipelineSchedule]" = "1f1b"
    microbatches: int = 8
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        if not callable(self.split):
            raise InvalidArgumentError("Pipeline(split=...) must be a function split(model, stage_index, num_stages)")
        if isinstance(self.schedule, str) and self.schedule.replace("_", "").lower() not in SCHEDULES:
            raise UnknownNameError(f"unknown pipeline schedule {self.schedule!r}; use one of {', '.join(SCHEDULES)}")
        for name in ("microbatches", "stages_per_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise InvalidArgumentError(f"Pipeline({name}=...) must be a positive int, got {v!r}")

    def schedule_class(self) -> "type[torch.distributed.pipelining.schedules._PipelineSchedule]":
        if not isinstance(self.schedule, str):
            return self.schedule
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        classes: "dict[str, type[_PipelineSchedule]]" = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                                                         "interleaved1f1b": ScheduleInterleaved1F1B}
        return classes[self.schedule.replace("_", "").lower()]

    def multi(self) -> bool:
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti

        return issubclass(self.schedule_class(), PipelineScheduleMulti)


@dataclasses.dataclass(frozen=True)
class RankClass:
    """Ranks that hold the same memory: their pipeline stages, the representative simulated, and its peak."""

    ranks: tuple[int, ...]
    representative: int
    stages: tuple[int, ...]
    peak_bytes: int
    peak_step: "int | None"
    peak_phase: str
    #: The representative's simulated Trace (what ``memprof.merge(estimate)`` lays side by side).
    trace: "Trace | None" = dataclasses.field(default=None, compare=False, repr=False)


class StageSet:
    """One pipeline rank's stages, built from the model's meta twin: shapes, modules, then (in the fake mode) the
    ``PipelineStage`` objects and the schedule."""

    def __init__(self, pipeline: Pipeline, pp: int, index: int) -> None:
        self.pipeline, self.pp, self.index = pipeline, pp, index
        self.num_stages = pp * pipeline.stages_per_rank
        self.stage_ids = tuple(index + i * pp for i in range(pipeline.stages_per_rank))
        self.shapes: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        self.modules: list[nn.Module] = []

    def cut(self, twin: nn.Module, inputs: "UserValue",
            prepared: "Callable[[int], tuple[nn.Module, ContextManager[object]]] | None" = None) -> nn.Module:
        """The rank's stage modules (one module, or a ModuleList of them), after working out every stage's input
        and output on one micro-batch: on meta, or, when the user's parallelize function changes what a stage
        hands on (sequence parallelism: a local shard of the sequence), through ``prepared(k)``, which gives stage
        ``k`` parallelised and materialised on its own copy, and the context to run it in."""
        from .kernels import ValueDependentCode

        mods = [self._split(twin, k) for k in range(self.num_stages)]
        x = _microbatch(inputs, self.pipeline.microbatches)
        last = max(self.stage_ids)
        # The value checks of transformers' mask helpers (are these sequences packed?) answered as the simulation
        # answers them (memprof.simulate.kernels.ValueDependentCode): shape-only tensors have no values to read.
        with torch.no_grad(), ValueDependentCode():
            for k in range(last + 1):
                try:
                    if prepared is None:
                        out = mods[k](*x)
                    else:
                        mod, ctx = prepared(k)
                        with ctx:
                            out = mod(*(_example(t, grad=False) for t in x))
                        del mod
                except MemprofError:
                    raise
                except Exception as exc:
                    if is_interrupt(exc):
                        raise  # a signal handler's exception (errors.is_interrupt) is the user's
                    # A stage that cannot run on what the previous one hands it: a layer that needs more than
                    # the hidden states (per-layer embeddings sized for the whole model, the token ids).
                    handed = "the inputs" if k == 0 else f"what stage {k - 1} hands it"
                    raise InvalidArgumentError(
                        f"pipeline stage {k} of {self.num_stages} could not run on {handed} ({type(exc).__name__}: "
                        f"{exc}); if the model's layers need more than the hidden states between stages, it cannot "
                        "be cut this way: plan it without pipeline layouts, or give a split whose stages take and "
                        "return everything the next one needs") from exc
                out = tuple(_local(t) for t in (out if isinstance(out, tuple) else (out,)))
                if k in self.stage_ids:
                    self.shapes[k] = (x, out)
                x = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in out)
        self.modules = [mods[k] for k in self.stage_ids]
        return self.modules[0] if len(self.modules) == 1 else nn.ModuleList(self.modules)

    def _split(self, twin: nn.Module, k: int) -> nn.Module:
        m = self.pipeline.split(twin, k, self.num_stages)
        if not isinstance(m, nn.Module):
            raise InvalidArgumentError(f"Pipeline.split returned {type(m).__name__} for stage {k}, not a module")
        return m

    def step(self, loss_fn: "Callable[..., torch.Tensor] | None", optimizer: "torch.optim.Optimizer | None",
             inputs: "UserValue", targets: "UserValue", group: "ProcessGroup | None" = None) -> "PipelineStep":
        """Built inside the fake mode: the stages (with fake CPU examples of their inputs and outputs) and the
        schedule."""
        from torch.distributed.pipelining import PipelineStage

        stages = []
        for k, mod in zip(self.stage_ids, self.modules):
            ins, outs = self.shapes[k]
            stages.append(PipelineStage(mod, k, self.num_stages, torch.device("cpu"),
                                        input_args=tuple(_example(t, grad=k > 0) for t in ins),
                                        output_args=tuple(_example(t, grad=True) for t in outs), group=group))
        cls: "Callable[..., _PipelineSchedule]" = self.pipeline.schedule_class()
        if loss_fn is None:
            loss = lambda out, _t: out.sum()  # noqa: E731 - as estimate() without loss_fn
        elif targets is None:
            loss = lambda out, _t: loss_fn(out)  # noqa: E731
        else:
            loss = loss_fn
        try:
            sched = cls(stages if self.pipeline.multi() else stages[0], n_microbatches=self.pipeline.microbatches,
                        loss_fn=loss)
        except ValueError as exc:  # the schedule checks its arguments as it is built (1F1B: micro-batches >= stages)
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            raise InvalidArgumentError(
                f"torch's {cls.__name__} refuses Pipeline(microbatches={self.pipeline.microbatches}) over "
                f"{self.num_stages} pipeline stages: {exc} Give a number of micro-batches it accepts (the batch's "
                "first dimension must divide into it), or another schedule") from None
        return PipelineStep(sched, optimizer, inputs if 0 in self.stage_ids else None,
                            (targets if targets is not None else inputs) if self.num_stages - 1 in self.stage_ids
                            else None)


class PipelineStep:
    """One training step of a pipeline rank: the schedule's step (forwards, losses and backwards of every
    micro-batch), inside the step's context when there is one (:meth:`enter_each_step`), then the optimizer's
    step and zero_grad."""

    def __init__(self, schedule: "_PipelineSchedule", optimizer: "torch.optim.Optimizer | None", inputs: "UserValue",
                 targets: "UserValue") -> None:
        self.schedule, self.optimizer, self.inputs, self.targets = schedule, optimizer, inputs, targets
        self.context: "Callable[..., ContextManager[object]] | None" = None
        self.parts: "StepParts | None" = None

    def enter_each_step(self, context: "Callable[..., ContextManager[object]]", parts: "StepParts") -> None:
        """Enter ``context(parts)`` (a checked ``step_context``, :func:`memprof.simulate.step.check_step_context`)
        afresh around each schedule step, as torchtitan's pipeline step enters its train context
        (``loss_parallel()``, ``context_parallel(...)``) around ``pp_schedule.step``; the optimizer step is
        outside it."""
        self.context, self.parts = context, parts

    def run(self) -> None:
        args = () if self.inputs is None else self.inputs if isinstance(self.inputs, tuple) else (self.inputs,)
        kwargs = {} if self.targets is None else {"target": self.targets, "losses": []}
        if self.context is None:
            self.schedule.step(*args, **kwargs)
        else:
            with self.context(self.parts):
                self.schedule.step(*args, **kwargs)
        del kwargs  # the losses the schedule returned: a training loop lets them go before the optimizer step
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad()


@contextlib.contextmanager
def static_shapes() -> Iterator[None]:
    """The schedule's warm-up vote, answered: static shapes (every stage's were given)."""
    try:
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining.stage import InferenceMode
    except ImportError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        yield
        return
    cls = schedules._PipelineSchedule
    original = cls.__dict__.get("_warmup_p2p")
    if original is None:
        yield
        return

    def _warmup_p2p(self: "_PipelineSchedule", stages: "Iterable[PipelineStage]", *args: object,
                    **kwargs: object) -> None:
        for st in stages:
            st._inference_mode = InferenceMode.STATIC

    # Swapped on the class for the block and put back (the method's type is torch's; mypy refuses the assignment,
    # and a replacement that takes the stages the schedule has, PipelineStage, where torch's takes their base class).
    cls._warmup_p2p = _warmup_p2p  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        cls._warmup_p2p = original  # type: ignore[method-assign]


def _microbatch(inputs: "UserValue", n: int) -> tuple[torch.Tensor, ...]:
    """One micro-batch of ``inputs`` on meta: dim 0 divided by ``n`` (as the schedule splits it)."""
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    out = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            raise InvalidArgumentError("a pipeline's inputs must be a tensor or a tuple of tensors")
        if a.dim() == 0 or a.shape[0] % n:
            raise InvalidArgumentError(f"the batch's first dimension ({a.shape[0] if a.dim() else 'none'}) must "
                                       f"divide into Pipeline(microbatches={n})")
        out.append(torch.empty((a.shape[0] // n, *a.shape[1:]), dtype=a.dtype, device="meta"))
    return tuple(out)


def _local(t: torch.Tensor) -> torch.Tensor:
    """What a stage hands on, as the next stage receives it: a DTensor's local shard."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _example(t: torch.Tensor, grad: bool) -> torch.Tensor:
    ex = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return ex.requires_grad_(True) if grad and ex.is_floating_point() else ex
