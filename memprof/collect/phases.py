"""Steps and phases: which part of a training step is running, and one record per phase.

A forward begins at the model's outermost grad-enabled call, backward at the
engine's first work for the model, the optimizer phase at ``optimizer.step()``;
everything between is "other". A generation's phases are its calls: a prefill
(for an encoder-decoder model, from the encoder's forward through the decoder's
first call) and a decode per later call (:mod:`memprof.collect.kv_cache`). A step ends at an optimizer step (closed when
the next forward comes, so several optimizers stepping in a row stay one
step), at the end of a ``prof.step()`` block, or, with no optimizer, after
each backward. For each phase the ledger's start, peak and end are recorded.

The tracker pushes the phase, the step and the op count onto the run state,
where every hook reads them. Collectors that must act at its transitions are
called through lists the profiler fills at setup (:attr:`PhaseTracker.on_begin`
and the others), so that this module imports none of them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from . import marks
from ..errors import is_interrupt
from ..vocabulary import Phase
from ..record.trace import PhaseRecord, StepRecord
from .phase_records import Gate, WindowSource, close_phase, keep
from .retention import Retention
from .state import EXACT
from .torch_compat import queue_backward_callback

if TYPE_CHECKING:
    from .device import DeviceProbe
    from .ledger import Ledger
    from .state import Run
    from .timeline import Timeline

__all__ = ["PhaseTracker", "Gate", "MAX_DECODE_PHASES", "begin_encoder", "relabel_closed"]

#: Decode phases kept one per token; later tokens of the same generation share the last one.
MAX_DECODE_PHASES = 64

Hooks = list[Callable[[], None]]


def _never() -> bool:
    return False


class PhaseTracker:
    """The phase machine and the step records it closes."""

    def __init__(self, ledger: "Ledger", run: "Run", probe: "DeviceProbe", timeline: "Timeline") -> None:
        self.ledger = ledger
        self.run = run
        self.probe = probe
        self.timeline = timeline
        self.phase_ops_start = 0
        self.step_phases: list[PhaseRecord] = []
        # Steps kept in full and statistics of all of them: memory that does not grow with the run.
        self.retention = Retention()
        self.occurrence: dict[Phase, int] = {}
        self.phase_start: list[int] = ledger.totals.copy()
        self.where: dict[int, tuple[int, Phase]] = {}  # ledger phase serial -> (step, phase)
        self.explicit = False  # prof.step() blocks delimit the steps
        self.merged_decodes = 0  # decode calls folded into the last decode phase of their generation
        self.decodes = 0  # decode phases of the generation under way
        self.end_mark: "list[int] | None" = None  # where a merged decode phase's last call ended
        self.closed: dict[int, int] = {}  # ledger serial of each closed phase of this step -> its index
        self.pending_backward_end = False
        self.pending_step_end = False
        self.optimizer_seen = False
        self.requeued = False  # backward_done went to the back of the engine's queue once (FSDP2)
        self.phase_start_ns = timeline.t0_ns
        # A prefill begun by an encoder-decoder model's encoder (begin_encoder below), which the decoder's first call
        # continues; the ledger's event count when it began.
        self.encoder_open = False
        self.encoder_seq = 0
        #: The schedule's say over which steps are recorded (None without a schedule).
        self.gate: "Gate | None" = None
        # Called at the transitions, in order: a phase begins (with it), a forward begins or a step closes at
        # one (what stopped being a gradient is released), backward starts (exact mode: what the graph saved
        # outside the model), backward ends (frames close, gradients are collected), a step ends.
        self.on_begin: list[Callable[[Phase], None]] = []
        #: Called as each phase is recorded, with its (step, phase, occurrence), while the ledger still holds its peak.
        self.on_close: list[Callable[[int, Phase, int], None]] = []
        self.release_grads: Hooks = []
        #: The storages that are gradients now (the parameter tracker's set, shared): while it is empty there is
        #: nothing to release, and the hooks are not called (a forward begins once per step).
        self.grad_keys: "set[int]" = set()
        self.on_backward_start: Hooks = []
        self.on_backward_end: Hooks = []
        self.on_step_end: Hooks = []
        self.before_close: Callable[[], bool] = _never  # at each close: True if its temporaries went unmeasured
        #: source="allocator": the allocator's windows, whose figures are the phases' (and which step held the peak).
        self.window_source: "WindowSource | None" = None

    def start(self) -> None:
        """The profile's first phase ("other") begins now (again, when a simulated layout restarts the run)."""
        led = self.ledger
        led.start_phase()
        self.phase_start = led.totals.copy()
        self.timeline.t0_ns = self.phase_start_ns = led.phase_peak_ns
        self.where[led.phase_serial] = (0, Phase.OTHER)

    # -- transitions ------------------------------------------------------------

    def begin(self, phase: Phase) -> None:
        run = self.run
        if self.encoder_open and phase is Phase.PREFILL:
            return _prefill_goes_on(self)  # the decoder's first call, after its encoder
        if phase is Phase.DECODE and self.merging():
            # A long generation: the calls after the first MAX_DECODE_PHASES - 1 share one phase.
            self.merged_decodes += 1
            self.end_mark = None
            return
        if phase is Phase.DECODE:
            self.decodes += 1
        elif phase in (Phase.PREFILL, Phase.FORWARD):
            self.decodes = 0
        if phase is Phase.FORWARD and self.pending_step_end:
            self.pending_step_end = False
            self.pending_backward_end = False
            for hook in self.release_grads:
                hook()
            self.end_step()
        if phase is Phase.FORWARD and self.grad_keys:
            for hook in self.release_grads:
                hook()
        if phase is Phase.FORWARD and self.pending_backward_end:
            self.pending_backward_end = False
            if not self.optimizer_seen and not self.explicit:
                self.end_step()
        close_phase(self)
        for began in self.on_begin:
            began(phase)
        run.phase = phase
        if phase is Phase.FORWARD:
            run.forward_seen = True
        led = self.ledger
        led.start_phase()
        self.phase_start = led.totals.copy()
        self.phase_start_ns = led.phase_peak_ns
        self.phase_ops_start = run.ops
        self.where[led.phase_serial] = (run.step, phase)
        run.scan_args = run.mode == EXACT and phase in (Phase.FORWARD, Phase.OTHER)
        self.probe.phase_started()
        self.timeline.sample(phase.value, "phase")

    def merging(self) -> bool:
        """The decode phase running now is the last one of its generation kept per token: later calls join it."""
        return self.run.phase is Phase.DECODE and self.decodes >= MAX_DECODE_PHASES

    def mark_end(self) -> None:
        """A merged decode phase's call ended: what it holds now is the phase's end, unless another call joins."""
        self.end_mark = marks.mark_end(self.ledger)

    def end_step(self) -> None:
        run = self.run
        for hook in self.on_step_end:
            hook()
        run.forward_seen = False
        close_phase(self)
        closed = None
        gate = self.gate
        if self.step_phases:
            closed = run.step
            if gate is None or gate.records_now():
                keep(self, StepRecord(run.step, tuple(self.step_phases)), selected=gate is not None)
            else:
                self.retention.steps_run += 1  # a warmup step: watched, counted, not kept
            run.step += 1
        self.step_phases, self.occurrence = [], {}
        self.closed = {}
        # Re-open an "other" phase without closing anything again.
        run.phase = Phase.OTHER
        led = self.ledger
        led.start_phase()
        self.phase_start = led.totals.copy()
        self.phase_start_ns = led.phase_peak_ns
        self.phase_ops_start = run.ops
        self.where[led.phase_serial] = (run.step, Phase.OTHER)
        run.scan_args = run.mode == EXACT
        if closed is not None and gate is not None:
            gate.step_closed(closed)  # may pause: the next step may be one not watched

    def close_pending_step(self) -> None:
        """Close a step that ended (an optimizer stepped, or a backward ran without one) but was waiting for
        the next forward, so that several optimizers stepping in a row stay one step: now, since a step's end
        (a callback, a schedule's decision at a forward) must read it."""
        if self.pending_step_end or (self.pending_backward_end and not self.optimizer_seen and not self.explicit):
            self.pending_step_end = self.pending_backward_end = False
            for hook in self.release_grads:
                hook()
            self.end_step()

    def restart(self, step: int) -> None:
        """A schedule resumes at ``step``: a fresh "other" phase, and nothing of the unwatched steps in it."""
        self.run.step, self.run.phase = step, Phase.OTHER
        self.step_phases, self.occurrence = [], {}
        led = self.ledger
        led.start_phase()
        self.phase_start = led.totals.copy()
        self.phase_ops_start = self.run.ops
        self.where[led.phase_serial] = (step, Phase.OTHER)

    def optimizer_stepped(self) -> None:
        """An optimizer of the model finished its step."""
        self.begin(Phase.OTHER)
        if self.explicit:
            return
        if self.run.forward_seen:
            # The step ends here; it is closed when the next forward (or the end) comes,
            # so that several optimizers stepping one after another stay one step.
            self.pending_step_end = True
        else:
            self.end_step()  # no forward to wait for: the model's forward runs unseen

    def backward_started(self) -> None:
        run = self.run
        if run.phase is not Phase.BACKWARD and self.ledger.released and run.mode != EXACT:
            # Light mode's gradients wait in the ledger's queue (ParamTracker.hook): one that autograd stored
            # before this call starts the backward at its own place in the queue, as its hook would have.
            self.ledger.settle()
        if run.phase is Phase.BACKWARD:
            return
        for hook in self.on_backward_start:  # while the forward's record is still open
            hook()
        self.begin(Phase.BACKWARD)
        try:
            queue_backward_callback(self.backward_done)
        except RuntimeError as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            # Not inside the engine (a grad hook called by hand): the next
            # phase change closes backward instead.
            pass

    def backward_done(self) -> None:
        run = self.run
        if not run.active or run.phase is not Phase.BACKWARD:
            return
        if run.backward_waits and not self.requeued:
            # FSDP2 (or a simulated rank's layout) reduce-scatters the last gradients in a callback of its own,
            # queued after this one when its first backward hook ran after backward's first op: go to the back
            # of the queue, once.
            self.requeued = True
            try:
                queue_backward_callback(self.backward_done)
                return
            except RuntimeError as failure:
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                pass
        self.requeued = False
        for hook in self.on_backward_end:  # in this phase still: the gradients made were gradients at its peak
            hook()
        self.begin(Phase.OTHER)
        if not self.explicit and not self.optimizer_seen:
            # Without an optimizer each backward ends a step; decided at the
            # next forward, so that an optimizer created later still counts.
            self.pending_backward_end = True

    def explicit_steps(self) -> None:
        """From now on only prof.step() blocks end steps."""
        if not self.explicit:
            self.explicit = True
            self.pending_step_end = False
            if not self.run.paused:
                self.end_step()

def begin_encoder(tracker: PhaseTracker) -> None:
    """An encoder-decoder model's encoder begins a call under no_grad, outside any call of the model: a
    generation's prefill begins here (``generate()`` runs the encoder once, then the decoder's first call fills
    the cache; :meth:`PhaseTracker.begin` continues this phase for that call). If another phase comes first,
    the phase was an ordinary forward of the encoder, and is recorded as one."""
    if tracker.encoder_open or tracker.run.phase not in (Phase.OTHER, Phase.FORWARD, Phase.DECODE):
        return
    scan = tracker.run.scan_args
    tracker.begin(Phase.PREFILL)
    tracker.encoder_open = True
    tracker.encoder_seq = tracker.ledger.seq
    # The loop's ops between the encoder and the decoder's call are looked at for inputs as they were in the
    # phase before (a prefill's own call looks at none).
    tracker.run.scan_args = scan


def _prefill_goes_on(tracker: PhaseTracker) -> None:
    """The decoder's first call, after the encoder: one prefill (generate() runs the encoder, prepares the
    decoder's inputs and its empty cache, then calls the model: generation/utils.py,
    _prepare_encoder_decoder_kwargs_for_generation, then _prefill). The phase goes on; its call looks at no
    op for inputs, as a prefill's does."""
    tracker.encoder_open = False
    tracker.run.scan_args = False


def relabel_closed(tracker: PhaseTracker, serial: int, phase: Phase) -> "tuple[int, str, int] | None":
    """A closed forward phase of this step (by its ledger serial) turns out to be ``phase`` (a prefill, once
    its cache came back); later forwards are renumbered. Returns its (step, phase, occurrence)."""
    i = tracker.closed.get(serial)
    if i is None or tracker.step_phases[i].phase is not Phase.FORWARD:
        return None
    old = tracker.step_phases[i]
    occ = tracker.occurrence.get(phase, 0)
    tracker.occurrence[phase] = occ + 1
    tracker.occurrence[Phase.FORWARD] -= 1
    tracker.step_phases[i] = dataclasses.replace(old, phase=phase, occurrence=occ)
    for j in range(i + 1, len(tracker.step_phases)):
        rec = tracker.step_phases[j]
        if rec.phase is Phase.FORWARD:
            tracker.step_phases[j] = dataclasses.replace(rec, occurrence=rec.occurrence - 1)
    tracker.where[serial] = (tracker.run.step, phase)
    tracker.decodes = 0
    return (tracker.run.step, phase.value, occ)


