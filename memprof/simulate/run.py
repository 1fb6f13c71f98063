"""One description of a simulated run: a frozen, keyword-only configuration made of sections.

Every entry point that simulates (``memprof.estimate``, ``estimate_generation``, ``max_batch_size``, ``plan``,
``what_if``, the command line) builds one :class:`RunConfig` and hands it on; the simulation's stages
(:mod:`memprof.simulate.stages`) read it, never a dictionary of options. The sections, as torchtitan builds its
job configuration:

- :class:`Workload`: what is trained and how (the model, its optimizer, the step's inputs, targets and loss, the
  steps, the context the loop enters around them, what MoE routers choose);
- ``precision``: the parameters' dtype or the autocast regime;
- :class:`Target`: the device the figures are for (a GPU, its allocator's configuration, the attention kernel);
- :class:`Parallelism`: the world size, the layout or the user's own ``parallelize`` function, the mesh, a
  pipeline, the rank;
- :class:`Depth`: simulate a deep model cut short and extend the figures.

A generation (``estimate_generation``) has a :class:`Generation` section in the workload's place: the model, the
batch, the prompt and the tokens to generate, and how ``generate()`` chooses them.

The keyword arguments users write (``estimate(model, opt, inputs=x, gpu="h100", world_size=8, ...)``) are mapped
to the sections once, by :meth:`RunConfig.from_options`; each section checks its own values as it is made, so a
bad value is refused before anything is simulated.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ContextManager, Generic, Mapping, TypedDict, TypeVar, Union

from ..errors import InvalidArgumentError, UnknownNameError
# At run time too: typing.get_type_hints resolves the keyword TypedDicts below in this module (without torch).
from .aliases import Option, UserValue
from .forked import processes_for

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..anatomy.alloc_config import AllocatorConfig
    from ..anatomy.gpus import GpuSpec
    from .pipeline import Pipeline

__all__ = ["RunConfig", "Workload", "Generation", "Target", "Parallelism", "Depth", "EstimateOptions",
           "EstimateSettings", "GenerationOptions", "PRECISIONS", "OPTIONS", "GENERATION_OPTIONS"]

#: The precisions a simulation takes: the parameters' dtype (bf16, fp16, fp32), or fp32 parameters with the
#: forward under autocast (mixed = amp: bf16; mixed-fp16: fp16, with a GradScaler); None keeps the model's dtypes.
PRECISIONS = ("fp32", "bf16", "fp16", "mixed", "amp", "mixed-fp16")

#: What ``estimate()``'s optimizer is: an optimizer built on the model (rebuilt on its twin), a factory called with
#: the twin's parameters (what it returns is checked to be an optimizer), or None.
OptimizerArg = Union["torch.optim.Optimizer", Callable[..., object], None]
#: A ``step_context``: a function returning the context manager the loop enters (called with the step's
#: :class:`~memprof.simulate.step.StepParts`, or with nothing where it takes no argument).
StepContext = Callable[..., ContextManager[object]]
#: A mesh as ``estimate(mesh=)`` takes it: its sizes in order, or ``{name: size}`` in mesh order.
MeshSizes = tuple[int, ...] | list[int] | dict[str, int]


@dataclass(frozen=True, kw_only=True, eq=False)
class Workload:
    """What is trained and how. ``optimizer``: an optimizer built on ``model`` (rebuilt on its twin), a factory
    called with the twin's parameters, or None. ``inputs``: what the model is called with (a tensor, a tuple of
    positional arguments, a dict of keyword arguments); only shapes and dtypes matter. The loss is
    ``loss_fn(output, targets)`` (``loss_fn(output)`` without targets; the first output's sum without ``loss_fn``).
    ``step_context``: a function returning the context manager the loop enters around forward, loss and backward.
    ``routing``: what a mixture-of-experts model's routers choose (:mod:`memprof.simulate.routing`).
    ``train_step``: the user's own step, ``train_step(model, optimizer, inputs[, targets])``, run in place of the
    loop above (:mod:`memprof.simulate.user_step`); it builds its own loss, so ``loss_fn`` and ``step_context`` are
    not taken with it. ``loop``: the name of the loop whose step this is (:mod:`memprof.simulate.loops`;
    :meth:`RunConfig.from_options` builds its ``train_step``), None or ``"plain"`` for memprof's own."""

    model: "nn.Module"
    optimizer: OptimizerArg = None
    inputs: "UserValue"
    targets: "UserValue" = None
    loss_fn: "Callable[..., torch.Tensor] | None" = None
    steps: int = 2
    step_context: "StepContext | None" = None
    routing: object = None
    train_step: "Callable[..., object] | None" = None
    loop: "str | None" = None

    def __post_init__(self) -> None:
        import torch
        from torch import nn

        from .loops import check_loop
        from .user_step import check_arity, check_train_step

        check_loop(self.loop)

        step = check_train_step(self.train_step)
        if step is not None and self.loop in (None, "plain"):  # a named loop's step is memprof's own
            check_arity(step, self.targets is not None)
        if step is not None:
            given = [name for name in ("loss_fn", "step_context") if getattr(self, name) is not None]
            if given:
                raise InvalidArgumentError(
                    f"train_step= runs your own step, which computes its loss and enters its own contexts; "
                    f"{' and '.join(n + '=' for n in given)} belong to memprof's loop: leave them out")
        if not isinstance(self.model, nn.Module):
            raise InvalidArgumentError(f"estimate() needs a torch.nn.Module, got {type(self.model).__name__}")
        from torch.nn.parameter import UninitializedParameter

        lazy = next((n for n, p in self.model.named_parameters() if isinstance(p, UninitializedParameter)), None)
        if lazy is not None:  # a lazy module's parameters have no shape until a forward makes them
            raise InvalidArgumentError(f"the model's parameter {lazy} is not initialised yet (a lazy module, such as "
                                       "nn.LazyLinear): run one forward on a batch first, so that its shapes are "
                                       "known, then estimate")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise InvalidArgumentError(f"steps must be a positive int, got {self.steps!r}")
        if isinstance(self.optimizer, torch.optim.Optimizer):
            from ..collect.arguments import refuse_foreign_parameters

            # The twin's optimizer is rebuilt on the model's parameters only: another model's would be dropped,
            # and their state and step with them (the estimate was under by them, where profile() refused).
            refuse_foreign_parameters([self.optimizer], self.model, "estimate")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise InvalidArgumentError(f"loss_fn must be a function of the model's output (and targets), got "
                                       f"{type(self.loss_fn).__name__}")
        from ..collect.module_table import tensors_in_args

        if not tensors_in_args(self.inputs, None):
            raise InvalidArgumentError(
                f"inputs must hold the model's input tensors (a tensor, a tuple of arguments or a dict of keyword "
                f"arguments), got {type(self.inputs).__name__} without a tensor")


@dataclass(frozen=True, kw_only=True, eq=False)
class Generation:
    """What is generated: ``max_new_tokens`` tokens after a ``prompt_len``-token prompt for ``batch_size``
    sequences of ``model`` (a model with ``generate()``), chosen as ``generate()`` would with ``num_beams``,
    ``do_sample``, ``temperature``, ``top_k`` and ``top_p``; ``routing`` as :class:`Workload`'s."""

    model: "nn.Module"
    batch_size: int
    prompt_len: int
    max_new_tokens: int
    num_beams: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_k: "int | None" = 50
    top_p: float = 1.0
    routing: object = None

    def __post_init__(self) -> None:
        from torch import nn

        from ..units import as_count

        if not isinstance(self.model, nn.Module):
            raise InvalidArgumentError(
                f"estimate_generation() needs a torch.nn.Module, got {type(self.model).__name__}")
        for name in ("batch_size", "prompt_len", "max_new_tokens", "num_beams"):
            object.__setattr__(self, name, as_count(name, getattr(self, name), minimum=1))
        if not isinstance(self.do_sample, bool):
            raise InvalidArgumentError(f"do_sample must be True or False, got {self.do_sample!r}")
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise InvalidArgumentError(f"temperature must be a positive number, got {t!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise InvalidArgumentError(f"top_k must be a whole number >= 0 or None, got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise InvalidArgumentError(f"top_p must be a number in (0, 1], got {p!r}")


@dataclass(frozen=True, kw_only=True, eq=False)
class Target:
    """The device the figures are for: ``device`` (``"cuda"`` rounds every block as the caching allocator does
    and runs CUDA's kernel choices; default: the model's), ``gpu`` (a name or a GpuSpec: the device-level replay
    and the fit verdict), ``alloc_conf`` (``PYTORCH_CUDA_ALLOC_CONF``'s text or an AllocatorConfig) and
    ``attention`` (a CUDA target's attention kernel: ``"auto"`` is the one torch would pick)."""

    device: "str | torch.device | None" = None
    gpu: "str | GpuSpec | None" = None
    alloc_conf: "str | AllocatorConfig | None" = None
    attention: str = "auto"


@dataclass(frozen=True, kw_only=True, eq=False)
class Parallelism:
    """Which rank of which job the figures are for: ``world_size`` ranks laid out by ``parallel`` (``"ddp"``,
    ``"fsdp"``, ``"zero1"`` ... ``"zero3"``; ``"fsdp1"`` becomes ``parallelize``, FSDP1's own code, by
    :func:`memprof.simulate.fsdp1.fsdp1_parallelize`) or by the user's own ``parallelize(model, mesh)`` on a ``mesh``
    (sizes, or ``{name: size}``), cut into a ``pipeline``'s stages; ``rank`` picks one (the worst pipeline rank
    without it)."""

    world_size: int = 1
    parallel: "str | None" = None
    parallelize: "Callable[..., object] | None" = None
    mesh: "MeshSizes | None" = None
    pipeline: "Pipeline | None" = None
    rank: "int | None" = None

    def __post_init__(self) -> None:
        from .ranks import check_parallel

        world_size, parallel = check_parallel(self.world_size, self.parallel,
                                              self.parallelize is not None or self.pipeline is not None)
        if parallel == "fsdp1":  # FSDP1's own code on the fake process group, as a parallelize function of memprof's
            from .fsdp1 import fsdp1_parallelize

            object.__setattr__(self, "parallelize", fsdp1_parallelize())
            parallel = None
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "parallel", parallel)
        if self.rank not in (None, 0) and self.parallelize is None and self.pipeline is None:
            raise InvalidArgumentError(f"rank={self.rank!r} picks a rank of your parallelize function (or pipeline); "
                                       "the parallel= layouts are simulated for rank 0, the one holding the most rows")

    @property
    def on_fake_ranks(self) -> bool:
        """The ranks run on torch's fake process group (the user's parallelize function, or a pipeline)."""
        return self.parallelize is not None or self.pipeline is not None


@dataclass(frozen=True, kw_only=True, eq=False)
class Depth:
    """``extrapolate=k``: simulate the repeated stack of blocks cut to ``k``, ``k + 1`` and ``k + 2`` blocks (per
    pipeline stage) and extend the figures to the model's depth (:mod:`memprof.simulate.depth`). None (the
    default): the same with ``k`` 2 where the stack is deep enough to gain by it, checked, else the whole model;
    False: the whole model."""

    extrapolate: "int | bool | None" = None

    def __post_init__(self) -> None:
        k = self.extrapolate
        if k is not None and k is not False and (isinstance(k, bool) or not isinstance(k, numbers.Integral)
                                                 or k < 1):
            raise InvalidArgumentError(f"extrapolate must be a positive int (blocks per stage to simulate), False (the "
                                       f"whole model) or None (memprof chooses), got {k!r}")


#: A run's workload section: a training step's (:class:`Workload`) or a generation's (:class:`Generation`).
W = TypeVar("W", bound=Workload | Generation)


@dataclass(frozen=True, kw_only=True, eq=False)
class RunConfig(Generic[W]):
    """A simulated run, whole: its sections (this module's docstring). Frozen; :meth:`replace` gives a changed
    copy (another batch, another model cut to a depth). ``RunConfig[Workload]`` is a training step's (what the
    stages of :mod:`memprof.simulate.stages` run), ``RunConfig[Generation]`` a generation's."""

    workload: W
    precision: "str | None" = None
    target: Target = field(default_factory=Target)
    parallelism: Parallelism = field(default_factory=Parallelism)
    depth: Depth = field(default_factory=Depth)
    #: How many processes a pipeline's rank classes are simulated in (:mod:`memprof.simulate.forked`): None, one per
    #: class, at most twice the cores; 1, all in this one. It says how memprof works, not what runs: the figures
    #: are the same.
    processes: "int | None" = None

    def __post_init__(self) -> None:
        processes_for(self.processes, 1)  # a bad count is refused here, before anything runs
        if self.precision is not None and self.precision not in PRECISIONS:
            raise UnknownNameError(f"unknown precision {self.precision!r}; use one of: fp32, bf16, fp16, mixed, "
                                   "mixed-fp16 (amp is mixed)")
        from .step import check_step_context

        if isinstance(self.workload, Workload):
            check_step_context(self.workload.step_context)  # refused here, before anything runs
        if isinstance(self.workload, Workload) and self.workload.train_step is not None \
                and self.parallelism.pipeline is not None:
            raise InvalidArgumentError("train_step= runs your step, but under pipeline= torch's schedule runs the "
                                       "step (its forward, loss and backward per microbatch); leave one of them out")

    @classmethod
    def from_options(cls, model: "nn.Module", optimizer: OptimizerArg = None, **options: "Option"
                     ) -> "RunConfig[Workload]":
        """The configuration ``estimate(model, optimizer, **options)`` describes: each keyword to its section."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise InvalidArgumentError(f"unknown option(s) {', '.join(unknown)}; estimate() takes: "
                                       f"{', '.join(OPTIONS)}")
        if "inputs" not in options:
            raise InvalidArgumentError("estimate() needs inputs=: what the model is called with (a tensor, a tuple of "
                                       "arguments or a dict of keyword arguments)")
        given = {section: {name: options[name] for name in names if name in options}
                 for section, names in _SECTIONS.items()}
        _named_loop(given["workload"], options.get("precision"))
        return RunConfig(workload=Workload(model=model, optimizer=optimizer, **given["workload"]),
                   precision=options.get("precision"), target=Target(**given["target"]),
                   parallelism=Parallelism(**given["parallelism"]), depth=Depth(**given["depth"]),
                   processes=options.get("processes"))

    @classmethod
    def for_generation(cls, model: "nn.Module", **options: "Option") -> "RunConfig[Generation]":
        """The configuration ``estimate_generation(model, **options)`` describes."""
        unknown = sorted(set(options) - set(GENERATION_OPTIONS))
        if unknown:
            raise InvalidArgumentError(f"unknown option(s) {', '.join(unknown)}; estimate_generation() takes: "
                                       f"{', '.join(GENERATION_OPTIONS)}")
        missing = [name for name in ("batch_size", "prompt_len", "max_new_tokens") if name not in options]
        if missing:
            raise InvalidArgumentError(f"estimate_generation() needs {', '.join(missing)}=")
        target = {name: options[name] for name in _SECTIONS["target"] if name in options}
        generation = {name: options[name] for name in GENERATION_OPTIONS
                      if name in options and name not in target and name != "precision"}
        return RunConfig(workload=Generation(model=model, **generation), precision=options.get("precision"),
                   target=Target(**target))

    def replace(self, **sections: "Option") -> "RunConfig[W]":
        """A copy with whole sections replaced (``config.replace(workload=...)``)."""
        return dataclasses.replace(self, **sections)

    def with_workload(self, **changes: "Option") -> "RunConfig[W]":
        """A copy whose workload has ``changes`` (another model and optimizer, another batch)."""
        return dataclasses.replace(self, workload=dataclasses.replace(self.workload, **changes))

    def with_parallelism(self, **changes: "Option") -> "RunConfig[W]":
        """A copy whose parallelism has ``changes`` (one rank of a pipeline)."""
        return dataclasses.replace(self, parallelism=dataclasses.replace(self.parallelism, **changes))


def _named_loop(workload: "dict[str, Option]", precision: "str | None") -> None:
    """A named ``loop`` becomes the ``train_step`` it is (:func:`memprof.simulate.loops.loop_step`), taking the
    ``loss_fn`` given with it; refused beside a ``train_step`` of the user's."""
    from .loops import check_loop, loop_step

    loop = check_loop(workload.get("loop"))
    if loop in (None, "plain"):
        return
    if workload.get("train_step") is not None:
        raise InvalidArgumentError(f"loop={loop!r} and train_step= each name the step to simulate; give one of them")
    if workload.get("step_context") is not None:
        raise InvalidArgumentError(f"step_context= belongs to memprof's own loop; loop={loop!r} enters the "
                                   "contexts its framework enters: leave it out, or give loop='plain' (--loop plain)")
    workload["train_step"] = loop_step(loop, precision=precision, loss_fn=workload.pop("loss_fn", None))


# Each keyword of estimate() and its section (precision stands alone).
_SECTIONS: "Mapping[str, tuple[str, ...]]" = {
    "workload": ("inputs", "targets", "loss_fn", "steps", "step_context", "routing", "train_step", "loop"),
    "target": ("device", "gpu", "alloc_conf", "attention"),
    "parallelism": ("world_size", "parallel", "parallelize", "mesh", "pipeline", "rank"),
    "depth": ("extrapolate",),
}

#: Every keyword ``estimate_generation(model, **options)`` takes.
GENERATION_OPTIONS: tuple[str, ...] = ("batch_size", "prompt_len", "max_new_tokens", "precision", "device", "attention",
                                       "routing", "num_beams", "do_sample", "temperature", "top_k", "top_p", "gpu",
                                       "alloc_conf")

#: Every keyword ``estimate(model, optimizer, **options)`` takes, in the order its docstring gives them.
OPTIONS: tuple[str, ...] = ("inputs", "targets", "loss_fn", "precision", "device", "steps", "attention", "world_size",
                            "parallel", "routing", "gpu", "alloc_conf", "parallelize", "rank", "mesh", "pipeline",
                            "extrapolate", "processes", "step_context", "train_step", "loop")


class EstimateSettings(TypedDict, total=False):
    """The keyword arguments of :func:`memprof.estimate` beside what the step runs on (inputs, targets and
    ``loss_fn``, :class:`EstimateOptions`): what :func:`memprof.simulate.whatif.what_if`, which takes those as the
    profiled run's, passes on.

    A field whose type is a class of torch's or of :mod:`memprof.anatomy` (``device``, ``gpu``, ``alloc_conf``,
    ``pipeline``, ``loss_fn``) is an ``Option``, typed by the section that takes it (:class:`Target`,
    :class:`Parallelism`, :class:`Workload`): ``typing.get_type_hints`` resolves these TypedDicts in this module,
    which imports no torch (the command line reads it)."""

    precision: "str | None"
    device: "Option"
    steps: int
    attention: str
    world_size: int
    parallel: "str | None"
    routing: object
    gpu: "Option"
    alloc_conf: "Option"
    parallelize: "Callable[..., object] | None"
    rank: "int | None"
    mesh: "MeshSizes | None"
    pipeline: "Option"
    extrapolate: "int | bool | None"
    processes: "int | None"
    step_context: "StepContext | None"
    train_step: "Callable[..., object] | None"
    loop: "str | None"


class EstimateOptions(EstimateSettings, total=False):
    """The keyword arguments of :func:`memprof.estimate` (each described there), typed: what
    :meth:`RunConfig.from_options` maps to the sections."""

    inputs: "UserValue"
    targets: "UserValue"
    loss_fn: "Option"


class GenerationOptions(TypedDict, total=False):
    """The keyword arguments of :func:`memprof.estimate_generation` (each described there), typed."""

    batch_size: int
    prompt_len: int
    max_new_tokens: int
    precision: "str | None"
    device: "Option"
    attention: str
    routing: object
    num_beams: int
    do_sample: bool
    temperature: float
    top_k: "int | None"
    top_p: float
    gpu: "Option"
    alloc_conf: "Option"
