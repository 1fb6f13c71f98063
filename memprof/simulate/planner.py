"""The batch-size planners: the largest batch that fits a memory budget or a GPU.

:func:`max_batch_size` (a training step) and :func:`max_generation_batch_size` (a generation) build one
:class:`~memprof.simulate.run.RunConfig` from their arguments and search with the plan's own search
(:func:`memprof.simulate.plan_search.largest_batch`, as ``memprof plan`` does for each of its rows), handing the
simulation copies of that configuration at other batch sizes: each phase moment's tensor bytes as a line in the
batch, the device-level peak of a batch not simulated from the replay of its interpolated allocation stream, the
edge below an out-of-memory band where memory is pressed, and the answer always confirmed by simulation (it fits,
the next multiple does not). The search runs over the multiples of ``multiple_of``: 8 for a training step by
default, NVIDIA's tensor-core guidance ("Matrix Multiplication Background User's Guide", Table 1: fp16 dimensions
in multiples of 8).

With a GPU each batch's device-level peak (tensors, the caching allocator's segments, the memory outside torch) is
judged against the limit the allocator model applies: the budget or the GPU's capacity, and under
``per_process_memory_fraction`` what the allocator may reserve plus the memory outside torch; a batch whose replay
predicts an out-of-memory error does not fit. Without one the tensors' peak is judged against the budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from typing_extensions import Unpack

from ..errors import InvalidArgumentError, MemprofError, SimulationError, is_interrupt
from ..record.plans import BatchSizePlan
from ..units import format_bytes, parse_size

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..anatomy.alloc_config import AllocatorConfig
    from ..anatomy.gpus import GpuSpec
    from ..record.device_memory import DeviceMemory
    from .aliases import Option, UserValue
    from .estimate import Estimate
    from .plan_search import Probe
    from .run import EstimateOptions, OptimizerArg, RunConfig, Workload

__all__ = ["BatchSizePlan", "max_batch_size", "max_generation_batch_size", "MAX_BUDGET", "plan_limit"]

#: The largest budget the search takes (1 PiB). Its probes simulate peaks up to a few times the budget (the
#: search doubles its steps where its lines keep missing), and a simulated tensor cannot exceed torch's size limit
#: (2**63 bytes): far above any device's memory, 1 PiB keeps every probe well inside it. Above it torch's own
#: errors ("Storage size calculation overflowed") would end the search.
MAX_BUDGET = 2**50


def max_batch_size(
    model: "nn.Module",
    optimizer: "OptimizerArg",
    make_batch: "Callable[[int], UserValue]",
    budget: "int | str | None" = None,
    *,
    multiple_of: int = 8,
    **options: Unpack[EstimateOptions],
) -> BatchSizePlan:
    """The largest batch size (a multiple of ``multiple_of``) whose simulated peak fits ``budget``.

    ``make_batch(b)`` returns the model's inputs for batch size ``b``, or an ``(inputs, targets)`` pair used with
    ``loss_fn(output, targets)`` (or handed to ``train_step(model, optimizer, inputs, targets)``); only shapes and
    dtypes matter: build them on the meta device (a batch of real tensors takes real memory, and the search may ask
    for large batches). ``budget`` is bytes or a size string
    (``"24 GiB"``), one device's memory: at most :data:`~memprof.simulate.planner.MAX_BUDGET`
    (1 PiB). ``optimizer``, ``precision``,
    ``device``, ``attention``, ``world_size``, ``parallel``, ``gpu``, ``alloc_conf`` and the other keywords
    (``steps``, ``routing``, ``parallelize``, ``mesh``, ``rank``, ``pipeline``, ``extrapolate``, ``step_context``,
    ``train_step``, ``loop``) are :func:`memprof.estimate`'s; with ``world_size`` the batch is one rank's and the
    budget one rank's device.

    Without ``gpu`` the tensors' peak is judged against ``budget`` (``device="cuda"`` sizes blocks as the CUDA
    caching allocator does; its cache and the memory outside torch are not included: leave headroom for them). With
    ``gpu`` each batch's device-level peak (tensors, the allocator's cache, the memory outside torch) is judged
    against the GPU's capacity, or ``budget`` when it is lower, and under ``per_process_memory_fraction`` no more
    than the allocator may reserve plus the memory outside torch; ``budget`` may then be None. The search is the
    plan's (:func:`memprof.simulate.plan_search.largest_batch`): ``memprof plan`` answers the same on the same
    configuration.
    """
    from .run import RunConfig
    from .stages import simulate

    if not callable(make_batch):
        raise InvalidArgumentError(f"make_batch must be a function of the batch size returning the inputs (or "
                                   f"(inputs, targets)), got {type(make_batch).__name__}")
    given = sorted({"inputs", "targets"} & set(options))
    if given:
        raise InvalidArgumentError(f"max_batch_size() makes each batch with make_batch(b); {' and '.join(given)}= "
                                   "cannot be given with it")
    multiple_of = _multiple(multiple_of)
    loss_fn = options.get("loss_fn")
    budget_bytes, limit, spec = plan_limit(budget, options.get("gpu"), options.get("device"),
                                           options.get("alloc_conf"))

    def batch(b: int) -> "tuple[UserValue, UserValue]":
        made = call_make_batch(make_batch, b)
        stepped = options.get("train_step") or options.get("loop") not in (None, "plain")
        if isinstance(made, tuple) and len(made) == 2 and (loss_fn is not None or stepped):
            return made
        return made, None

    inputs, targets = batch(multiple_of)
    config = RunConfig.from_options(model, optimizer, **{**options, "inputs": inputs, "targets": targets})
    first: "dict[int, RunConfig[Workload]]" = {multiple_of: config}

    def at(b: int) -> "Estimate":
        if b in first:
            return simulate(first.pop(b))  # the batch the configuration was built with, made once
        x, y = batch(b)
        return simulate(config.with_workload(inputs=x, targets=y))

    return _plan("max_batch_size", at, budget_bytes, limit, multiple_of, spec is not None)


def max_generation_batch_size(
    model: "nn.Module",
    budget: "int | str | None" = None,
    *,
    prompt_len: int,
    max_new_tokens: int,
    precision: "str | None" = None,
    device: "str | None" = None,
    multiple_of: int = 1,
    attention: str = "auto",
    gpu: "str | GpuSpec | None" = None,
    alloc_conf: "str | AllocatorConfig | None" = None,
    **options: "Option",
) -> BatchSizePlan:
    """The largest number of sequences (a multiple of ``multiple_of``) that generate ``max_new_tokens`` tokens
    after a ``prompt_len``-token prompt within ``budget``, by :func:`memprof.estimate_generation`: the KV cache
    and the decode temporaries grow with the batch, the weights do not. The arguments, and the other keywords
    (``num_beams``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``routing``), are
    :func:`memprof.estimate_generation`'s; the answer is a :class:`BatchSizePlan`, found as :func:`max_batch_size`
    finds its own. With ``gpu`` the device-level peak is judged as there.
    """
    from .generation import simulate_generation
    from .run import RunConfig

    if "batch_size" in options:
        raise InvalidArgumentError("max_generation_batch_size() searches the batch size; batch_size= cannot be "
                                   "given with it")
    multiple_of = _multiple(multiple_of)
    budget_bytes, limit, spec = plan_limit(budget, gpu, device, alloc_conf)
    config = RunConfig.for_generation(model, batch_size=multiple_of, prompt_len=prompt_len,
                                      max_new_tokens=max_new_tokens, precision=precision, device=device,
                                      attention=attention, gpu=gpu, alloc_conf=alloc_conf, **options)

    def at(b: int) -> "Estimate":
        return simulate_generation(config.with_workload(batch_size=b))  # the Generation section at batch b

    return _plan("max_generation_batch_size", at, budget_bytes, limit, multiple_of, spec is not None)


def _multiple(multiple_of: object) -> int:
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise InvalidArgumentError(f"multiple_of must be a positive int, got {multiple_of!r}")
    return multiple_of


def plan_limit(budget: "int | str | None", gpu: "str | GpuSpec | None", device: "str | torch.device | None",
               alloc_conf: "str | AllocatorConfig | None") -> "tuple[int, int, GpuSpec | None]":
    """The budget (given, else the GPU's capacity), the bytes a plan judges each batch against before the
    simulations say more (the budget, no more than the GPU's capacity: a memory fraction's cap lowers it once the
    first simulation tells the memory outside torch, :class:`~memprof.simulate.plan_search.Probe`), and the GPU's
    spec (None without one)."""
    from .device_memory import check_target

    spec, _ = check_target(gpu, device, alloc_conf)
    if budget is None:
        if spec is None:
            raise InvalidArgumentError("give budget= (bytes or '24 GiB') or gpu= (a GPU name such as 'h100-80gb')")
        return spec.allocatable_bytes, spec.allocatable_bytes, spec
    limit = _budget(budget)
    return limit, limit if spec is None else min(limit, spec.allocatable_bytes), spec


def _budget(budget: "int | str") -> int:
    """The budget in bytes, at most :data:`MAX_BUDGET`."""
    limit = parse_size(budget)
    if limit > MAX_BUDGET:
        raise InvalidArgumentError(
            f"budget {budget!r} ({format_bytes(limit)}) is more than the planner can search: it stops at "
            f"{format_bytes(MAX_BUDGET)} per device, where torch's tensor sizes still hold for its probes; give "
            "one device's memory (e.g. '80 GiB')")
    return limit


def call_make_batch(make_batch: "Callable[[int], UserValue]", b: int) -> "UserValue":
    """``make_batch(b)``; where it fails, one error naming it, the batch size and the fix (torch's own, such as
    "can't allocate" for a real batch, is chained as its cause)."""
    try:
        return make_batch(b)
    except MemprofError:
        raise
    except Exception as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        first = (str(failure).strip().splitlines() or [""])[0]
        raise SimulationError(
            f"make_batch({b}) failed: {type(failure).__name__}: {first}. The planner calls make_batch with each "
            "batch size it simulates, and only the batch's shapes and dtypes matter: build it on the meta device "
            f"(torch.empty({b}, ..., device='meta')), where a batch of any size takes no memory") from failure


def _plan(label: str, at: Callable[[int], "Estimate"], budget: int, limit: int, multiple_of: int,
          device_level: bool) -> BatchSizePlan:
    """The plan's search over the multiples of ``multiple_of`` (``at(b)``: the estimate of batch ``b``), with a
    progress bar named ``label``. The search's ceiling is ``limit`` samples: a batch grows the peak by a byte a
    sample at least (its inputs), or the search stops, so no larger batch fits."""
    from .plan_search import Probe, largest_batch
    from .progress import Progress

    tensors: dict[int, int] = {}

    def unit(k: int) -> "Estimate":
        est = at(k * multiple_of)
        tensors[k] = est.peak_bytes
        if len(tensors) == 2:  # the search's first two batches, whichever it took (batch 1 and its guess)
            (k1, t1), (k2, t2) = sorted(tensors.items())
            if t2 <= t1:
                raise InvalidArgumentError(
                    f"peak memory does not grow with the batch size here ({format_bytes(t1)} at "
                    f"{k1 * multiple_of} samples, {format_bytes(t2)} at {k2 * multiple_of}); check make_batch(b)")
        return est

    with Progress(None, label) as bar:
        probe = Probe(unit, limit, max(1, limit // multiple_of), lambda k: bar.step(f"batch size {k * multiple_of}"),
                      device_level=device_level)
        best, verified, _ = largest_batch(probe)
    return _answer(probe, best, verified, multiple_of, budget)


def _answer(probe: "Probe", best: int, verified: bool, m: int, budget: int) -> BatchSizePlan:
    """The plan from the search's probe (its batches counted in multiples of ``m``)."""
    near = sorted(sorted(probe.runs, key=lambda k: (abs(2 * k - 2 * best - 1), k))[:2])
    fixed, per_sample = probe.peaks[near[0]], 0.0
    if len(near) == 2:
        per_sample = (probe.peaks[near[1]] - probe.peaks[near[0]]) / ((near[1] - near[0]) * m)
        fixed = int(round(probe.peaks[near[0]] - per_sample * near[0] * m))
    memory = probe.runs[min(probe.runs)].device_memory if probe.device_level else None
    cap = memory.allocator_limit if memory is not None else None
    plan = BatchSizePlan(
        batch_size=best * m, budget=budget, fixed_bytes=fixed, per_sample_bytes=per_sample,
        peak_bytes=probe.peaks[best] if best else None,
        points=tuple((k * m, probe.peaks[k]) for k in sorted(probe.runs)), verified=verified, multiple_of=m,
        limit=probe.limit, device_level=probe.device_level,
        gpu=memory.gpu.name if memory is not None and memory.gpu is not None else None,
        fraction=_fraction(memory), allocator_limit=cap,
        outside_bytes=memory.outside_bytes if memory is not None else None,
        out_of_memory=tuple(k * m for k in sorted(probe.runs) if probe.oom[k]))
    return _with_notes(plan, probe)


def _fraction(memory: "DeviceMemory | None") -> "float | None":
    from ..record.device_memory import fraction_in

    fraction = fraction_in(memory.alloc_conf) if memory is not None else None
    return fraction if fraction is not None and fraction < 1 else None


def _with_notes(plan: BatchSizePlan, probe: "Probe") -> BatchSizePlan:
    """``plan`` with its notes: what was judged against what, and the memory fraction's part in it."""
    import dataclasses

    limit = plan.limit if plan.limit is not None else plan.budget
    first = probe.runs[min(probe.runs)]
    if plan.device_level:
        said = [f"judged: each batch's device-level peak (the caching allocator's reserved bytes, as the replay of "
                f"its allocation stream gives them, plus the memory outside torch) against {limit} B; a batch whose "
                "replay predicts an out-of-memory error does not fit"]
        memory = first.device_memory  # (not None where a fraction capped the allocator: its replay said so)
        if plan.allocator_limit is not None and memory is not None:
            outside = plan.outside_bytes or 0
            said.append(f"per_process_memory_fraction {plan.fraction}: the allocator may reserve at most "
                        f"{plan.allocator_limit} B, int({plan.fraction} x {memory.capacity} B) of "
                        f"{plan.gpu} (torch's allowed_memory_maximum); the {outside} B outside torch (the CUDA "
                        f"context and libraries) are beyond its reach, so a batch's device peak must stay within "
                        f"{plan.allocator_limit} + {outside} = {plan.allocator_limit + outside} B")
    else:
        said = [f"judged: each batch's simulated tensors' peak against the budget, {limit} B; the caching allocator's "
                "cache and the memory outside torch (the CUDA context, libraries) are not included: give gpu= for "
                "them, or leave headroom"]
        said += [n for n in first.notes if n.startswith("per_process_memory_fraction")]
    said.append("search: the plan's (each phase moment's tensor bytes a line in the batch; with a GPU the device peak "
                "of a batch not simulated from the replay of its interpolated allocation stream); the answer is the "
                "edge below which every batch fits, simulated, and when verified so is the batch above it")
    return dataclasses.replace(plan, notes=tuple(said))
