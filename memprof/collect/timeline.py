"""The timeline: the ledger's totals at each phase start and module boundary, for plots and exports.

Samples are raw ints while the profile runs (a tuple of totals, a perf_counter time); the record's
:class:`~memprof.record.trace.Sample` objects are built once, when the trace is.
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import TYPE_CHECKING

from ..vocabulary import Phase

if TYPE_CHECKING:
    from .ledger import Ledger
    from .state import Run

__all__ = ["Timeline"]

_MAX_SAMPLES = 20_000


class Timeline:
    """Samples of the run's totals, bounded."""

    def __init__(self, ledger: "Ledger", run: "Run") -> None:
        self.ledger = ledger
        self.run = run
        # (seq, step, phase, label, totals, time in ns, event): raw values, Samples built at the end.
        self.samples: list[tuple[int, int, Phase, str, tuple[int, ...], int, str]] = []
        self.seq = 0
        self.capped = False
        # The time axis of exports: nanoseconds of perf_counter, kept relative to the profile's start.
        self.t0_ns = perf_counter_ns()

    def sample(self, label: str, event: str) -> None:
        """A timeline point; ``event`` is "start", "phase" (a phase began), "enter" or "exit" (a module)."""
        run = self.run
        if not run.timeline:
            return
        if len(self.samples) >= _MAX_SAMPLES:
            if not self.capped:
                self.capped = True
                run.notes.append(
                    f"the timeline stopped at {_MAX_SAMPLES:,} samples in step {run.step}: later module boundaries "
                    "are not in the timeline, plots or exports (phases and their peaks still are)")
            return
        self.seq += 1
        led = self.ledger
        if led.released:
            led.settle()
        self.samples.append((self.seq, run.step, run.phase, label, tuple(led.totals), perf_counter_ns(), event))

    def micros(self, ns: int) -> float:
        """Microseconds since the profile started, to 0.1 µs (the unit of Chrome's trace format)."""
        return round((ns - self.t0_ns) / 1000, 1)

    def forget_steps(self, gone: "set[int]") -> None:
        """Steps that leave the record take their samples with them."""
        if self.samples:
            self.samples = [s for s in self.samples if s[1] not in gone]
