"""Which steps of a long run to record: ``memprof.schedule()``, as torch.profiler's schedule.

The steps of the run are numbered from 0. The first ``skip_first`` are not
recorded; then cycles of ``wait`` steps (not recorded), ``warmup`` steps
(hooks installed, nothing kept) and ``active`` steps (recorded) follow,
``repeat`` times (0: for the rest of the run). Outside the warmup and active
steps memprof's dispatch mode is not installed and its hooks return at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from ..errors import InvalidArgumentError

__all__ = ["Schedule", "schedule", "SKIP", "WAIT", "WARMUP", "ACTIVE", "DONE"]

#: What a schedule says of one step.
SKIP, WAIT, WARMUP, ACTIVE, DONE = "skip", "wait", "warmup", "active", "done"


@dataclass(frozen=True)
class Schedule:
    """A recording plan over the steps of a run; calling it with a step index gives that step's action
    (``"skip"``, ``"wait"``, ``"warmup"``, ``"active"`` or ``"done"``)."""

    wait: int = 0
    warmup: int = 0
    active: int = 1
    repeat: int = 0
    skip_first: int = 0

    def __call__(self, step: int) -> str:
        if step < self.skip_first:
            return SKIP
        step -= self.skip_first
        cycle = self.wait + self.warmup + self.active
        if self.repeat and step >= cycle * self.repeat:
            return DONE
        at = step % cycle
        if at < self.wait:
            return WAIT
        if at < self.wait + self.warmup:
            return WARMUP
        return ACTIVE

    def __post_init__(self) -> None:
        # Checked here, not only in schedule(): the class is public, and a zero-length cycle would
        # otherwise fail inside a forward hook.
        for name in ("wait", "warmup", "active", "repeat", "skip_first"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(f"schedule({name}=...) must be an int number of steps, got {_shown(value)}")
            if value < 0:
                raise InvalidArgumentError(f"schedule({name}={value}) is negative; give 0 or more steps")
        if self.active < 1:
            raise InvalidArgumentError(
                f"schedule(active={self.active}) records nothing; "
                "give active=1 or more (the steps each window records)")

    def ends_window(self, step: int) -> bool:
        """Whether ``step`` is the last recorded step of its cycle (where on_trace_ready is called)."""
        if self(step) != ACTIVE:
            return False
        cycle = self.wait + self.warmup + self.active
        return (step - self.skip_first) % cycle == cycle - 1

    def records(self, step: int) -> bool:
        """Whether ``step`` is recorded (kept in the statistics and in full)."""
        return self(step) == ACTIVE

    def watches(self, step: int) -> bool:
        """Whether memprof's hooks are installed during ``step`` (warmup or active)."""
        return self(step) in (WARMUP, ACTIVE)

    def describe(self) -> str:
        return (f"schedule(wait={self.wait}, warmup={self.warmup}, active={self.active}, repeat={self.repeat}, "
                f"skip_first={self.skip_first})")


def schedule(*, wait: int = 0, warmup: int = 0, active: int = 1, repeat: int = 0, skip_first: int = 0) -> Schedule:
    """Record ``active`` steps after ``wait`` + ``warmup`` steps, ``repeat`` times (0: until the run ends),
    after skipping the first ``skip_first`` steps. Pass it as ``memprof.profile(..., schedule=...)``.

    ``wait``, ``warmup``, ``repeat`` and ``skip_first`` are counts of steps (0 or more); ``active`` is at
    least 1. A step is what memprof calls a step: one optimizer step (several forwards and backwards with
    gradient accumulation), each backward without an optimizer, or one ``prof.step()`` block.
    """
    return Schedule(wait, warmup, active, repeat, skip_first)  # checked in Schedule.__post_init__


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 30 else text[:27] + "..."
