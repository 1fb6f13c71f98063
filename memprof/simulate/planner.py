"""The batch-size planner: the largest batch that fits a memory budget.

Peak memory of a training step is, to a very good approximation, an affine
function of the batch size: model states do not depend on it, activations,
inputs and most temporaries grow with it. :func:`max_batch_size` simulates
the step (meta tensors, no real memory) at a few batch sizes, fits
``peak(b) = fixed + per_sample * b``, solves for the budget, rounds down to a
multiple of 8 (NVIDIA's tensor-core guidance, "Matrix Multiplication Background
User's Guide", Table 1: fp16 dimensions in multiples of 8), and simulates
the answer and the next multiple to confirm it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import InvalidArgumentError
from ..units import format_bytes, parse_size

__all__ = ["BatchSizePlan", "max_batch_size", "max_generation_batch_size", "MAX_BUDGET"]

#: The largest budget the search takes (1 PiB). Its probes simulate peaks up to a few times the
#: budget (the search doubles its steps, and its first guess is a straight line that may be low), and a
#: simulated tensor cannot exceed torch's size limit (2**63 bytes): far above any device's memory,
#: 1 PiB keeps every probe well inside it. Above it torch's own errors ("Storage size calculation
#: overflowed") would end the search.
MAX_BUDGET = 2**50


@dataclass(frozen=True)
class BatchSizePlan:
    """The answer of :func:`max_batch_size` and how it was found.

    ``batch_size`` is 0 when not even ``multiple_of`` samples fit; ``peak_bytes`` is the estimated peak
    there (as an Estimate's; None for 0). ``points`` are the simulated (batch size, peak bytes) pairs;
    ``verified`` says the simulated peak at ``batch_size`` is within the budget and the next multiple's
    is not. Plain data: :class:`memprof.BatchSizePlan` adds its text.
    """

    batch_size: int
    budget: int
    fixed_bytes: int
    per_sample_bytes: float
    peak_bytes: "int | None"
    points: tuple[tuple[int, int], ...]
    verified: bool
    multiple_of: int


def max_batch_size(
    model: Any,
    optimizer: Any,
    make_batch: Callable[[int], Any],
    budget: "int | str | None" = None,
    *,
    loss_fn: "Callable[..., Any] | None" = None,
    multiple_of: int = 8,
    device: "str | None" = None,
    attention: str = "auto",
    world_size: int = 1,
    parallel: "str | None" = None,
    gpu: Any = None,
    alloc_conf: Any = None,
) -> BatchSizePlan:
    """The largest batch size (a multiple of ``multiple_of``) whose simulated peak fits ``budget``.

    ``make_batch(b)`` returns the model's inputs for batch size ``b``, or an
    ``(inputs, targets)`` pair used with ``loss_fn(output, targets)``; only
    shapes and dtypes matter (build them on the meta device to stay cheap).
    ``budget`` is bytes or a size string (``"24 GiB"``), one device's memory: at most
    :data:`MAX_BUDGET` (1 PiB). ``optimizer`` is as
    in :func:`memprof.estimate`. ``device="cuda"`` sizes blocks as the CUDA
    caching allocator does; allocator caching, fragmentation and the CUDA
    context are not included: leave headroom for them. ``attention`` is
    :func:`memprof.estimate`'s (the attention kernel of a CUDA target). With ``world_size`` and ``parallel``
    (:func:`memprof.estimate`'s) the batch is one rank's and the budget one rank's device.
    With ``gpu`` (a name or a GpuSpec; ``alloc_conf`` as :func:`memprof.estimate`'s) each batch size's
    device-level peak (tensors, the allocator's cache, the memory outside torch) is judged against the GPU's
    capacity, or against ``budget`` when one is given too; ``budget`` may then be None.
    """
    from .ranks import check_parallel
    from .estimate import estimate

    world_size, parallel = check_parallel(world_size, parallel)

    if not callable(make_batch):
        raise InvalidArgumentError(f"make_batch must be a function of the batch size returning the inputs (or "
                                   f"(inputs, targets)), got {type(make_batch).__name__}")
    limit, gpu = _limit(budget, gpu, device, alloc_conf)
    if not isinstance(multiple_of, int) or multiple_of < 1:
        raise InvalidArgumentError(f"multiple_of must be a positive int, got {multiple_of!r}")

    def simulated_peak(b: int) -> int:
        batch = make_batch(b)
        if isinstance(batch, tuple) and len(batch) == 2 and loss_fn is not None:
            inputs, targets = batch
        else:
            inputs, targets = batch, None
        est = estimate(model, optimizer, inputs=inputs, targets=targets, loss_fn=loss_fn, device=device,
                       attention=attention, world_size=world_size, parallel=parallel, gpu=gpu, alloc_conf=alloc_conf)
        return _judged(est, gpu)

    return _plan("max_batch_size", simulated_peak, limit, multiple_of)


def max_generation_batch_size(
    model: Any,
    budget: "int | str | None" = None,
    *,
    prompt_len: int,
    max_new_tokens: int,
    precision: "str | None" = None,
    device: "str | None" = None,
    multiple_of: int = 1,
    attention: str = "auto",
    gpu: Any = None,
    alloc_conf: Any = None,
) -> BatchSizePlan:
    """The largest number of sequences (a multiple of ``multiple_of``) that generate ``max_new_tokens`` tokens
    after a ``prompt_len``-token prompt within ``budget``, by :func:`memprof.estimate_generation`: the KV cache
    and the decode temporaries grow with the batch, the weights do not. The arguments are
    :func:`memprof.estimate_generation`'s; the answer is a :class:`BatchSizePlan`. With ``gpu`` the device-level
    peak is judged against the GPU's capacity (or ``budget``), as in :func:`max_batch_size`.
    """
    from .generation import estimate_generation

    limit, gpu = _limit(budget, gpu, device, alloc_conf)
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise InvalidArgumentError(f"multiple_of must be a positive int, got {multiple_of!r}")

    def simulated_peak(b: int) -> int:
        est = estimate_generation(model, batch_size=b, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                                  precision=precision, device=device, attention=attention, gpu=gpu,
                                  alloc_conf=alloc_conf)
        return _judged(est, gpu)

    return _plan("max_generation_batch_size", simulated_peak, limit, multiple_of)


def _limit(budget: "int | str | None", gpu: Any, device: Any, alloc_conf: Any) -> "tuple[int, Any]":
    """The bytes a plan must fit (``budget``, else the GPU's capacity) and the GPU's spec (None without one)."""
    from .device_memory import check_target

    spec, _ = check_target(gpu, device, alloc_conf)
    if budget is None:
        if spec is None:
            raise InvalidArgumentError("give budget= (bytes or '24 GiB') or gpu= (a GPU name such as 'h100-80gb')")
        return spec.allocatable_bytes, spec
    return _budget(budget), spec


def _judged(est: Any, gpu: Any) -> "tuple[int, int]":
    """The peak a plan judges (the device-level peak with a GPU, an out-of-memory error predicted on its way
    counting as not fitting; else the tensors' peak) and the tensors' peak."""
    if gpu is None or est.device_memory is None:
        return est.peak_bytes, est.peak_bytes
    memory = est.device_memory
    if memory.oom is not None:
        return max(memory.device_peak, memory.capacity + 1), est.peak_bytes
    return memory.device_peak, est.peak_bytes


def _budget(budget: "int | str") -> int:
    """The budget in bytes, at most :data:`MAX_BUDGET`."""
    limit = parse_size(budget)
    if limit > MAX_BUDGET:
        raise InvalidArgumentError(
            f"budget {budget!r} ({format_bytes(limit)}) is more than the planner can search: it stops at "
            f"{format_bytes(MAX_BUDGET)} per device, where torch's tensor sizes still hold for its probes; give "
            "one device's memory (e.g. '80 GiB')")
    return limit


def _plan(label: str, simulated_peak: Callable[[int], "tuple[int, int]"], limit: int,
          multiple_of: int) -> BatchSizePlan:
    """The search, each batch size simulated once (``simulated_peak(b)``: the peak judged and the tensors'),
    with a progress bar named ``label``."""
    from .progress import Progress

    cache: dict[int, int] = {}
    tensors: dict[int, int] = {}
    bar = Progress(None, label)

    def peak(b: int) -> int:
        if b not in cache:
            bar.step(f"batch size {b}")
            cache[b], tensors[b] = simulated_peak(b)
        return cache[b]

    with bar:
        return _search(peak, cache, limit, multiple_of, tensors)


def _search(peak: Callable[[int], int], cache: dict[int, int], limit: int, multiple_of: int,
            tensors: "dict[int, int] | None" = None) -> BatchSizePlan:
    """The largest multiple of ``multiple_of`` whose ``peak`` fits ``limit`` (``peak`` fills ``cache``)."""
    b1, b2 = multiple_of, 2 * multiple_of
    p1, p2 = peak(b1), peak(b2)
    # The line's slope is the tensors' (a device-level peak grows in whole segments: small batches share one).
    t1, t2 = (tensors[b1], tensors[b2]) if tensors else (p1, p2)
    per_sample = (t2 - t1) / (b2 - b1)
    fixed = int(round(p1 - per_sample * b1))
    if per_sample <= 0:
        raise InvalidArgumentError("peak memory does not grow with the batch size here; check make_batch(b)")
    # The straight line gives a first guess. From it, steps of 1, 2, 4 ... multiples (up while they
    # fit, down while they do not) bracket the answer, and bisection finds it: when the line is exact
    # that is two simulations, and when it is far off (the optimizer step dominating small batches)
    # the steps grow until they reach the answer.
    guess = max(1, int((limit - fixed) // per_sample) // multiple_of)
    lo, hi = 0, None  # multiples known to fit (lo) and not to fit (hi)
    step = 1
    if peak(guess * multiple_of) <= limit:
        lo = guess
        while hi is None:
            probe = lo + step
            if peak(probe * multiple_of) <= limit:
                lo, step = probe, step * 2
            else:
                hi = probe
    else:
        hi = guess
        while lo == 0 and hi > 1:
            probe = max(1, hi - step)
            if peak(probe * multiple_of) <= limit:
                lo = probe
            else:
                hi, step = probe, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak(mid * multiple_of) <= limit:
            lo = mid
        else:
            hi = mid
    best = lo * multiple_of
    verified = (best == 0 or cache.get(best, limit + 1) <= limit) and cache.get((lo + 1) * multiple_of, 0) > limit
    points = tuple(sorted(cache.items()))
    return BatchSizePlan(
        batch_size=best,
        budget=limit,
        fixed_bytes=fixed,
        per_sample_bytes=per_sample,
        peak_bytes=cache.get(best) if best else None,
        points=points,
        verified=verified,
        multiple_of=multiple_of,
    )
