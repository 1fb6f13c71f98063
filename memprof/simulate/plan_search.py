"""The plan's search for one configuration's largest batch: per-moment lines, then confirmation by simulation.

A simulated training step runs the same ops whatever the batch, and each tensor's bytes are either independent of
the batch (weights, gradients, optimizer states, FSDP's gathered units, DDP's buckets) or proportional to it
(activations, inputs, the temporaries of a batch's ops). So each *moment* of the step (the start, peak and end of
every phase of every step) holds a total that is a line in the batch. The tensors' peak is the largest of those
moments, not one line: at small batches the optimizer step's moment (flat in the batch) can hold the peak while the
forward's or backward's (steep) takes over at larger ones, which a line through the peaks at two batches misses.
:class:`Lines` keeps every moment's line and predicts the peak at any batch as the largest of them.

The answer is never a prediction: :func:`largest_batch` simulates the batch it settles on and the one above, and
only returns a batch as confirmed when the first fits the device and the second does not. The device-level peak
(the caching allocator's segments, the memory outside torch) moves in whole segments, which no line follows. Once a
configuration has two simulated batches whose allocation streams have the same shape (the same storages made,
resized and freed in the same order), every event's bytes are a line in the batch as well: the stream of a batch
not simulated is interpolated event by event (:func:`stream_between`) and replayed through the allocator model
(:meth:`memprof.simulate.device_memory.Replay.figures`), which predicts the device-level peak segments included,
at a few per cent of a simulation's cost. Before that, the predictions add the overhead the nearest simulated batch
that did not run out of memory showed (:meth:`Probe.overhead`). Where a prediction is wrong the simulations say so
and the search goes on, by the lines and streams refitted to the simulated batches, and by bisection where those
make no progress.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Sequence

from ..record.estimate import Estimate
from .device_memory import replay_of

if TYPE_CHECKING:
    from ..record.trace import Trace
    from ..vocabulary import Category

__all__ = ["Moment", "moments", "per_sample", "Lines", "Probe", "largest_batch", "stream_shape", "stream_between"]


#: A moment of a simulated step whose tensor bytes a plan follows across batches: (step, the phase's value, its
#: occurrence in the step, "start" | "peak" | "end"), as :func:`moments` keys them.
Moment = tuple[int, str, int, str]


def moments(trace: "Trace") -> dict[Moment, int]:
    """Every phase record's start, peak and end tensors' bytes, keyed by (step, phase, occurrence, which).

    The tensor categories only: a simulation for a GPU also writes the allocator's overhead and the memory outside
    torch into its records, which move in whole segments and are not lines in the batch."""
    from ..vocabulary import TENSOR_CATEGORIES

    return _totals(trace, lambda phase: TENSOR_CATEGORIES)


def _totals(trace: "Trace", categories: "Callable[[str], Sequence[Category]]") -> dict[Moment, int]:
    """Every phase record's start, peak and end bytes of the categories ``categories(phase)`` names (the phase's
    value), keyed as :func:`moments` keys them."""
    out: dict[Moment, int] = {}
    for rec in trace.phases:
        phase = getattr(rec.phase, "value", rec.phase)
        key, cats = (rec.step, phase, rec.occurrence), categories(phase)
        for which in ("start", "peak", "end"):
            part = getattr(rec, which)
            out[key + (which,)] = sum(part[c] or 0 for c in cats)
    return out


class Lines:
    """Each moment's total as ``at[m] + slope[m] * (b - base)``; the predicted tensors' peak at ``b`` is the largest
    (a moment with no known slope counts as flat)."""

    def __init__(self, base: int, at: Mapping[Moment, int], slope: Mapping[Moment, float]) -> None:
        self.base, self.at, self.slope = base, dict(at), dict(slope)

    @classmethod
    def through(cls, b1: int, m1: Mapping[Moment, int], b2: int, m2: Mapping[Moment, int]) -> "Lines":
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


def stream_shape(stream: Sequence[tuple[int, int, int]]) -> "tuple[array[int], array[int]]":
    """A stream's shape, each event's storage as the n-th the run made (an address reused after a free is a new
    storage), a free written ``-n - 2`` (-1: a storage the stream never made); and each event's bytes (-1 for a
    free). Two batches of one configuration whose shapes are equal made, resized and freed the same storages in
    the same order."""
    live: dict[int, int] = {}
    ids = array("q")
    sizes = array("q")
    made = 0
    for _seq, key, nbytes in stream:
        if nbytes < 0:
            ids.append(-live.pop(key, -1) - 2)
        else:
            n = live.get(key)
            if n is None:
                n = live[key] = made
                made += 1
            ids.append(n)
        sizes.append(nbytes)
    return ids, sizes


def stream_between(b1: int, stream1: Sequence[tuple[int, int, int]], sizes2: Sequence[int], b2: int,
                   b: int) -> list[tuple[int, int, int]]:
    """The stream of batch ``b`` from two of the same shape, ``stream1`` at ``b1`` and the bytes ``sizes2`` of
    ``b2``'s: each event's bytes on the line through the two, rounded up and never below 0, its seq and key
    ``stream1``'s. Exact where every storage's bytes are a line in the batch, as shapes proportional to it make
    them; a storage whose bytes grow otherwise (padded to a multiple, or like a square root) is predicted off its
    truth, either way, which is why the search confirms whatever it predicts by simulation."""
    out = []
    span, ahead = b2 - b1, b - b1
    for (seq, key, n1), n2 in zip(stream1, sizes2):
        if n1 >= 0:
            n1 = max(0, n1 - (-(n2 - n1) * ahead // span))  # n1 + ceil((n2 - n1) * ahead / span)
        out.append((seq, key, n1))
    return out


class Probe:
    """One configuration's simulated batches: ``simulate(b)`` gives the Estimate; :meth:`judged` is the peak a
    plan judges against :attr:`limit`, and :meth:`predicted` the same for a batch not simulated, from the streams of
    two that were.

    With ``device_level`` (a GPU's plan) the peak judged is the device-level one (the caching allocator's segments
    and the memory outside torch), an out-of-memory error the replay predicts counting as over the limit; and where
    a memory fraction caps the allocator (``per_process_memory_fraction``: :attr:`~memprof.simulate.device_memory.
    DeviceMemory.allocator_limit`), :attr:`limit` is no more than that cap plus the memory outside torch, which the
    first simulation tells (it does not depend on the batch). Without it (a budget and no GPU) the tensors' peak is
    judged, and no stream is replayed."""

    def __init__(self, simulate: "Callable[[int], Estimate]", limit: int, max_batch: int,
                 step: Callable[[int], None] = lambda b: None, device_level: bool = True) -> None:
        self.simulate, self.limit, self.max_batch, self.step = simulate, limit, max_batch, step
        self.device_level = device_level
        self.runs: "dict[int, Estimate]" = {}
        self.moments: dict[int, dict[Moment, int]] = {}
        self.device: dict[int, int] = {}
        #: Per simulated batch: the peak judged as simulated (an out-of-memory batch's the peak its replay needed
        #: without the device's limit), and whether its replay predicted an out-of-memory error.
        self.peaks: dict[int, int] = {}
        self.oom: dict[int, bool] = {}
        # Per batch simulated or predicted: was memory pressed (the allocator freed its cache and retried, or
        # failed)? Below the batches where it was, every batch fits (see largest_batch).
        self.pressed: dict[int, bool] = {}
        # Per simulated batch with a replay: its stream's shape and bytes (made when a prediction first needs
        # them, dropped by forget_streams()).
        self.shapes: dict[int, "tuple[array[int], array[int]] | None"] = {}
        self.predictions: dict[int, "int | None"] = {}

    def _verdict(self, device_peak: int, oom: "str | None") -> int:
        fits = oom is None and device_peak <= self.limit
        return device_peak if fits else max(device_peak, self.limit + 1)

    def judged(self, b: int) -> int:
        if b > self.max_batch:
            return self.limit + 1  # the search's ceiling: a batch this large is not simulated
        if b not in self.device:
            self.step(b)
            est = self.simulate(b)
            self.runs[b], self.moments[b] = est, moments(est.trace)
            memory = est.device_memory if self.device_level else None
            if memory is None:
                peak, oom, pressed = est.peak_bytes, None, False
            else:
                peak, oom = memory.device_peak, memory.oom
                pressed = oom is not None or bool(getattr(memory, "num_alloc_retries", 0))
                cap = getattr(memory, "allocator_limit", None)
                if cap is not None:  # what the fraction lets the allocator reserve, and what lies outside it
                    self.limit = min(self.limit, cap + memory.outside_bytes)
            self.peaks[b], self.oom[b], self.pressed[b] = peak, oom is not None, pressed
            self.device[b] = self._verdict(peak, oom)
            self.predictions.clear()  # a new stream to predict from, nearer some batches
        return self.device[b]

    def fits(self, b: int) -> bool:
        return self.judged(b) <= self.limit

    def moments_at(self, b: int) -> "dict[Moment, int] | None":
        """The moments at batch ``b``: as simulated, else on the lines through the two simulated batches nearest it
        (a prediction, for a like configuration's start); None with fewer than two."""
        if b in self.moments:
            return self.moments[b]
        near = sorted(sorted(self.runs, key=lambda s: (abs(s - b), -s))[:2])
        if len(near) < 2:
            return None
        lines = Lines.through(near[0], self.moments[near[0]], near[1], self.moments[near[1]])
        return {m: round(v + lines.slope[m] * (b - near[0])) for m, v in lines.at.items()}

    def _shape(self, b: int) -> "tuple[array[int], array[int]] | None":
        if b not in self.shapes:
            # A plan of the tensors' peak replays nothing: a device replay's figures are not what it judges.
            replay = replay_of(self.runs[b].device_memory) if self.device_level else None
            self.shapes[b] = None if replay is None else stream_shape(replay.stream())
        return self.shapes[b]

    def predicted(self, b: int) -> "int | None":
        """The device-level figure :meth:`judged` would give ``b``: the simulated one where ``b`` was simulated,
        else the replay of its stream interpolated between the two simulated batches nearest it whose streams
        have the same shape (:func:`stream_between`); None when no two have."""
        if b > self.max_batch:
            return self.limit + 1
        if b in self.device:
            return self.device[b]
        if b not in self.predictions:
            self.predictions[b] = self._predict(b)
        return self.predictions[b]

    def _predict(self, b: int) -> "int | None":
        pair = self._pair(b)
        if pair is None:
            return None
        b1, b2 = pair
        replay, shape2 = replay_of(self.runs[b1].device_memory), self._shape(b2)
        assert replay is not None and shape2 is not None  # _pair chose two batches whose replays it shaped
        device_peak, oom, pressed = replay.figures(stream_between(b1, replay.stream(), shape2[1], b2, b))
        self.pressed[b] = pressed
        return self._verdict(device_peak, oom)

    def _pair(self, b: int) -> "tuple[int, int] | None":
        """The two simulated batches nearest ``b`` whose streams have one shape."""
        near = sorted(self.runs, key=lambda s: (abs(s - b), -s))
        for i, b1 in enumerate(near):
            one = self._shape(b1)
            if one is None:
                continue
            for b2 in near[i + 1:]:
                two = self._shape(b2)
                if two is not None and two[0] == one[0]:
                    return b1, b2
        return None

    def can_predict(self) -> bool:
        """Are there two simulated batches whose streams have one shape (:meth:`predicted` answers)?"""
        return self._pair(0) is not None

    def forget_streams(self) -> None:
        """Drop the streams' shapes and the predictions (a finished row's: a plan keeps its probes)."""
        self.shapes.clear()
        self.predictions.clear()

    def overhead(self, b: int, fallback: "int | None" = None) -> int:
        """The device-level bytes above the tensors' peak (the allocator's cache and rounding, the memory outside
        torch) at the simulated batch nearest ``b`` whose replay did not run out of memory; where every simulated
        batch did, ``fallback`` when given, else the nearest one's.

        A batch that runs out of memory is not a guide to one that fits: its figure is the replay without the
        device's limit (:func:`memprof.simulate.device_memory.device_memory`), in which the allocator never frees
        its cache to retry, so its segments hold more above the tensors than a batch at the limit's do (on
        Llama-3-8B under ZeRO-3 with checkpointing, 21.9 GiB at a batch that did not fit against 6.2 GiB at the
        largest that did). Predicting from it puts the next guess too low, which costs a simulation more."""
        if not self.device_level:
            return 0
        fitted = [s for s in self.runs if not self.oom[s]]
        if not fitted and fallback is not None:
            return fallback
        near = min(fitted or self.runs, key=lambda s: (abs(s - b), -s))
        memory = self.runs[near].device_memory
        return 0 if memory is None else max(0, memory.device_peak - self.runs[near].peak_bytes)


class _Prediction(NamedTuple):
    """A prediction of a configuration's moments at ``start_batch`` and of its device bytes above the tensors
    (``overhead``), from a like configuration (None: none)."""

    start: "Mapping[Moment, int] | None"
    overhead: int
    start_batch: int


def per_sample(trace: "Trace", batch: int) -> dict[Moment, float]:
    """A first guess at each moment's slope (bytes per sample) from one simulated batch of ``batch`` samples: the
    moment's bytes that grow with the batch over its samples. Those are the activations and the inputs, and the
    temporaries outside the optimizer step (the batch's ops'; the step's are the parameters'); the model states
    and the collectives' buffers count as flat. A guess, never an answer: a moment that holds more that is flat
    (a position table among the activations) or more that grows (sequence-parallel buffers) puts the first
    guessed batch off by some samples, which the simulations that confirm it correct, by the lines through two
    simulated batches from then on."""
    from ..vocabulary import Category, Phase

    grows = (Category.ACTIVATIONS, Category.INPUTS)
    growing = _totals(trace, lambda phase: grows if phase == Phase.OPTIMIZER.value else (*grows, Category.TEMPORARIES))
    return {m: v / batch for m, v in growing.items()}


def _opening(probe: Probe, shared: "Mapping[Moment, float] | None", start: "Mapping[Moment, int] | None",
             base: int) -> "tuple[int, int | None, dict[Moment, float] | None, Mapping[Moment, int] | None, bool]":
    """The search's first simulations: batch ``base`` where a like configuration's slopes are shared (and its
    moments are this one's), else batch 1, its slopes guessed from what grows with the batch (:func:`per_sample`)
    until a second batch is simulated. The bracket (lo, hi: the largest batch known to fit, 0 for none; the
    smallest known not to), the slopes to predict with, the start prediction if it still holds, and whether the
    configuration measures lines of its own (not a like configuration's)."""
    ceiling = probe.max_batch
    lo, hi = 0, None
    slopes = dict(shared) if shared is not None else None
    if start is not None and slopes is not None and start.keys() <= slopes.keys():
        return lo, hi, slopes, start, False
    if slopes is not None:
        base = max(1, min(base, ceiling))
        if probe.fits(base):
            lo = base
        else:
            hi = base
        if not probe.moments[base].keys() <= slopes.keys():
            slopes = None
    if slopes is None:  # lines of its own, from batch 1 (and ``base`` where it was simulated)
        if ceiling >= 1 and (hi is None or hi > 1):
            if probe.fits(1):
                lo = max(lo, 1)
            else:
                hi = 1
        if hi != 1 and list(probe.runs) == [1]:
            # A second batch would measure the lines; a guess of them from the first (the batch its answer
            # predicts, and the one above it, are simulated next either way) saves that simulation when it is
            # right, and where it is off those two measure the lines.
            slopes = per_sample(probe.runs[1].trace, 1)
        return lo, hi, slopes, None, True
    return lo, hi, slopes, None, False


def _narrowed(probe: Probe, lo: int, hi: "int | None", ceiling: int, slopes: "Mapping[Moment, float] | None",
              prediction: _Prediction) -> "tuple[int, int | None]":
    """Close the bracket to adjacent batches (or to the ceiling), each probe the batch the lines (or the replayed
    streams) predict, bisecting where the lines keep missing on one side."""
    same_side = 0  # probes in a row that moved the same end of the bracket: then bisect
    last_side = None
    replaying = False
    measured = len(probe.runs) >= 2
    while (hi is None or hi - lo > 1) and lo < ceiling:
        if not measured and len(probe.runs) >= 2:
            # Lines through two simulated batches replace one batch's guess of them (per_sample): the guess's
            # misses do not count towards a bisection either.
            measured, same_side = True, 0
        top = ceiling if hi is None else hi - 1
        guess = _predicted(probe, slopes or {}, lo, hi, probe.limit, top, prediction.start, prediction.overhead,
                           prediction.start_batch)
        replayed = _replayed_guess(probe, lo, top, guess)
        if replayed is not None:
            guess = replayed
            if not replaying:
                # The replayed streams are a new predictor, not the lines that missed: the misses before them do
                # not count towards a bisection (it would throw away the first guess of the better predictor).
                replaying, same_side = True, 0
        if guess <= lo and same_side < 3:
            # The lines say lo is the answer: simulate the batch above it, which confirms it or moves on by one
            # (the allocator's segments put a device peak about a sample away from the lines). A leap here
            # would cost a simulation more in that common case; only after three such steps up in a row does
            # it leap.
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
    return lo, hi


def largest_batch(probe: Probe, shared: "Mapping[Moment, float] | None" = None,
                  start: "Mapping[Moment, int] | None" = None, overhead: int = 0,
                  start_batch: int = 1, base: int = 1) -> "tuple[int, bool, dict[Moment, float] | None]":
    """The edge below which every batch fits ``probe.limit`` (the largest batch that fits, where fitting is
    monotone in the batch), whether it is confirmed (it fits and the next does not, both simulated; or batch 1
    does not fit), and the per-moment slopes this configuration measured (None when it measured none), for the
    like configurations that follow.

    ``shared`` is the per-moment slope (bytes per sample) a configuration of the same precision and checkpointing
    measured: the layouts share how activations grow and differ in the model states, which are flat in the batch.
    With it the search starts from batch ``base``; without it (or when this configuration's moments are not the
    same ones) from batch 1, whose slopes it guesses from what grows with the batch (:func:`per_sample`): the
    batch they predict and the one above it are simulated next, which confirm the answer where the guess was
    right and measure the lines where it was not (a second batch simulated only to measure them would cost one
    simulation more in the first case and save none in the second). The measured slopes returned are the lines
    through its two smallest simulated batches. Batch 1 settles a row that does not fit one sample in one
    simulation; ``base`` 2 pairs with the batches above it, where batch 1's stream may not: a model's code can
    take another path at one sample (transformers' Llama makes and frees a 4-byte scalar twice a step from two
    samples on, not at one), and then batch 1's stream has no partner of its shape to predict the device peak
    with (:meth:`Probe.predicted`). ``start`` is a prediction of this configuration's moments at ``start_batch``
    (and ``overhead`` of its device bytes above the tensors): with it and ``shared`` the search simulates the
    batch they predict first, and batches 1 and 2 only if it comes to them.
    """
    ceiling = probe.max_batch  # (probe.limit is read where used: a memory fraction's cap lowers it at the first run)
    lo, hi, slopes, start, own = _opening(probe, shared, start, base)
    if hi == 1 and slopes is None:
        return 0, True, None  # batch 1 does not fit: settled by one simulation
    while True:
        lo, hi = _narrowed(probe, lo, hi, ceiling, slopes, _Prediction(start, overhead, start_batch))
        # Fitting is not monotone in the batch where memory is pressed: the allocator frees its cache and retries,
        # and one batch can fail where the next fits. The answer is the edge below which every batch fits (a user
        # who takes fewer samples than the answer must not meet an out-of-memory error), so a batch below it that
        # the streams predict not to fit, once simulated, moves the search below it.
        gap = _gap_below(probe, lo)
        while gap is not None and probe.fits(gap):
            # The prediction was wrong there: ask again, from the streams this simulation brings (a batch found to
            # fit is never the answer to it again, so each turn simulates a new batch).
            gap = _gap_below(probe, lo)
        if gap is None:
            break
        hi = gap
        lo = max((b for b in probe.runs if b < gap and probe.device[b] <= probe.limit), default=0)
    verified = hi is not None and hi == lo + 1 and (lo == 0 or lo in probe.runs)
    probe.forget_streams()
    measured = None
    if own and len(probe.runs) >= 2:  # the lines through its two smallest simulated batches
        b1, b2 = sorted(probe.runs)[:2]
        measured = Lines.through(b1, probe.moments[b1], b2, probe.moments[b2]).slope
    return lo, verified, measured


def _gap_below(probe: Probe, answer: int) -> "int | None":
    """The smallest batch below ``answer`` predicted not to fit, looked for from ``answer`` down while memory is
    pressed (simulated or predicted: the allocator freed its cache and retried, or failed), down to a batch that
    fits without pressing memory (below it the streams are smaller and fit as well) or one that cannot be
    predicted; None when there is none. The smallest, so that a row with several bands costs two simulations
    more, not two per band."""
    gap = None
    for b in range(answer - 1, 0, -1):
        judged = probe.predicted(b)
        if judged is None:
            break
        if judged > probe.limit:
            gap = b
        elif not probe.pressed.get(b, True):
            break
    return gap


def _replayed_guess(probe: Probe, lo: int, top: int, near: int) -> "int | None":
    """The largest batch in ``lo + 1 .. top`` whose predicted stream fits (``lo`` when not even ``lo + 1``'s
    does), as the device peak grows with the batch: from ``near`` (the lines' guess), in steps that double away
    from it until the prediction changes side, then by bisection, so that a good guess costs a few replays (a large
    model's replay takes a fraction of a second). None while no two simulated streams of one shape can predict."""
    if not probe.can_predict():
        return None
    limit = probe.limit

    def fits(b: int) -> bool:
        judged = probe.predicted(b)
        return judged is not None and judged <= limit

    fit, over = lo, top + 1  # predicted to fit (lo: known to), predicted not to (top + 1: beyond the search)
    at = min(max(near, lo + 1), top)
    step = 1
    if fits(at):
        fit = at
        while fit < top:
            nxt = min(top, fit + step)
            if not fits(nxt):
                over = nxt
                break
            fit, step = nxt, 2 * step
    else:
        over = at
        while over - 1 > lo:
            nxt = max(lo + 1, over - step)
            if fits(nxt):
                fit = nxt
                break
            over, step = nxt, 2 * step
    while over - fit > 1:
        mid = (fit + over) // 2
        if fits(mid):
            fit = mid
        else:
            over = mid
    return fit


def _predicted(probe: Probe, slopes: Mapping[Moment, float], lo: int, hi: "int | None", limit: int, top: int,
               start: "Mapping[Moment, int] | None", overhead: int, start_batch: int = 1) -> int:
    """The largest batch the moments' lines put within ``limit`` after the device overhead: through the two
    simulated batches nearest the bracket when there are two, else through the one with ``slopes``, else from
    ``start`` (the moments predicted at ``start_batch``) with ``slopes`` and ``overhead``."""
    simulated = sorted(probe.runs)
    if len(simulated) >= 2:
        ends = [b for b in (lo, hi) if b is not None and b in probe.runs]
        others = [b for b in simulated if b not in ends]
        near = sorted(ends + sorted(others, key=lambda b: abs(b - lo))[: max(0, 2 - len(ends))])[:2]
        lines = Lines.through(near[0], probe.moments[near[0]], near[1], probe.moments[near[1]])
    elif simulated:
        lines = Lines(simulated[0], probe.moments[simulated[0]], slopes)
    else:
        return Lines(start_batch, start or {}, slopes).largest(limit - overhead, top)
    fallback = overhead if start is not None else None  # a like configuration's, where it predicted the start
    guess = lines.largest(limit - probe.overhead(lo, fallback), top)
    if guess > lo:  # the overhead grows with the segments: take the one simulated nearest the guess
        guess = lines.largest(limit - probe.overhead(guess, fallback), top)
    if hi is not None and guess >= hi:
        guess = hi - 1
    return guess
