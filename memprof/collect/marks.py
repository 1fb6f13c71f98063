"""Marks on a ledger's record that are not events: the global peak saved and put back around steps that must
not count, and where each phase lies in the allocation stream when the stream is kept.

They run once per phase or per window, never per op, so they live beside the ledger's hot path
(:meth:`Ledger.add <memprof.collect.ledger.Ledger.add>`, :meth:`~memprof.collect.ledger.Ledger.settle`) rather
than in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .ledger import Ledger

__all__ = ["PeakState", "record_stream", "mark_end", "note_moment", "restart_peak", "peak_state", "restore_peak"]


class PeakState(NamedTuple):
    """The ledger's global peak at one moment: its total, by category, by tag, where (seq, phase, module)."""

    total: int
    by_category: list[int]
    tags: list[int]
    seq: int
    phase_serial: int
    module: int


def record_stream(ledger: "Ledger") -> None:
    """Keep the allocation stream from now on (``ledger.stream``, ``ledger.moments``): what a model of a
    device's allocator replays. Off by default, since a long run's stream grows with every op."""
    if ledger.stream is None:
        ledger.stream, ledger.moments = [], []


def mark_end(ledger: "Ledger") -> list[int]:
    """The totals now, as a merged decode phase's end (the stream notes where)."""
    ledger.settle()
    ledger.mark_seq = ledger.seq
    return ledger.totals.copy()


def note_moment(ledger: "Ledger", step: int, *, marked: bool = False) -> None:
    """A phase of ``step`` closes: where its start, peak and end are in the stream (its end at the last
    :func:`mark_end` when ``marked``), while the stream is kept."""
    if ledger.moments is not None:
        end = ledger.mark_seq if marked else ledger.seq
        ledger.moments.append((step, ledger.phase_start_seq, ledger.phase_peak_seq, end))


def restart_peak(ledger: "Ledger") -> None:
    """The global peak starts over from the current phase's (a simulated rank resizes what the profiler
    registered before its run begins)."""
    ledger.peak_total, ledger.peak, ledger.peak_seq = (ledger.phase_peak_total, ledger.phase_peak.copy(),
                                                       ledger.phase_peak_seq)
    ledger.peak_phase_serial, ledger.peak_module, ledger.peak_tags = (ledger.phase_serial, -1,
                                                                      ledger.phase_peak_tags)


def peak_state(ledger: "Ledger") -> PeakState:
    """The global peak as it stands (to restore after steps that must not count, a schedule's warmup)."""
    ledger.settle()
    return PeakState(ledger.peak_total, ledger.peak.copy(), ledger.peak_tags, ledger.peak_seq,
                     ledger.peak_phase_serial, ledger.peak_module)


def restore_peak(ledger: "Ledger", state: PeakState) -> None:
    """Put back the global peak :func:`peak_state` returned."""
    ledger.peak_total, ledger.peak_tags, ledger.peak_seq = state.total, state.tags, state.seq
    ledger.peak_phase_serial, ledger.peak_module = state.phase_serial, state.module
    ledger.peak = state.by_category.copy()
