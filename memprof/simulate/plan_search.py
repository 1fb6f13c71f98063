"""The plan's search for one configuration's largest batch: per-moment lines, then confirmation by simulation.

A simulated training step runs the same ops whatever the batch, and each tensor's bytes are either independent of
the batch (weights, gradients, optimizer states, FSDP's gathered units, DDP's buckets) or proportional to it
(activations, inputs, the temporaries of a batch's ops). So each *moment* of the step (the start, peak and end of
every phase of every step) holds a total that is a line in the batch. The tensors' peak is the largest of those
moments, not one line: at small batches the optimizer step's moment (flat in the batch) can hold the peak while the
forward's or backward's (steep) takes over at larger ones, which a line through the peaks at batches 1 and 2 misses.
:class:`Lines` keeps every moment's line and predicts the peak at any batch as the largest of them.

The answer is never a prediction: :func:`largest_batch` simulates the batch it settles on and the one above, and
only returns a batch as confirmed when the first fits the device and the second does not. The device-level peak
(the caching allocator's segments, the memory outside torch) moves in whole segments, so the predictions add the
overhead the nearest simulated batch showed; where a prediction is wrong the simulations say so and the search
goes on, by the lines refitted to the simulated batches, and by bisection where those make no progress.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = ["moments", "Lines", "Probe", "largest_batch"]


def moments(trace: Any) -> dict[tuple[Any, ...], int]:
    """Every phase record's start, peak and end tensors' bytes, keyed by (step, phase, occurrence, which).

    The tensor categories only: a simulation for a GPU also writes the allocator's overhead and the memory outside
    torch into its records, which move in whole segments and are not lines in the batch."""
    from ..vocabulary import TENSOR_CATEGORIES

    out: dict[tuple[Any, ...], int] = {}
    for rec in trace.phases:
        key = (rec.step, getattr(rec.phase, "value", rec.phase), rec.occurrence)
        for which in ("start", "peak", "end"):
            part = getattr(rec, which)
            out[(*key, which)] = sum(part[c] or 0 for c in TENSOR_CATEGORIES)
    return out


class Lines:
    """Each moment's total as ``at[m] + slope[m] * (b - base)``; the predicted tensors' peak at ``b`` is the largest
    (a moment with no known slope counts as flat)."""

    def __init__(self, base: int, at: Mapping[Any, int], slope: Mapping[Any, float]) -> None:
        self.base, self.at, self.slope = base, dict(at), dict(slope)

    @classmethod
    def through(cls, b1: int, m1: Mapping[Any, int], b2: int, m2: Mapping[Any, int]) -> "Lines":
        """The lines through two simulated batches of one configuration (their moments)."""
        common = m1.keys() & m2.keys()
        return cls(b1, {k: m1[k] for k in common}, {k: (m2[k] - m1[k]) / (b2 - b1) for k in common})

    def peak(self, b: int) -> float:
        return max((v + self.slope.get(k, 0.0) * (b - self.base) for k, v in self.at.items()), default=0.0)

    def largest(self, room: int, ceiling: int) -> int:
        """The largest batch (at most ``ceiling``, at least 0) whose predicted peak is within ``room`` bytes."""
        best = ceiling
        for k, v in self.at.items():
            per = self.slope.get(k, 0.0)
            if per > 0:
                best = min(best, self.base + int((room - v) // per))
            elif v > room:
                return 0
        return max(best, 0)


class Probe:
    """One configuration's simulated batches: ``simulate(b)`` gives the Estimate; :meth:`judged` is the
    device-level peak a plan judges (an out-of-memory error the replay predicts counting as over the limit)."""

    def __init__(self, simulate: Callable[[int], Any], limit: int, max_batch: int,
                 step: Callable[[int], None] = lambda b: None) -> None:
        self.simulate, self.limit, self.max_batch, self.step = simulate, limit, max_batch, step
        self.runs: dict[int, Any] = {}
        self.moments: dict[int, dict[tuple[Any, ...], int]] = {}
        self.device: dict[int, int] = {}

    def judged(self, b: int) -> int:
        if b > self.max_batch:
            return self.limit + 1  # the search's ceiling: a batch this large is not simulated
        if b not in self.device:
            self.step(b)
            est = self.simulate(b)
            self.runs[b], self.moments[b] = est, moments(est.trace)
            memory = est.device_memory
            fits = memory.oom is None and memory.device_peak <= self.limit
            self.device[b] = memory.device_peak if fits else max(memory.device_peak, self.limit + 1)
        return self.device[b]

    def fits(self, b: int) -> bool:
        return self.judged(b) <= self.limit

    def overhead(self, b: int) -> int:
        """The device-level bytes above the tensors' peak at the simulated batch nearest ``b`` (the allocator's
        cache and rounding, the memory outside torch); a batch the replay ran out of memory at counts its
        capacity-capped peak, so the figure is a lower bound there."""
        near = min(self.runs, key=lambda s: (abs(s - b), -s))
        est = self.runs[near]
        return max(0, est.device_memory.device_peak - est.peak_bytes)


def largest_batch(probe: Probe, shared: "Mapping[Any, float] | None" = None,
                  start: "Mapping[Any, int] | None" = None, overhead: int = 0) -> "tuple[int, bool, dict | None]":
    """The largest batch that fits ``probe.limit``, whether it is confirmed (it fits and the next does not, both
    simulated; or batch 1 does not fit), and the per-moment slopes this configuration measured (None when it
    measured none), for the like configurations that follow.

    ``shared`` is the per-moment slope (bytes per sample) a configuration of the same precision and checkpointing
    measured: the layouts share how activations grow and differ in the model states, which are flat in the batch.
    Without it (or when this configuration's moments are not the same ones) batch 2 is simulated too. ``start``
    is a prediction of this configuration's moments at batch 1 (and ``overhead`` of its device bytes above the
    tensors): with it and ``shared`` the search simulates the batch they predict first, and batch 1 only if it
    comes to it.
    """
    limit, ceiling = probe.limit, probe.max_batch
    lo, hi = 0, None  # the largest batch known to fit (0: none simulated yet), the smallest known not to
    slopes = dict(shared) if shared is not None else None
    if start is None or slopes is None or not start.keys() <= slopes.keys():
        start = None
        if not probe.fits(1):
            return 0, True, None
        lo = 1
        if slopes is not None and not probe.moments[1].keys() <= slopes.keys():
            slopes = None
        if slopes is None and ceiling >= 2:
            if probe.fits(2):
                lo = 2
            else:
                hi = 2
    measured = None
    if 1 in probe.runs and 2 in probe.runs:
        measured = Lines.through(1, probe.moments[1], 2, probe.moments[2]).slope
        slopes = measured
    same_side = 0  # probes in a row that moved the same end of the bracket: then bisect
    last_side = None
    while (hi is None or hi - lo > 1) and lo < ceiling:
        top = ceiling if hi is None else hi - 1
        guess = _predicted(probe, slopes or {}, lo, hi, limit, top, start, overhead)
        if guess <= lo and same_side < 3:
            # The lines say lo is the answer: simulate the batch above it, which confirms it or moves on by one
            # (the allocator's segments put a device peak about a sample away from the lines). A leap here would
            # cost a simulation more in that common case; only after three such steps up in a row does it leap.
            guess = lo + 1
        elif same_side >= 2:  # the lines keep missing on one side: bisect, or double while there is no ceiling
            guess = (lo + hi) // 2 if hi is not None else min(top, 2 * lo)
        guess = min(max(guess, lo + 1), top)
        side = "lo" if probe.fits(guess) else "hi"
        if side == "lo":
            lo = guess
        else:
            hi = guess
        same_side = same_side + 1 if side == last_side else 1
        last_side = side
    verified = hi is not None and hi == lo + 1 and (lo == 0 or lo in probe.runs)
    return lo, verified, measured


def _predicted(probe: Probe, slopes: Mapping[Any, float], lo: int, hi: "int | None", limit: int, top: int,
               start: "Mapping[Any, int] | None", overhead: int) -> int:
    """The largest batch the moments' lines put within ``limit`` after the device overhead: through the two
    simulated batches nearest the bracket when there are two, else through the one with ``slopes``, else from
    ``start`` (the moments predicted at batch 1) with ``slopes`` and ``overhead``."""
    simulated = sorted(probe.runs)
    if len(simulated) >= 2:
        ends = [b for b in (lo, hi) if b is not None and b in probe.runs]
        others = [b for b in simulated if b not in ends]
        near = sorted(ends + sorted(others, key=lambda b: abs(b - lo))[: max(0, 2 - len(ends))])[:2]
        lines = Lines.through(near[0], probe.moments[near[0]], near[1], probe.moments[near[1]])
    elif simulated:
        lines = Lines(simulated[0], probe.moments[simulated[0]], slopes)
    else:
        return Lines(1, start or {}, slopes).largest(limit - overhead, top)
    guess = lines.largest(limit - probe.overhead(lo), top)
    if guess > lo:  # the overhead grows with the segments: take the one simulated nearest the guess
        guess = lines.largest(limit - probe.overhead(guess), top)
    if hi is not None and guess >= hi:
        guess = hi - 1
    return guess
