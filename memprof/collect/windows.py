"""Recording windows: a schedule turns memprof off between the steps it records.

Outside its warmup and active steps the profiler is paused: the run state is
inactive, so every hook returns at once, and exact mode's dispatch mode is off
the stack. Only what counts steps still runs: the optimizer's step hook and the
gradient hooks note that a step ended, and the model's next forward decides,
from the schedule, whether to resume. Resuming registers what exists then
(parameters, gradients, optimizer state, buffers), as the start of a profile
does. Decisions are taken at a forward's start, where no op of memprof's is in
flight and a step's optimizers have all stepped.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

from . import marks
from ..vocabulary import Phase
from .torch_compat import COMPILER as _COMPILER, graph_task_id as _graph_task_id
from .torch_compat import is_dynamo_compiling as _dynamo_compiling
from .phase_records import forget_steps
from .schedule import ACTIVE, WARMUP, Schedule

if TYPE_CHECKING:
    from .ledger import Ledger
    from .phases import PhaseTracker
    from .state import Run

__all__ = ["Windows"]

_get_ident = threading.get_ident


class Windows:
    """The schedule's state over the run: the step now running, and whether memprof watches it.

    It pushes ``paused`` onto the run state; what pausing and resuming do to the collectors (the run's
    activity, the dispatch mode, what exists when a window begins) is the profiler's, called through
    ``suspend`` and ``wake``. ``ready`` hands the run so far to ``on_trace_ready`` (None without one).
    """

    def __init__(self, plan: Schedule, phases: "PhaseTracker", ledger: "Ledger", run: "Run",
                 ready: "Callable[[], None] | None", suspend: Callable[[], None], wake: Callable[[], None]) -> None:
        self.plan = plan
        self.phases = phases
        self.ledger = ledger
        self.run = run
        self.ready = ready
        self.suspend = suspend
        self.wake = wake
        self.step = 0  # the run's step now running
        self.step_ended = False  # while paused: an optimizer stepped (or, without one, a backward ran)
        self.backward_ended = False
        self.blocks_ended = 0  # while paused: prof.step() blocks that ended (with explicit steps)
        self.recorded: list[list[int]] = []  # [first, last] of each stretch of recorded steps
        self.window: "tuple[int, int] | None" = None  # the last window handed to on_ready
        self.current: "list[int] | None" = None  # [first, last] recorded step of the window now open
        self.callbacks = 0
        self.callback_error: "BaseException | None" = None  # what on_trace_ready raised last
        # The ledger's global peak before a warmup began: warmup steps are watched, never counted.
        self.peak_before_warmup: "marks.PeakState | None" = None

    # -- what the run does ------------------------------------------------------------

    def start(self) -> None:
        """The profile begins: pause at once when step 0 is not watched."""
        if not self.plan.watches(0):
            self.pause()
        elif self.plan(0) == WARMUP:
            self.peak_before_warmup = marks.peak_state(self.ledger)

    def records_now(self) -> bool:
        return self.plan(self.step) == ACTIVE

    def optimizer_stepped_while_paused(self) -> None:
        self.step_ended = True

    def backward_ran_while_paused(self) -> None:
        self.backward_ended = True

    def ended_while_paused(self) -> bool:
        """Did a step end since the pause (forgotten once asked)? Read when the profile ends paused."""
        self.ledger.settle()  # light mode's gradient hook is the ledger queue's append: its paused visits wait there
        ended = self.step_ended or self.backward_ended
        self.step_ended = self.backward_ended = False
        return ended

    def at_forward(self) -> bool:
        """An outermost call of the model begins (the module pre-hook asks): close a step that ended, pause or
        resume by the schedule. True when memprof records this forward, and for a call that is no forward's
        start here: under dynamo's tracing, outside the profile, in another thread, in backward or inside
        autograd's engine (the module hooks deal with those)."""
        run = self.run
        if _dynamo_compiling() or _COMPILER._is_compiling_flag or not (run.active or run.paused) or (
                _get_ident() != run.thread or run.phase is Phase.BACKWARD or _graph_task_id() != -1):
            return True
        phases = self.phases
        if self.run.paused:
            if self.ledger.released:
                # Light mode's gradient hook is the ledger queue's append (ParamTracker.hook): a backward that ran
                # while paused says so here, and the queue does not grow from step to step while paused.
                self.ledger.settle()
            if phases.explicit:  # only prof.step() blocks end steps
                ended = self.blocks_ended
            else:
                ended = int(self.step_ended or (self.backward_ended and not phases.optimizer_seen))
            self.step_ended = self.backward_ended = False
            self.blocks_ended = 0
            if not ended:
                return False
            self.step += ended
            phases.retention.steps_run += ended  # steps memprof did not watch: counted, not recorded
            if self.plan.watches(self.step):
                self.resume()
                return True
            return False
        phases.close_pending_step()  # numbers the next step self.step + 1 through step_closed()
        return True

    def step_closed(self, index: int) -> None:
        """PhaseTracker closed step ``index`` (watched): the next one runs now; pause if not watched.
        A cycle's last active step ends its window (also when the next cycle's steps follow at once)."""
        self.note_recorded(index)
        if self.plan(index) == WARMUP:
            self.forget(index)
        self.step = index + 1
        try:
            if self.plan.ends_window(index):
                self.window_ended()
        finally:  # a callback that raises still leaves the unwatched steps unwatched
            if not self.plan.watches(self.step):
                self.pause()
            elif self.plan(self.step) == WARMUP:
                # A warmup step right after a watched one (no pause, so no resume() to note it): the peak
                # to return to is the one now, with the steps just recorded in it.
                self.peak_before_warmup = marks.peak_state(self.ledger)

    def forget(self, index: int) -> None:
        """A warmup step closed: its peak, samples and phases leave no trace in the record."""
        if self.peak_before_warmup is not None:
            marks.restore_peak(self.ledger, self.peak_before_warmup)
        forget_steps(self.phases, {index})

    def note_recorded(self, index: int) -> None:
        if self.plan(index) == ACTIVE:
            if self.recorded and self.recorded[-1][1] == index - 1:
                self.recorded[-1][1] = index
            else:
                self.recorded.append([index, index])
            if self.current is None:
                self.current = [index, index]
            else:
                self.current[1] = index

    def window_ended(self) -> None:
        """An active window closed: hand the run so far to on_trace_ready (prof.report() reads it)."""
        current, self.current = self.current, None
        if self.ready is None or current is None:
            return
        self.window = (current[0], current[1])
        self.callbacks += 1
        try:
            self.ready()
        except BaseException as exc:
            self.callback_error = exc  # the user's, not memprof's: the profiler raises it as it is
            raise

    # -- pausing and resuming -----------------------------------------------------------

    def pause(self) -> None:
        self.run.paused = True
        self.step_ended = self.backward_ended = False
        self.blocks_ended = 0
        self.suspend()  # hooks return at once from now on, and the dispatch mode is off the stack

    def resume(self) -> None:
        self.run.paused = False
        if self.plan(self.step) == WARMUP:
            self.peak_before_warmup = marks.peak_state(self.ledger)
        self.wake()  # what the unwatched steps made (gradients, state, new parameters), and the hooks on again
        # A fresh "other" phase: nothing from the unwatched steps belongs to the step that starts now.
        self.phases.restart(self.step)

    def recorded_steps(self) -> tuple[tuple[int, int], ...]:
        return tuple((a, b) for a, b in self.recorded)
