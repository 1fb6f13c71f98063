"""Steps and phases: which part of a training step is running, and one record per phase.

A forward begins at the model's outermost grad-enabled call, backward at the
engine's first work for the model, the optimizer phase at ``optimizer.step()``;
everything between is "other". A step ends at an optimizer step (closed when
the next forward comes, so several optimizers stepping in a row stay one
step), at the end of a ``prof.step()`` block, or, with no optimizer, after
each backward. For each phase the ledger's start, peak and end are recorded.
"""

from __future__ import annotations

import dataclasses
from time import perf_counter_ns
from typing import TYPE_CHECKING

import torch

from ..vocabulary import Phase
from ..record.trace import PhaseRecord, StepRecord
from .ledger import breakdown, tag_pairs
from .retention import Retention

if TYPE_CHECKING:
    from .profiler import Profiler

__all__ = ["PhaseTracker"]

_MAX_SAMPLES = 20_000
#: Decode phases kept one per token; later tokens of the same generation share the last one.
MAX_DECODE_PHASES = 64


class PhaseTracker:
    """The phase machine and the step records it closes."""

    def __init__(self, prof: "Profiler") -> None:
        self.prof = prof
        self.ledger = prof.ledger
        self.current = Phase.OTHER
        self.ops = 0  # ops dispatched (full mode)
        self.phase_ops_start = 0
        self.step = 0
        self.step_phases: list[PhaseRecord] = []
        # Steps kept in full and statistics of all of them: memory that does not grow with the run.
        self.retention = Retention()
        self.occurrence: dict[Phase, int] = {}
        self.phase_start: list[int] = self.ledger.totals.copy()
        self.where: dict[int, tuple[int, Phase]] = {}  # ledger phase serial -> (step, phase)
        self.explicit = False  # prof.step() blocks delimit the steps
        self.merged_decodes = 0  # decode calls folded into the last decode phase of their generation
        self.decodes = 0  # decode phases of the generation under way
        self.end_mark: "list[int] | None" = None  # where a merged decode phase's last call ended
        self.closed: dict[int, int] = {}  # ledger serial of each closed phase of this step -> its index
        self.pending_backward_end = False
        self.pending_step_end = False
        self.forward_seen = False  # a forward began in this step
        self.optimizer_seen = False
        # Ops outside the model's modules are scanned for tensors made before the profile (full mode).
        self.scan_args = False
        self.requeued = False  # backward_done went to the back of the engine's queue once (FSDP2)
        # (seq, step, phase, label, totals, time in ns, event): raw values, Samples built at the end.
        self.samples: list[tuple[int, int, Phase, str, tuple[int, ...], int, str]] = []
        self.sample_seq = 0
        self.samples_capped = False
        # The time axis of exports: nanoseconds of perf_counter, kept relative to the profile's start.
        self.t0_ns = perf_counter_ns()
        self.phase_start_ns = self.t0_ns

    def start(self) -> None:
        """The profile's first phase ("other") begins now."""
        led = self.ledger
        led.start_phase()
        self.phase_start = led.totals.copy()
        self.t0_ns = self.phase_start_ns = led.phase_peak_ns
        self.where[led.phase_serial] = (0, Phase.OTHER)

    # -- transitions ------------------------------------------------------------

    def begin(self, phase: Phase) -> None:
        prof = self.prof
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
            prof.params.release_stale_grads()
            self.end_step()
        if phase is Phase.FORWARD and prof.params.grad_keys:
            prof.params.release_stale_grads()
        if phase is Phase.FORWARD and self.pending_backward_end:
            self.pending_backward_end = False
            if not self.optimizer_seen and not self.explicit:
                self.end_step()
        self.close()
        prof.modules.phase_began(phase)
        self.current = phase
        if phase is Phase.FORWARD:
            self.forward_seen = True
        led = self.ledger
        led.start_phase()
        self.phase_start = led.totals.copy()
        self.phase_start_ns = led.phase_peak_ns
        self.phase_ops_start = self.ops
        self.where[led.phase_serial] = (self.step, phase)
        self.scan_args = prof.mode == "full" and phase in (Phase.FORWARD, Phase.OTHER)
        prof.probe.phase_started()
        self.sample(phase.value, "phase")

    def merging(self) -> bool:
        """The decode phase running now is the last one of its generation kept per token: later calls join it."""
        return self.current is Phase.DECODE and self.decodes >= MAX_DECODE_PHASES

    def mark_end(self) -> None:
        """A merged decode phase's call ended: what it holds now is the phase's end, unless another call joins."""
        self.end_mark = self.ledger.totals.copy()

    def relabel_closed(self, serial: int, phase: Phase) -> "tuple[int, str, int] | None":
        """A closed forward phase of this step (by its ledger serial) turns out to be ``phase`` (a prefill, once
        its cache came back); later forwards are renumbered. Returns its (step, phase, occurrence)."""
        i = self.closed.get(serial)
        if i is None or self.step_phases[i].phase is not Phase.FORWARD:
            return None
        old = self.step_phases[i]
        occ = self.occurrence.get(phase, 0)
        self.occurrence[phase] = occ + 1
        self.occurrence[Phase.FORWARD] -= 1
        self.step_phases[i] = dataclasses.replace(old, phase=phase, occurrence=occ)
        for j in range(i + 1, len(self.step_phases)):
            rec = self.step_phases[j]
            if rec.phase is Phase.FORWARD:
                self.step_phases[j] = dataclasses.replace(rec, occurrence=rec.occurrence - 1)
        self.where[serial] = (self.step, phase)
        self.decodes = 0
        return (self.step, phase.value, occ)

    def close(self) -> None:
        """Record the phase that is ending (an "other" phase in which nothing happened leaves none)."""
        led = self.ledger
        phase = self.current
        end = led.totals
        ops = self.ops - self.phase_ops_start
        if phase is Phase.OTHER and ops == 0 and end == self.phase_start and led.phase_peak == self.phase_start:
            return
        occ = self.occurrence.get(phase, 0)
        self.occurrence[phase] = occ + 1
        if self.end_mark is not None and phase is Phase.DECODE:
            end = self.end_mark  # a merged decode phase ends where its last call did
        self.end_mark = None
        self.closed[led.phase_serial] = len(self.step_phases)
        device_now = self.prof.probe.phase_ended()
        light = self.prof.mode == "light"
        self.step_phases.append(PhaseRecord(
            step=self.step,
            phase=phase,
            occurrence=occ,
            start=breakdown(self.phase_start, light=light, where="start", device=device_now),
            peak=breakdown(led.phase_peak, light=light, where="peak", device=device_now),
            end=breakdown(end, light=light, where="end", device=device_now),
            ops=ops,
            tags_peak=tag_pairs(led.phase_peak_tags),
            tags_end=tag_pairs(led.tag_act),
            start_us=self.micros(self.phase_start_ns),
            peak_us=self.micros(led.phase_peak_ns),
            end_us=self.micros(perf_counter_ns()),
        ))

    def end_step(self) -> None:
        self.prof.modules.prune_hooks()
        self.forward_seen = False
        self.close()
        closed = None
        if self.step_phases:
            closed = self.step
            windows = self.prof.windows
            if windows is None or windows.records_now():
                self.keep(StepRecord(self.step, tuple(self.step_phases)), selected=windows is not None)
            else:
                self.retention.steps_run += 1  # a warmup step: watched, counted, not kept
            self.step += 1
        self.step_phases = []
        self.occurrence = {}
        self.closed = {}
        # Re-open an "other" phase without closing anything again.
        self.current = Phase.OTHER
        led = self.ledger
        led.start_phase()
        self.phase_start = led.totals.copy()
        self.phase_start_ns = led.phase_peak_ns
        self.phase_ops_start = self.ops
        self.where[led.phase_serial] = (self.step, Phase.OTHER)
        self.scan_args = self.prof.mode == "full"
        if closed is not None and self.prof.windows is not None:
            self.prof.windows.step_closed(closed)  # may pause: the next step may be one not watched

    def optimizer_stepped(self) -> None:
        """An optimizer of the model finished its step."""
        self.begin(Phase.OTHER)
        if self.explicit:
            return
        if self.forward_seen:
            # The step ends here; it is closed when the next forward (or the end) comes,
            # so that several optimizers stepping one after another stay one step.
            self.pending_step_end = True
        else:
            self.end_step()  # no forward to wait for: the model's forward runs unseen

    def backward_started(self) -> None:
        if self.current is Phase.BACKWARD:
            return
        if self.prof.mode == "full":
            self.prof.saved.find_outside_saves()  # while the forward's record is still open
        self.begin(Phase.BACKWARD)
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.backward_done)
        except RuntimeError:
            # Not inside the engine (a grad hook called by hand): the next
            # phase change closes backward instead.
            pass

    def backward_done(self) -> None:
        prof = self.prof
        if not prof.active or self.current is not Phase.BACKWARD:
            return
        if prof.backward_waits and not self.requeued:
            # FSDP2 (or a simulated rank's layout) reduce-scatters the last gradients in a callback of its own,
            # queued after this one when its first backward hook ran after backward's first op: go to the back
            # of the queue, once.
            self.requeued = True
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self.backward_done)
                return
            except RuntimeError:
                pass
        self.requeued = False
        prof.modules.close_backward_frames()
        if prof.shards is not None:
            prof.shards.grads()  # in this phase still: the reduce-scatter outputs were gradients at its peak
        prof.params.walk_grads()
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
            if self.prof.windows is None or not self.prof.windows.paused:
                self.end_step()

    # -- samples and the end ----------------------------------------------------

    def sample(self, label: str, event: str) -> None:
        """A timeline point; ``event`` is "start", "phase" (a phase began), "enter" or "exit" (a module)."""
        if not self.prof.timeline:
            return
        if len(self.samples) >= _MAX_SAMPLES:
            if not self.samples_capped:
                self.samples_capped = True
                self.prof.notes.append(
                    f"the timeline stopped at {_MAX_SAMPLES:,} samples in step {self.step}: later module boundaries "
                    "are not in the timeline, plots or exports (phases and their peaks still are)")
            return
        self.sample_seq += 1
        # Raw ints now; Breakdown objects are built once, when the trace is.
        self.samples.append((self.sample_seq, self.step, self.current, label, tuple(self.ledger.totals),
                             perf_counter_ns(), event))

    def micros(self, ns: int) -> float:
        """Microseconds since the profile started, to 0.1 µs (the unit of Chrome's trace format)."""
        return round((ns - self.t0_ns) / 1000, 1)

    def peak_step(self) -> "int | None":
        where = self.where.get(self.ledger.peak_phase_serial)
        return where[0] if where else None

    def keep(self, rec: StepRecord, *, selected: bool = False) -> None:
        """A step ended: into the statistics, and into the detail while retention keeps it (``selected``:
        a schedule recorded it)."""
        dropped = self.retention.add(rec, peak_step=self.peak_step(), selected=selected)
        if dropped:
            gone = set(dropped)
            if self.samples:
                self.samples = [s for s in self.samples if s[1] not in gone]
            peak_serial = self.ledger.peak_phase_serial
            self.where = {serial: w for serial, w in self.where.items()
                          if w[0] not in gone or serial == peak_serial}

    def finish(self) -> list[StepRecord]:
        """Close whatever is open; a trailing step holding only "other" joins the previous step."""
        windows = self.prof.windows
        if windows is not None and windows.paused:
            # Nothing was watched since the pause: what the ledger saw then (frees) is no phase's.
            self.step_phases = []
            if windows.step_ended or windows.backward_ended:
                self.retention.steps_run += 1
                windows.step_ended = windows.backward_ended = False
            return self.retention.records()
        self.close()
        phases = self.step_phases
        last = self.retention.kept.get(self.step - 1)
        if phases:
            tail = all(p.phase is Phase.OTHER for p in phases)
            if tail and last is not None:
                extra = tuple(dataclasses.replace(p, step=last.index, occurrence=p.occurrence + sum(
                    1 for q in last.phases if q.phase is p.phase)) for p in phases)
                self.retention.replace_last(StepRecord(last.index, last.phases + extra))
                self.retention.add_phases(extra)
            elif tail and self.step > 0 and windows is not None:
                # The tail of a schedule's warmup step, closed early by end_step() (a callback at the step's
                # end): forgotten with that step, never a step of its own that did not run.
                windows.forget(self.step)
            elif windows is None or windows.records_now():
                self.keep(StepRecord(self.step, tuple(phases)), selected=windows is not None)
                if windows is not None:
                    windows.note_recorded(self.step)
            else:
                self.retention.steps_run += 1
        self.step_phases = []
        return self.retention.records()
