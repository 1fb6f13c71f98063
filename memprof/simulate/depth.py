"""Deep models in seconds: ``estimate(..., extrapolate=3)`` simulates the repeated stack cut short and extrapolates.

A transformer's memory is affine in its depth once the peak stays in the same place: each block adds the same
weights, gradients, optimizer states, saved activations and collective buffers, at every phase's start, peak and
end. So memprof simulates the model with its repeated stack (the container with the most children of one class:
``model.layers``) cut to ``k``, ``k + 1`` and ``k + 2`` blocks (per pipeline stage under ``pipeline=``), checks
that every category of every phase record grew by the same bytes from ``k`` to ``k + 1`` as from ``k + 1`` to
``k + 2``, and extends that line to the model's depth: ``x(L) = x(k + 2) + (L - k - 2) * (x(k + 2) - x(k + 1))``,
exact when the check holds. When it does not (the peak moves between phases as blocks are added: below about
3 blocks a large head's gradients can hold it), the whole model is simulated instead and the notes say why.
Other figures that grow by the same bytes per block (parameter counts, and the formulas the reconciliation holds
the figures against: the per-module rules' activations, the optimizer's states and temporaries) are extended the
same way; per-module tables stay the cut model's.

A CUDA target's device-level figures are not lines in depth: the caching allocator's cache moves in whole
segments (2 MiB and 20 MiB, ``c10/cuda/CUDACachingAllocator.cpp``), so the three replays can grow by uneven bytes
per block while every tensor category grows evenly, and no rule read off three cuts bounds the whole model's
replay from above (the reserved peak of a stack of 21 MLP blocks of width 512 came out 1.9 % under the whole
model's when extended by the larger of its growths per block). So the check covers the tensor categories, and the
device-level figures are the replay of the whole model's allocation stream, itself extended from the cuts'
(:mod:`memprof.simulate.depth_stream`). On every target the extended stream checks the extended figures: at every
phase's start, peak and end, and no moment of a phase above its peak (where one is, at full depth that phase peaks
at another moment than the cuts', and its record is taken from the stream: :mod:`memprof.simulate.stream_peaks`).
Where the stream does not extend or does not hold, the whole model is simulated.
"""

from __future__ import annotations

import dataclasses
import numbers
from functools import partial
from typing import TYPE_CHECKING, Callable, cast

import torch
from torch import nn

from ..errors import InvalidArgumentError, is_interrupt
from ..record.estimate import Estimate
from ..record.parts import Breakdown
from ..vocabulary import DEVICE_CATEGORIES, TENSOR_CATEGORIES, Category
from .depth_blocks import alike, find_stack
from .depth_formulas import extended_formulas
from .depth_stream import HELD, Extension, bent, corrected, extended_stream
from .held_signals import deepcopy_held
from .stream_peaks import peaks_move, phase_peaks

if TYPE_CHECKING:
    from ..collect.simulated import RecordedStream
    from ..record.parts import PhaseRecord
    from .aliases import Figure
    from .run import OptimizerArg

__all__ = ["find_stack", "extrapolated", "Replay", "Kept"]

#: The device replay of a run, to run on a stream like the one it recorded (``stages.replayed``).
Replay = Callable[[Estimate, "RecordedStream"], Estimate]
#: What each cut's run leaves for :func:`extrapolated` on a CUDA target: its recorded stream and its replay.
Kept = list[tuple["RecordedStream", Replay]]

#: What the note of a stack whose blocks are not alike says (``stages`` remembers no such refusal: it is seen
#: again at each call).
NOT_ALIKE = "since its blocks are not alike"

#: The default (``extrapolate=None``): the stack cut to 2, 3 and 4 units of blocks, where it has this many units or
#: more (below, three cuts cost about as much as the whole: the model is simulated whole).
AUTO_K, AUTO_UNITS = 2, 16


def extrapolated(model: nn.Module, optimizer: "OptimizerArg", k: object, per_unit: int,
                 run: Callable[..., Estimate], auto: bool = False,
                 uneven: "Callable[[list[nn.Module]], str | None] | None" = None) -> Estimate:
    """The estimate of ``model`` from three simulations of it cut to ``k``, ``k + 1``, ``k + 2`` units of depth
    (``per_unit`` blocks each: the pipeline's stages per rank), or of the whole model when the figures are not
    affine. ``run(model, optimizer, kept=None)`` simulates one model; with ``kept`` (a list) its replay is left to
    the caller: the run appends its recorded stream and the replay (``stages.one_rank``; on a target other than
    CUDA one that adds nothing). The cuts' streams are extended whatever the target: on every target the extended
    stream must hold the extended figures and no moment of a phase above its peak (a peak that moves within a phase
    at full depth, which the cuts' line does not see), else the whole model is simulated.

    With ``auto`` (the default path, ``extrapolate=None``) a model with no repeated stack, or one of fewer than
    :data:`AUTO_UNITS` units, is simulated whole, silently; a unit is one period of the stack's kinds of block (a
    hybrid model's sliding-window and full-attention layers: :func:`memprof.simulate.depth_blocks.period`), and a
    cut that fails to simulate is no error: the whole model is simulated instead (its own error is the one raised,
    if it has one). A stack whose blocks are not alike (:func:`memprof.simulate.depth_blocks.alike`) is simulated
    whole, with a note, on either path, and so is one that ``uneven`` (given the stack's first unit of blocks) says
    is no line in depth for the run (a ZeRO rank's flat shard: :func:`memprof.simulate.ranks.uneven_shard`)."""
    found = find_stack(model)
    unlike: "str | None" = None
    if auto:
        if found is None:
            return run(model, optimizer)
        p, unlike = alike(model, found[0])
        unit = per_unit * p
        if found[1] % unit or found[1] // unit < AUTO_UNITS:
            if unlike is None or found[1] // per_unit < AUTO_UNITS:
                return run(model, optimizer)
            return _whole(run, model, optimizer, _unlike_note(found, unlike))  # deep enough, but unlike
        per_unit, k = unit, AUTO_K
    elif found is not None:
        unlike = alike(model, found[0])[1]
    name, depth, kind = _stack(model, found, k, per_unit)
    units, k = depth // per_unit, int(cast(int, k))
    why = None if uneven is None else uneven(list((model.get_submodule(name) if name else model).children())[:per_unit])
    whole = _why_whole(name, depth, kind, units, k, unlike, why)
    if whole is not None:
        return _whole(run, model, optimizer, whole)
    kept: Kept = []
    cut = partial(_cuts, model, optimizer, name, per_unit=per_unit, units=units, run=run, kept=kept, auto=auto)
    failed = None
    try:
        ests, k, stream, extension, reason = _settled(cut, kept, units, k, auto)
    except Exception as exc:
        if not auto or is_interrupt(exc):
            raise
        failed = type(exc).__name__
    if failed is not None:
        # Outside the handler: where the whole model fails too (an input no depth runs), its error is the one the
        # user sees, not chained to the cut's copy of it.
        return _whole(run, model, optimizer, f"depth: {name or 'the model'} ({depth} x {kind}) was simulated whole, "
                      f"since a model cut short of it failed ({failed})")
    where = f"{name or 'the model'} ({depth} x {kind})"
    if reason is not None:
        return _whole(run, model, optimizer, f"depth: {where} was simulated whole, since its figures were not affine "
                      f"in depth from {k} blocks per stage on ({reason})")
    out: Estimate = _affine(ests[0], ests[1], ests[2], units - k - 2, strict=False)
    notes = [_extended_note(where, k, units)]
    if stream is None:
        out, moved = _peak_moved(out)
        if moved and out.device_peak_bytes is not None:
            return _whole(run, model, optimizer, f"depth: {where} was simulated whole, since {_OFFLOAD_MOVED}")
        notes.extend([moved] if moved else [])
    else:
        assert extension is not None
        made = _on_stream(out, stream, extension, kept, units, k)
        if isinstance(made, str):
            return _whole(run, model, optimizer, f"depth: {where} was simulated whole, since {made}")
        out, on_stream = made
        notes.extend(on_stream)
    out, inside = _peak_in_a_block(out, kind)
    remade = _stats_of_records(out)
    if isinstance(remade, str):
        return _whole(run, model, optimizer, f"depth: {where} was simulated whole, since {remade}")
    remade, formulas = extended_formulas(remade, ests, units - k - 2)
    return dataclasses.replace(remade, notes=(*_offload_notes(remade), *notes, *([inside] if inside else []),
                                              *([formulas] if formulas else [])))


def _offload_notes(est: Estimate) -> "list[str]":
    """``est``'s notes, CPUOffloadPolicy's split (:func:`memprof.simulate.parallel.offload_note`) said with the
    figures extended to full depth: the largest cut's note gave that cut's host memory and device peak."""
    from .parallel import OFFLOAD_NOTE, offload_note

    if est.host_bytes is None or est.device_peak_bytes is None:
        return list(est.notes)
    said = offload_note(est.host_bytes, est.device_peak_bytes, None)
    return [said if n.startswith(OFFLOAD_NOTE) else n for n in est.notes]


def _stack(model: nn.Module, found: "tuple[str, int, str] | None", k: object, per_unit: int
           ) -> "tuple[str, int, str]":
    """The model's repeated stack (``found``: :func:`find_stack`'s), once ``k`` and the stack are checked: a
    refusal names what ``extrapolate=`` needs."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise InvalidArgumentError(f"extrapolate must be a positive int (blocks per stage to simulate), got {k!r}")
    if found is None:
        raise InvalidArgumentError("extrapolate= needs a repeated stack of blocks (a ModuleList or Sequential of "
                                   f"one class) in {type(model).__name__}, and found none")
    name, depth, _kind = found
    if depth % per_unit:
        raise InvalidArgumentError(f"{name} has {depth} blocks, which the pipeline's {per_unit} stages do not divide")
    return found


def _why_whole(name: str, depth: int, kind: str, units: int, k: int, unlike: "str | None",
               uneven: "str | None") -> "str | None":
    """The note of a model the cuts cannot stand for, simulated whole before any cut: blocks not alike (``unlike``
    says why, :func:`memprof.simulate.depth_blocks.alike`), figures of the run that are no line in depth
    (``uneven`` says why), or no block left to extend by; None where the cuts can."""
    if unlike is not None:
        return _unlike_note((name, depth, kind), unlike)
    if uneven is not None:
        return f"depth: {name or 'the model'} ({depth} x {kind}) was simulated whole, since {uneven}"
    if units <= k + 2:  # nothing left to extend: the whole model, and a note saying extrapolate= changed nothing
        return (f"depth: extrapolate={k} cuts {name or 'the model'} to {k}, {k + 1} and {k + 2} blocks per stage, "
                f"but it has {units}: it was simulated whole (give a smaller k to extrapolate)")
    return None


def _unlike_note(found: "tuple[str, int, str]", unlike: str) -> str:
    """The note of a stack whose blocks are not alike (:func:`memprof.simulate.depth_blocks.alike`)."""
    name, depth, kind = found
    return (f"depth: {name or 'the model'} ({depth} x {kind}) was simulated whole, {NOT_ALIKE} "
            f"({unlike}): the cuts keep the first blocks, and a line through them stands for the others only where "
            "each is like them")


def _extended_note(where: str, k: int, units: int) -> str:
    """The note of an estimate extended from the cuts to ``k``, ``k + 1`` and ``k + 2`` blocks per stage."""
    return (f"depth: simulated with {where} cut to {k}, {k + 1} and {k + 2} blocks per stage; every category at "
            "every phase's start, peak and end grew by the same bytes per block, so the figures are extended to "
            f"{units} per stage: x({units}) = x({k + 2}) + {units - k - 2} x (x({k + 2}) - x({k + 1})), exact while "
            "the peak stays where it is; so are the formulas (the per-module rules' activations, the optimizer's "
            f"states and temporaries); the per-module tables are the cut model's ({k + 2} blocks per stage, not "
            f"{units}), and so is what is read off them or counts the calls: the advice on checkpointing the "
            "blocks, the notes that count kernels, router calls or units gathered")


def _on_stream(out: Estimate, stream: "RecordedStream", extension: Extension, kept: Kept, units: int, k: int
               ) -> "tuple[Estimate, list[str]] | str":
    """``out`` (extended in a line) held to the whole model's ``stream`` extended from the cuts': corrected where
    the line missed bytes, each phase's peak where the stream has it, and replayed (``kept[2]``'s replay, which on a
    target other than CUDA adds nothing); with the notes. A str saying why not: the caller simulates the whole
    model."""
    notes = [_stream_note(out.device == "cuda", k, units)]
    fixed = corrected(out, stream, extension.missed)
    if isinstance(fixed, str):
        return fixed
    if peaks_move(fixed, stream):  # a phase's peak is another moment at full depth: its composition is needed
        peaks = _moved_peaks(out, kept, units, k)
        if isinstance(peaks, str):
            return peaks
        fixed, stream, moved_peaks = peaks
        notes.extend(moved_peaks)
    fixed, moved = _peak_moved(fixed)
    if moved and fixed.device_peak_bytes is not None:
        return _OFFLOAD_MOVED
    notes.extend([moved] if moved else [])
    made = _replayed(fixed, stream, kept[2][1])  # an Estimate, or a str saying why the stream does not hold
    return made if isinstance(made, str) else (made, notes)


def _moved_peaks(out: Estimate, kept: Kept, units: int, k: int
                 ) -> "tuple[Estimate, RecordedStream, list[str]] | str":
    """``out`` (extended in a line) corrected by the cuts' streams extended again with their moves, each phase's peak
    where the whole model's stream has it (:func:`phase_peaks`), the stream, and the notes; or why not."""
    made = extended_stream([recorded for recorded, _replay in kept], units - k - 2,
                           max(1, out.trace.device.rounding or 1), moves=True)
    if isinstance(made, str):
        return (f"a phase's peak is another moment at full depth, and with the moves of its storages between "
                f"categories the cuts' streams do not extend ({made})")
    stream, extension = made
    fixed = corrected(out, stream, extension.missed)
    return fixed if isinstance(fixed, str) else phase_peaks(fixed, stream, extension)


def _stream_note(cuda: bool, k: int, units: int) -> str:
    """What the extended allocation stream gave an estimate: a CUDA target's device-level figures; any target's
    check that no moment of a phase holds more than the phase's extended peak."""
    how = (f"the cuts' extended: each run of events a block added from {k} to {k + 1} blocks per stage, added again, "
           f"gave the stream of {k + 2} exactly, so it is added {units - k - 2} times more")
    if cuda:
        return f"depth: the device-level figures are the allocator replay of the whole model's allocation stream, {how}"
    return (f"depth: the whole model's allocation stream, {how}, holds the extended figures at every phase's start, "
            "peak and end, and no moment of a phase above its peak")


def _tensors_total(b: Breakdown) -> Breakdown:
    """``b`` with the total of its measured tensor categories as its total: what the per-phase statistics' total
    series counts, as the ledger keeps it (a phase record's total also holds the device-level figures the replay
    added). A category not measured (a ZeRO-1/2 rank's communication: DeepSpeed's buckets are not estimated) is not
    in it, as :meth:`Breakdown.from_mapping` sums; None where no tensor category is measured."""
    measured = [v for v in b.counts[:len(TENSOR_CATEGORIES)] if v is not None]
    return Breakdown(b.counts, sum(measured) if measured else None)


def _stats_of_records(est: Estimate) -> "Estimate | str":
    """``est`` with each per-phase statistic made again from the phase records it counts. Extended in a line, a
    series that does not grow alike in the cuts (a total with the allocator's cache in it) stayed the largest
    cut's: a 48-layer Qwen3 stage's "other" phase held a total of 985,088 B where the whole stage's holds
    5,357,568 B, below its own weights. The records are the extended figures (and the replay's): a str where a
    statistic counts steps the trace keeps no record of, which then cannot be made."""
    from ..record.stats import series_from

    trace = est.trace
    stats = []
    for st in trace.phase_stats:
        records = [rec for step in trace.steps for rec in step.phases
                   if (rec.phase, rec.occurrence) == (st.phase, st.occurrence)]
        if len(records) != st.count:
            return "a per-phase statistic counts steps the extended record keeps no detail of"
        peak = series_from(st.peak, [_tensors_total(r.peak) for r in records])
        end = series_from(st.end, [_tensors_total(r.end) for r in records])
        if peak is None or end is None:
            return "the per-phase statistics count figures the extended records do not hold"
        stats.append(dataclasses.replace(st, peak=peak, end=end))
    return dataclasses.replace(est, trace=dataclasses.replace(trace, phase_stats=tuple(stats)))


def _peak_in_a_block(est: Estimate, kind: str) -> "tuple[Estimate, str | None]":
    """``est`` without a module at the peak where the cut model's is inside one of its blocks (of class ``kind``):
    the cut's block is not the whole model's that peaks (the last of 5 blocks is not the last of 8), and which one
    is, the cuts do not say. A module outside the blocks (the head, the embedding) is the whole model's."""
    at = est.trace.peak_module
    if at is None:
        return est, None
    blocks = [m.path for m in est.trace.modules if m.type.endswith(kind)]  # FSDP2's class is FSDP<kind>
    if not any(at == b or at.startswith(b + ".") for b in blocks):
        return est, None
    note = (f"depth: the module at the peak is not known from the cuts: it is in a block of the cut model ({at}), "
            "and which of the whole model's blocks holds the peak the cuts do not say")
    return dataclasses.replace(est, trace=dataclasses.replace(est.trace, peak_module=None)), note


def _stream(ests: "list[Estimate]", kept: Kept, units: int, k: int, reason: "str | None"
            ) -> "tuple[RecordedStream | None, Extension | None, str | None]":
    """Where the cuts' figures are affine (``reason`` None), the whole model's stream extended from the cuts'
    (:func:`extended_stream`) and what it holds beside its events; else (None, None, the reason). On every target:
    one with no replay (not CUDA) needs the stream to check the figures, and a line it cannot check can miss a
    phase's peak (a CPU target's first pipeline stage over short sequences: each forward's peak record short)."""
    if reason is not None or not kept:
        return None, None, reason
    made = extended_stream([recorded for recorded, _replay in kept], units - k - 2,
                           max(1, ests[2].trace.device.rounding or 1))
    if isinstance(made, str):
        return None, None, made
    return made[0], made[1], None


def _settled(cut: "Callable[..., tuple[list[Estimate], int, str | None]]", kept: Kept, units: int, k: int,
             auto: bool) -> "tuple[list[Estimate], int, RecordedStream | None, Extension | None, str | None]":
    """The cuts from ``k`` (:func:`_cuts`), the whole model's stream extended from theirs and why not (None: both
    hold), taken again with more blocks where the first do not settle (with ``auto``)."""
    ests, k, reason = cut(k)
    stream, extension, reason = _stream(ests, kept, units, k, reason)
    # Figures or a stream that the first cuts do not make regular settle with more blocks, as the peak does (the
    # blocks next to the embeddings or the head behave apart while there are few others: FSDP's prefetching; the
    # backward's first block frees the logits' gradient where the others free the previous block's gathered
    # parameters, and with one other block the tokens' alignment took the wrong one): the two larger cuts and the
    # next, within the same bound. Once for a stream (one that needed it settled there; one that does not settle, a
    # pipeline stage's stream under 1F1B, costs one cut more before the whole model); twice for figures, whose
    # phase's peak can move within the phase twice: GPT-2 XL on an FSDP rank peaks in backward at its end (the
    # gradients, the logits' temporaries) with 2 and 3 blocks, at its start (the activations) from 4 on.
    figures = reason
    tries = 0
    while (auto and reason is not None and stream is None and reason != HELD and k < AUTO_K + 2
           and units > k + 3 and (tries == 0 or figures is not None)):
        ests, k, figures = cut(k, ests)
        stream, extension, reason = _stream(ests, kept, units, k, figures)
        tries += 1
    return ests, k, stream, extension, reason


def _cuts(model: nn.Module, optimizer: "OptimizerArg", name: str, k: int, ests: "list[Estimate] | None" = None, *,
          per_unit: int, units: int, run: Callable[..., Estimate], kept: Kept,
          auto: bool) -> tuple[list[Estimate], int, "str | None"]:
    """The three cuts simulated, the ``k`` they start at and why their figures are not affine (None: they are).
    Where the peak moved between them and every record is affine, the cuts are taken at one record
    (:func:`_one_record`); with ``auto``, where the peak moved and a record is not affine, the two larger and the
    next, twice at most: the figures settle as blocks are added. ``kept`` holds the three cuts' streams. Given
    ``ests`` (the cuts from ``k``), the two larger and the next are taken first."""

    def one_more(ests: "list[Estimate]", k: int) -> "tuple[list[Estimate], int]":
        ests = [*ests[1:], run(*_cut(model, optimizer, name, (k + 3) * per_unit), kept)]
        del kept[:-3]
        return ests, k + 1

    if ests is None:
        ests = [run(*_cut(model, optimizer, name, (k + i) * per_unit), kept) for i in range(3)]
    else:
        ests, k = one_more(ests, k)
    ests, reason = _one_record(ests, kept)
    while auto and reason is not None and reason.startswith("the peak moved") and k < AUTO_K + 2 and units > k + 3:
        ests, k = one_more(ests, k)
        ests, reason = _one_record(ests, kept)
    return ests, k, reason


def _one_record(ests: "list[Estimate]", kept: Kept) -> "tuple[list[Estimate], str | None]":
    """The cuts and why their figures are not affine (None: they are), the cut to ``k``'s figures straightened
    where the allocator's rounding of a storage that grows with the blocks bends them (:func:`_straightened`), and
    where the peak moved between them taken at the phase record where the largest cut has it
    (:func:`_at_record`) when every record is affine: each record's figures then extend in a line of their own,
    exact at full depth, and the whole model's peak is the largest of them (:func:`_peak_moved`, and the stream's
    check of every moment). A peak that moves between records is two lines crossing (the optimizer step's, flat
    in depth at a small batch, against a checkpointed forward's: Llama-3-8B's moves from a forward of 4 layers to
    the optimizer step of 5 and 6 under ZeRO-1 at one sample), which three cuts see whole where the lines of their
    records hold."""
    reason = _not_affine(ests)
    if reason is not None:
        straight = _straightened(ests, kept)
        again = None if straight is None else _not_affine(straight)
        if straight is not None and (again is None or again.startswith("the peak moved")):
            ests, reason = straight, again
    if reason is None or not reason.startswith("the peak moved"):
        return ests, reason
    moved = [_at_record(e, ests[2]) for e in ests]
    if any(e is None for e in moved):
        return ests, reason
    settled = cast("list[Estimate]", moved)
    return (settled, None) if _not_affine(settled) is None else (ests, reason)


def _straightened(ests: "list[Estimate]", kept: Kept) -> "list[Estimate] | None":
    """The cuts with the cut to ``k``'s figures less what the allocator's rounding of the storages that grow with
    the blocks bends them from the line through the two larger cuts (:func:`~memprof.simulate.depth_stream.bent`):
    a flat buffer of ``d`` bytes a block, not a multiple of 512 (a rank's ZeRO shard of a model with biases, a
    bucket of every gradient), is rounded to ``rounding(x + n d)``, no line in ``n``, so the three cuts' figures are
    not one though every other storage's are. What the line misses at full depth the extended stream adds
    (:func:`~memprof.simulate.depth_stream.corrected`). None where nothing bends them, or the streams do not say."""
    rounding = max(1, ests[2].trace.device.rounding or 1)
    if rounding == 1 or len(kept) != 3:
        return None
    made = bent([recorded for recorded, _replay in kept], rounding)
    if isinstance(made, str) or not any(n for by in made[1].values() for n in by.values()):
        return None
    stream, missed = made
    fixed = corrected(ests[0], stream, {seq: {cat: -n for cat, n in by.items()} for seq, by in missed.items()})
    return None if isinstance(fixed, str) else [fixed, ests[1], ests[2]]


def _at_record(est: Estimate, largest: Estimate) -> "Estimate | None":
    """``est`` with its peak taken at the phase record where ``largest`` (a cut with more blocks) has its peak: the
    record's peak, step, phase and tags, the module at it not known; None where the two runs' records do not
    correspond one to one (the steps' phases differ), or where ``est`` holds a figure read off its own peak
    (CPUOffloadPolicy's device peak)."""
    if est.device_peak_bytes is not None:
        return None  # read off the cut's own peak (CPUOffloadPolicy's split), which a record's figures do not give
    records, theirs = est.trace.phases, largest.trace.phases
    at = largest.trace.peak_record()
    if at is None or len(records) != len(theirs) or any(
            (r.step, r.phase, r.occurrence) != (t.step, t.phase, t.occurrence) for r, t in zip(records, theirs)):
        return None
    rec = records[theirs.index(at)]
    if (rec.step, rec.phase, rec.peak) == (est.trace.peak_step, est.trace.peak_phase, est.trace.peak):
        return est
    trace = dataclasses.replace(est.trace, peak=rec.peak, peak_step=rec.step, peak_phase=rec.phase,
                                peak_tags=rec.tags_peak, peak_module=None)
    return dataclasses.replace(est, trace=trace)


def _whole(run: Callable[..., Estimate], model: nn.Module, optimizer: "OptimizerArg", note: str) -> Estimate:
    """The whole model simulated, with ``note`` saying why."""
    est = run(model, optimizer)
    return dataclasses.replace(est, notes=(*est.notes, note))


#: Why a run under CPUOffloadPolicy whose peak is another moment at full depth is simulated whole.
_OFFLOAD_MOVED = ("its device peak under CPUOffloadPolicy is read off the peak's composition, and at full depth the "
                  "peak is another moment than the cuts'")


def _peak_moved(est: Estimate) -> "tuple[Estimate, str | None]":
    """``est`` with its peak where the extended figures put it: the first phase record whose peak holds the most
    tensor bytes, as the ledger keeps the first moment of the largest total. The cuts can have it elsewhere (their
    optimizer step's, which the whole model's forward outgrows); then the run's peak is that record's (its
    breakdown, step, phase and tags) and the module at the peak is not known: the cuts' is another moment's."""
    trace = est.trace

    best: "PhaseRecord | None" = None
    for step in trace.steps:
        for rec in step.phases:
            if best is None or rec.peak.tensor_bytes > best.peak.tensor_bytes:
                best = rec
    # A record as large as the peak's and earlier holds it: the ledger keeps the first moment of the largest total.
    if best is None or (best.step, best.phase, best.peak) == (trace.peak_step, trace.peak_phase, trace.peak) \
            or best.peak.tensor_bytes < trace.peak.tensor_bytes:
        return est, None
    if (best.step, best.phase) == (trace.peak_step, trace.peak_phase):
        note = (f"depth: at full depth the peak is another moment of step {best.step} {_v(best.phase)} than the "
                "cuts' (the extended stream's); the module at the peak is not known from the cuts")
    else:
        note = (f"depth: at full depth the peak is step {best.step} {_v(best.phase)}'s, where the cuts had it at "
                f"step {trace.peak_step} {_v(trace.peak_phase)}; the module at the peak is not known from the cuts")
    moved = dataclasses.replace(trace, peak=best.peak, peak_step=best.step, peak_phase=best.phase,
                                peak_tags=best.tags_peak, peak_module=None)
    return dataclasses.replace(est, trace=moved), note


def _replayed(est: Estimate, stream: "RecordedStream", replay: Replay) -> "Estimate | str":
    """``est`` (extended) with the replay of the extended ``stream``, checked against its figures first: the
    tensors' bytes the stream holds at every phase's start, peak and end must be the extended record's, else a
    sentence saying where they are not."""
    from .device_memory import stream_holds

    trace = est.trace
    if not any((rec.step, rec.phase, rec.peak) == (trace.peak_step, trace.peak_phase, trace.peak)
               for rec in trace.phases):
        return "no phase record holds the run's peak, where the replay would look for it"
    wrong = stream_holds(trace, stream)
    if wrong is not None:
        return f"the extended allocation stream does not hold the extended figures ({wrong})"
    return replay(est, stream)


def _cut(model: nn.Module, optimizer: "OptimizerArg", name: str, n: int) -> "tuple[nn.Module, OptimizerArg]":
    """A meta copy of ``model`` with its stack cut to ``n`` blocks, and the optimizer on it."""
    memo: dict[int, object] = {}
    twins: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        if id(p) not in memo:
            twins[id(p)] = memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    for block in list((model.get_submodule(name) if name else model).children())[n:]:
        memo[id(block)] = None  # the blocks cut off are not copied (only to be deleted): a deep model's copy is slow
    clone = deepcopy_held(model, memo)  # a Ctrl-C in it could be dropped (held_signals)
    # find_stack named a ModuleList or Sequential (both cut with del); nn.Module's type has no __delitem__.
    stack = cast("nn.ModuleList | nn.Sequential", clone.get_submodule(name) if name else clone)
    del stack[n:]
    if not isinstance(optimizer, torch.optim.Optimizer):
        return clone, optimizer
    kept = {id(p) for p in clone.parameters()}
    groups = []
    for g in optimizer.param_groups:
        params = [twins[id(p)] for p in g["params"] if id(p) in twins and id(twins[id(p)]) in kept]
        groups.append({**{key: v for key, v in g.items() if key != "params"}, "params": params})
    # The optimizer's own class, built as a user builds it: its constructor (not Optimizer's) gives the defaults.
    rebuilt: Callable[..., torch.optim.Optimizer] = type(optimizer)
    return clone, rebuilt([g for g in groups if g["params"]])


def _not_affine(ests: "list[Estimate]") -> "str | None":
    a, b, c = (e.trace for e in ests)
    if not (a.peak_step == b.peak_step == c.peak_step and a.peak_phase == b.peak_phase == c.peak_phase):
        return f"the peak moved: step {a.peak_step} {_v(a.peak_phase)}, then {b.peak_step} {_v(b.peak_phase)}, then " \
               f"{c.peak_step} {_v(c.peak_phase)}"
    try:
        _affine(a.steps, b.steps, c.steps, 1, strict=True)
        _affine(a.peak, b.peak, c.peak, 1, strict=True)
        ranks = [tuple(r.peak_bytes for r in e.ranks) for e in ests]
        _affine(ranks[0], ranks[1], ranks[2], 1, strict=True)
        # Under CPUOffloadPolicy the device peak is read off each cut's peak (ParallelRun.host_split): extended in a
        # line only where it is one, never kept at the largest cut's by the figures' lenient extension.
        offload = [e.device_peak_bytes for e in ests]
        _affine(offload[0], offload[1], offload[2], 1, strict=True)
    except _NotAffine as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return str(exc)
    if ests[2].ranks:  # the worst rank class must stay the worst at full depth
        worst = [_worst_rank(e) for e in ests]
        if len(set(worst)) != 1:
            return "the worst pipeline rank changed with depth"
    return None


def _v(phase: object) -> str:
    return getattr(phase, "value", str(phase))


class _NotAffine(Exception):
    pass


#: Where the device-level categories sit in a Breakdown's counts (not extended: see the module's docstring).
_DEVICE = frozenset(tuple(Category).index(c) for c in DEVICE_CATEGORIES)


def _worst_rank(est: Estimate) -> int:
    """The index of ``est``'s rank class with the highest peak (the first of equals)."""
    peaks = [r.peak_bytes for r in est.ranks]
    return max(range(len(peaks)), key=peaks.__getitem__)


def _affine(a: "Figure", b: "Figure", c: "Figure", more: int, strict: bool) -> "Figure":
    """``c`` extended by ``more`` steps of its difference from ``b``, wherever ``b - a == c - b``; elsewhere (with
    ``strict`` False) ``c`` as it is. Breakdowns are always strict in their tensor categories; their device-level
    figures (the allocator replay's) are not measured at full depth."""
    if isinstance(c, bool) or c is None:
        return c
    if isinstance(c, Breakdown) and isinstance(a, Breakdown) and isinstance(b, Breakdown):
        counts = tuple(None if i in _DEVICE else _affine(x, y, z, more, True)
                       for i, (x, y, z) in enumerate(zip(a.counts, b.counts, c.counts)))
        if c.total is not None and c.total == sum(v for v in c.counts if v is not None):
            total: "int | None" = sum(v for v in counts if v is not None)
        else:
            total = _affine(a.total, b.total, c.total, more, True)
        return Breakdown(counts, total)
    if isinstance(c, int) and isinstance(a, int) and isinstance(b, int):
        if b - a == c - b:
            return c + more * (c - b)
        if strict:
            raise _NotAffine(f"{a:,}, {b:,}, {c:,} bytes grow unevenly")
        return c
    if isinstance(c, tuple) and isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == len(c):
        out = tuple(_affine(x, y, z, more, strict) for x, y, z in zip(a, b, c))
        return type(c)(*out) if hasattr(c, "_fields") else out  # a named tuple (a Stat) stays one
    if dataclasses.is_dataclass(c) and not isinstance(c, type) and type(a) is type(b) is type(c):
        changes = {}
        for f in dataclasses.fields(c):
            if not f.init:
                continue
            x, y, z = getattr(a, f.name), getattr(b, f.name), getattr(c, f.name)
            new = _affine(x, y, z, more, strict)
            if new is not z:
                changes[f.name] = new
        return dataclasses.replace(c, **changes) if changes else c
    if strict and isinstance(c, tuple):
        raise _NotAffine("the phases differ in number")
    return c
