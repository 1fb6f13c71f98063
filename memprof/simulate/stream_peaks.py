"""Each phase's peak at full depth, read off a model's extended allocation stream.

The figures extended in a line (:mod:`memprof.simulate.depth`) keep each phase's peak at the moment the cuts had it.
At full depth another moment of the phase can hold more: where the run a block adds leaves bytes live, the moment
that is the highest with a few blocks falls behind one that grows with the blocks (a 1F1B stage's forward over
short sequences; a last stage's backward under FSDP2 and tensor parallelism). The extended stream
(:func:`~memprof.simulate.depth_stream.extended_stream`) holds every event of the whole model, the category each
storage was made in and every move of one to another, so the live bytes at every moment are known, by category.
:func:`phase_peaks` moves each phase's peak to the first moment of its largest total, as the ledger keeps it
(``memprof.collect.ledger``: the composition right after the event that reached it, where a storage made in the
phase and moved later in it with ``retro`` counts in the category it moved to: ``memprof.collect.moves``), with the
composition there. The stream's composition at each phase's start, peak and end must be its record's, else nothing
is moved.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping

from ..record.parts import Breakdown
from ..vocabulary import TENSOR_CATEGORIES
from .alloc_stream import FREE
from .device_memory import moments_of, scaled_step

if TYPE_CHECKING:
    from ..collect.simulated import RecordedStream
    from ..record.estimate import Estimate
    from ..record.parts import PhaseRecord
    from .depth_stream import Extension

__all__ = ["phase_peaks", "peaks_move"]

_N = len(TENSOR_CATEGORIES)
#: Where a phase record is in a stream: the seqs of its start, its peak and its end (its span is (start, end]).
Span = tuple[int, int, int]


def phase_peaks(est: "Estimate", recorded: "RecordedStream", extension: "Extension"
                ) -> "tuple[Estimate, RecordedStream, list[str]] | str":
    """``est`` (its figures extended and corrected, :func:`~memprof.simulate.depth_stream.corrected`) and
    ``recorded`` (its extended stream; ``extension`` its categories, moves and moments) with every phase's peak at
    the first moment of the phase's largest tensor total in the stream, where one holds more than the record's
    peak: the record's peak is the stream's composition there (its saved tensors' tags not known), and the stream's
    moment moves with it; a note for each. A str saying why not where such a moment's composition is not known (a
    storage made in no known category), or where the stream's composition at a phase's start, peak or end is not
    its record's. The optimizer steps of a simulated rank under ZeRO or FSDP, whose stream takes each storage's
    share rounded up where the figures take a share of the sum
    (:func:`~memprof.simulate.device_memory.scaled_step`), are left as they are."""
    placed, records, spans = _spans(est, recorded)
    walk = _Walk(recorded, extension, max(1, est.trace.device.rounding or 1))
    tops = walk.highest(list(spans))
    wanted = {span: {span[1], *([tops[span][0]] if tops[span][1] > records[key].peak.tensor_bytes else [])}
              for span, key in spans.items()}
    found = walk.compositions(wanted)
    if isinstance(found, str):
        return found
    at_markers, at_peaks = found
    moved: dict[tuple[int, int], tuple[int, Breakdown]] = {}
    notes: list[str] = []
    for span, key in spans.items():
        rec = records[key]
        start, end = at_markers.get(span[0], set()), at_markers.get(span[2], set())
        peak = start if span[1] == span[0] else {c for c in [at_peaks.get((span, span[1]))] if c is not None}
        for b, held, seq in ((rec.start, start, span[0]), (rec.peak, peak, span[1]), (rec.end, end, span[2])):
            if tuple(v or 0 for v in b.counts[:_N]) not in held:
                return (f"the extended stream's storages by category at seq {seq} (step {rec.step} "
                        f"{rec.phase.value}) are not its record's")
        seq, total = tops[span]
        if total <= rec.peak.tensor_bytes:
            continue
        counts = at_peaks.get((span, seq))
        if counts is None:
            return (f"step {rec.step} {rec.phase.value}'s peak at full depth is another moment than the cuts' "
                    f"(seq {seq}), where a live storage's category is not known")
        # The record's total (None where it is not known) moves by the tensors' bytes; the device's terms are the
        # replay's to fill on a CUDA target.
        before = rec.peak.tensor_bytes
        # A category the record does not measure stays unmeasured (a ZeRO-1/2 rank's communication: the stream's
        # 0 there is no measurement, and with it every tensor category measured the replay would add its device
        # terms to a record that has none).
        kept = tuple(None if had is None else v for v, had in zip(counts, rec.peak.counts[:_N]))
        moved[key] = (seq, Breakdown((*kept, *rec.peak.counts[_N:]),
                                     None if rec.peak.total is None else rec.peak.total + total - before))
        notes.append(f"depth: at full depth step {rec.step} {rec.phase.value}'s peak is another moment than the "
                     f"cuts' (the extended stream's event {seq}: {total:,} B of tensors, where the cuts' moment "
                     f"holds {before:,} B); its composition is the stream's, the tags of the saved "
                     "tensors at it are not known")
    if not moved:
        return est, recorded, []
    return _with_peaks(est, moved), _stream_with_peaks(recorded, placed, moved), notes


def peaks_move(est: "Estimate", recorded: "RecordedStream") -> bool:
    """Does a moment of a phase in ``recorded`` (``est``'s extended stream) hold more tensor bytes than the phase's
    record's peak? Only then does :func:`phase_peaks` need the stream's moves (a costlier extension)."""
    _placed, records, spans = _spans(est, recorded)
    walk = _Walk(recorded, None, max(1, est.trace.device.rounding or 1))
    tops = walk.highest(list(spans))
    return any(tops[span][1] > records[key].peak.tensor_bytes for span, key in spans.items())


def _spans(est: "Estimate", recorded: "RecordedStream"
           ) -> "tuple[dict[tuple[int, int], Span], dict[tuple[int, int], PhaseRecord], dict[Span, tuple[int, int]]]":
    """Where each phase record is in ``recorded``, the records by (step index, position), and the spans whose
    peaks the stream can tell: from the run's start, a simulated ZeRO or FSDP rank's optimizer steps aside."""
    trace = est.trace
    placed, first, _peak, _end = moments_of(trace, recorded)
    records = {(s.index, i): rec for s in trace.steps for i, rec in enumerate(s.phases)}
    spans = {where: key for key, where in placed.items() if where[0] >= first and not scaled_step(trace, records[key])}
    return placed, records, spans


class _Walk:
    """Walks of an extended stream, its events with its moves and moments between them in order."""

    def __init__(self, recorded: "RecordedStream", extension: "Extension | None", rounding: int) -> None:
        self.events, self.rounding = recorded.events, rounding
        self.cats, self.side = (extension.cats, extension.side) if extension is not None else ([], [])

    def _size(self, nbytes: int) -> int:
        return -(-nbytes // self.rounding) * self.rounding if self.rounding > 1 else nbytes

    def highest(self, spans: "list[Span]") -> "dict[Span, tuple[int, int]]":
        """Each span's first event of its largest total over (start, end], as (seq, total); (peak seq, -1) for a
        span with no event."""
        sizes: dict[int, int] = {}
        total = 0
        tops = {span: (span[1], -1) for span in spans}
        by_end = sorted(spans, key=lambda s: (s[2], s[0]))
        p = 0
        for seq, key, nbytes in self.events:
            total -= sizes.pop(key, 0)
            if nbytes != FREE:
                sizes[key] = self._size(nbytes)
                total += sizes[key]
            while p < len(by_end) and by_end[p][2] < seq:
                p += 1
            for span in by_end[p:]:
                if span[0] < seq <= span[2] and total > tops[span][1]:
                    tops[span] = (seq, total)
        return tops

    def compositions(self, wanted: "Mapping[Span, set[int]]"
                     ) -> "tuple[dict[int, set[tuple[int, ...]]], dict[tuple[Span, int], tuple[int, ...]]] | str":
        """The composition by category at every moment's marker (by its seq: several where markers share one with
        moves between them), and for each span, at each of its ``wanted`` seqs (right after the event there) as
        the ledger keeps a phase's peak: a storage made in the span before that seq and moved later in the span
        with ``retro`` counts in the category it moved to. Only where every live storage's category is known."""
        sizes: dict[int, int] = {}
        cat_of: dict[int, int] = {}
        made_at: dict[int, int] = {}
        counts = [0] * _N
        unknown = 0
        made = 0
        at_markers: dict[int, set[tuple[int, ...]]] = {}
        at_peaks: dict[tuple[Span, int], list[int]] = {}
        # The snapshots still open to retroactive moves: (span, seq) -> the category of each storage made in the
        # span before seq and live at it.
        open_: dict[tuple[Span, int], dict[int, int]] = {}
        by_seq: dict[int, list[Span]] = {}
        for span, seqs in wanted.items():
            for seq in seqs:
                if seq != span[0]:
                    by_seq.setdefault(seq, []).append(span)
        s = 0

        def held(key: int, sign: int) -> None:
            nonlocal unknown
            if cat_of[key] < 0:
                unknown += sign
            else:
                counts[cat_of[key]] += sign * sizes[key]

        def after(seq: int) -> None:  # the moves and the moments that fall after event ``seq``, in order
            nonlocal s
            while s < len(self.side) and self.side[s][1] <= seq:
                kind, at, a, b, retro = self.side[s]
                s += 1
                if kind == "m":
                    if not unknown:
                        at_markers.setdefault(at, set()).add(tuple(counts))
                    # A span ends at an end marker at its end seq, not at another moment's marker there (its
                    # own peak's, with the retroactive moves that follow it).
                    for snap in [snap for snap in open_ if b == 2 and snap[0][2] <= at]:
                        del open_[snap]
                elif a in sizes:
                    if retro:
                        for (span, _seq), cats in open_.items():
                            if a in cats and cats[a] >= 0 and b >= 0 and (span, _seq) in at_peaks:
                                at_peaks[(span, _seq)][cats[a]] -= sizes[a]
                                at_peaks[(span, _seq)][b] += sizes[a]
                                cats[a] = b
                    held(a, -1)
                    cat_of[a] = b
                    held(a, 1)

        after(0)
        for seq, key, nbytes in self.events:
            if key in sizes:
                held(key, -1)
                del sizes[key]
                if nbytes == FREE:
                    del cat_of[key]
                    made_at.pop(key, None)
            elif nbytes != FREE:
                if made >= len(self.cats):
                    return "the extended stream's categories do not pair up with its storages"
                cat_of[key], made_at[key] = self.cats[made], seq
                made += 1
            if nbytes != FREE:
                sizes[key] = self._size(nbytes)
                held(key, 1)
            for span in by_seq.get(seq, ()):
                if not unknown:
                    at_peaks[(span, seq)] = list(counts)
                open_[(span, seq)] = {k: cat_of[k] for k, at in made_at.items() if span[0] < at <= seq}
            after(seq)
        return at_markers, {snap: tuple(c) for snap, c in at_peaks.items()}


def _with_peaks(est: "Estimate", moved: Mapping[tuple[int, int], tuple[int, Breakdown]]) -> "Estimate":
    """``est`` with the records of ``moved`` ((step index, position) -> (seq, breakdown)) peaking there."""
    steps = []
    for step in est.trace.steps:
        phases = []
        for i, rec in enumerate(step.phases):
            new = moved.get((step.index, i))
            phases.append(rec if new is None else dataclasses.replace(rec, peak=new[1], tags_peak=()))
        steps.append(dataclasses.replace(step, phases=tuple(phases)))
    return dataclasses.replace(est, trace=dataclasses.replace(est.trace, steps=tuple(steps)))


def _stream_with_peaks(recorded: "RecordedStream", placed: Mapping[tuple[int, int], Span],
                       moved: Mapping[tuple[int, int], tuple[int, Breakdown]]) -> "RecordedStream":
    """``recorded`` with the peak seq of each moved record's moment where the record now peaks."""
    to = {placed[where]: seq for where, (seq, _b) in moved.items()}
    moments = tuple((step, start, to.get((start, peak, end), peak), end) for step, start, peak, end in recorded.moments)
    return dataclasses.replace(recorded, moments=moments)
