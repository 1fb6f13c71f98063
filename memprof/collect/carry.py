"""Exact mode's fast path for optimizer steps: measure a step once, carry it while nothing that decides it changes.

An optimizer's steady step allocates and frees the same temporaries every time (its code path and every size
follow from its settings and the shapes of its tensors: :mod:`.step_signature`), yet it is about half of all
the ops a training step dispatches. So each optimizer's step is measured through the dispatch mode as any op
is, and remembered when it was clean: inside one phase of its own, every storage it made freed before it
returned, nothing else in the ledger changed, no other step nested in it. A later step with the same
signature is *carried*: memprof's dispatch mode leaves the stack for it (the user's own modes stay where
they are, in their order: :mod:`.mode_stack`), and when it returns, what the measured step did is replayed
into the ledger through its own methods, a storage of the measured peak's bytes made and freed, with the
measured op count, so that the phase's record (start, peak and its composition, end, ops) is what measuring
it would have made.

After a carried step memprof checks what the step was assumed to leave unchanged: the ledger's totals and
live storages, and the optimizer's state (the same storages, the same sizes). If something changed, the
step's record says so (a note, and the step counted "unverified" in :attr:`memprof.record.trace.Trace
.optimizer_steps`), its peak is kept an upper bound, and the next step is measured. A carried step that
raises is never replayed: its phase's temporaries are not measured (``None``), and a note says so.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Callable

from ..errors import is_interrupt
from .carry_spans import CARRIED, KINDS, MAX_SPANS, MEASURED, NOT_MEASURED, PARTLY, UNVERIFIED, StepSpans
from .ledger import TEMPORARIES
from .mode_stack import pop_from_beneath, push_beneath
from .step_signature import state_signature, step_signature
from .torch_compat import dispatch_mode_at, dispatch_stack_len

if TYPE_CHECKING:
    import torch

    from .aliases import Args, Kwargs
    from .dispatch import StorageTracker
    from .ledger import Ledger
    from .phases import PhaseTracker
    from .state import Run
    from .step_signature import Signature

__all__ = ["StepCarry", "RECHECK_EVERY", "MEASURED", "CARRIED", "PARTLY", "UNVERIFIED", "NOT_MEASURED", "KINDS",
           "MAX_SPANS"]

#: Carried steps after which a step is measured again, as a check that the signature said all.
RECHECK_EVERY = 50


class _Ghost:
    """What a carried step's replay registers: a stand-in storage of the measured peak's bytes, alive only
    between the two ledger calls that make and free it (its ``_cdata`` is its own address, unique while it
    lives, as a live ``StorageImpl``'s is)."""

    __slots__ = ("_cdata", "raw", "__weakref__")

    def __init__(self, raw: int) -> None:
        self._cdata = id(self)
        self.raw = raw

    def nbytes(self) -> int:
        return self.raw


class _Known:
    """A clean measured step of one optimizer: its signature and what it did to the ledger."""

    __slots__ = ("signature", "peak", "ops", "step", "carried")

    def __init__(self, signature: "Signature", peak: int, ops: int, step: int) -> None:
        self.signature = signature
        self.peak = peak  # the temporaries' highest level above the phase's start
        self.ops = ops
        self.step = step
        self.carried = 0  # steps carried from it since it was measured


class _Step:
    """The optimizer step under way."""

    __slots__ = ("opt", "kind", "signature", "known", "totals", "entries", "closes", "depth", "nested", "ops",
                 "state", "recheck")

    def __init__(self, opt: "torch.optim.Optimizer", kind: str, signature: "Signature | None", known: "_Known | None",
                 totals: list[int], entries: int, closes: int, ops: int) -> None:
        self.opt = weakref.ref(opt)
        self.kind = kind
        self.signature = signature
        self.known = known
        self.totals = totals
        self.entries = entries
        self.closes = closes
        self.depth: "int | None" = None  # where memprof's mode was on the stack, while it is off for a carried step
        self.nested = False
        self.ops = ops
        self.state: object = None  # the state part of the signature: compared with ==
        self.recheck: "_Known | None" = None  # measured again to check the step it would have been carried from


class StepCarry:
    """Which optimizer steps are measured and which carried, and the replay of carried ones.

    Called by the optimizer tracker at each step's start (after the optimizer phase began) and end (before
    the state is collected), and by the phase tracker before a phase closes (:meth:`before_close`: a carried
    step that never reached its end raised). Built only where carrying is on: not in light mode, a
    simulation, with ``record_allocations=True`` (the allocator replay needs every storage), ``operations=True``
    (every op's figures), ``oom_dump=`` (what is live at an OOM), or ``carry_optimizer_steps=False``.
    """

    def __init__(self, ledger: "Ledger", run: "Run", storages: "StorageTracker", phases: "PhaseTracker") -> None:
        self.ledger = ledger
        self.run = run
        self.storages = storages
        self.phases = phases
        self.known: dict[int, tuple[weakref.ref[object], _Known]] = {}
        self.never: set[int] = set()  # optimizers whose measured step nested another: always measured
        self.current: "_Step | None" = None
        self.closes = 0
        #: What each step's optimizer phases were, as spans of steps.
        self.spans = StepSpans()
        self.formula_checked: set[int] = set()
        self.unmeasured = False  # the open phase held a carried step that never returned

    # -- a step begins ---------------------------------------------------------------------------------

    def step_begins(self, opt: "torch.optim.Optimizer", args: "Args", kwargs: "Kwargs", *, fresh: bool,
                    closure: bool) -> None:
        """``opt.step(*args[1:], **kwargs)`` began (its optimizer phase began here when ``fresh``): measure it, or
        carry it. ``args[0]`` is the optimizer itself, as torch hands the step's arguments to its hooks."""
        current = self.current
        if current is not None:
            if current.kind == CARRIED:
                self.abandon()  # it raised without reaching its end: the mode comes back before anything runs
            else:
                current.nested = True  # ZeroRedundancyOptimizer steps its local optimizer inside its own step
                return
        led, run = self.ledger, self.run
        kind, signature, known = MEASURED, None, None
        if fresh and not closure and threading.get_ident() == run.thread and id(opt) not in self.never:
            mode = self.storages.mode
            try:
                # Positional arguments too (a closure of None, an optimizer of the user's that takes others).
                given = dict(kwargs or {}, **{f"#{i}": a for i, a in enumerate(args[1:], 1)})
                signature = step_signature(opt, given, mode)
            except Exception as failure:  # an unusual optimizer must never break the measurement: measured
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                signature = None
            pair = self.known.get(id(opt))
            if pair is not None and pair[0]() is opt and signature is not None and pair[1].signature == signature:
                known = pair[1]
                kind = CARRIED
        recheck = None
        if known is not None and known.carried >= RECHECK_EVERY:
            # Every so often a step that would be carried is measured, and must match: an optimizer whose
            # allocations depend on values its signature cannot see is then measured every step.
            kind, known, recheck = MEASURED, None, known
        elif known is not None:
            known.carried += 1
        step = _Step(opt, kind, signature, known, led.totals.copy(), len(led.entries), self.closes, run.ops)
        step.recheck = recheck
        if kind == CARRIED:
            step.depth = self._leave()
            if step.depth is None:
                step.kind, step.known = MEASURED, None  # a mode torch keeps apart sits above memprof's: measured
            else:
                step.state = known.signature[2] if known is not None else None
        self.current = step

    def _leave(self) -> "int | None":
        """memprof's dispatch mode off this thread's stack for a carried step; where it was, or None."""
        mode = self.storages.mode
        if mode is None:
            return None
        for depth in range(max(dispatch_stack_len(), 0)):
            if dispatch_mode_at(depth) is mode:
                return depth if pop_from_beneath(mode) else None
        return None

    def _come_back(self, step: _Step) -> None:
        depth, step.depth = step.depth, None
        mode = self.storages.mode
        if depth is not None and mode is not None:
            push_beneath(mode, depth)

    # -- a step ends -----------------------------------------------------------------------------------

    def step_ends(self, opt: "torch.optim.Optimizer", collect_state: Callable[..., None]) -> None:
        """``opt.step()`` returned: a carried step is checked and replayed, a measured one remembered when clean.
        ``collect_state(opt, retro=False)`` registers new state (a carried step that changed it: before the
        replay, and never moved back into a peak it did not see)."""
        step = self.current
        if step is None or step.opt() is not opt:
            return  # a nested step's end, or a step that began while the profile was paused
        self.current = None
        self._come_back(step)  # whatever the step was: the mode is never left off the stack past a step's end
        if step.kind == CARRIED:
            self._carried(opt, step, collect_state)
        else:
            self._measured(opt, step)

    def _carried(self, opt: "torch.optim.Optimizer", step: _Step, collect_state: Callable[..., None]) -> None:
        led, run = self.ledger, self.run
        known = step.known
        assert known is not None
        try:
            state = state_signature(opt)
        except Exception as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            state = None
        unchanged = led.totals == step.totals and len(led.entries) == step.entries and state == step.state \
            and self.closes == step.closes
        extra = 0
        if not unchanged:
            # What the step changed is registered first (new state), and the measured temporaries replayed on top
            # of it and of what the step freed (as if the new state was made while the old lived): the phase's
            # start plus the new state plus the temporaries, an upper bound, never a figure below the truth.
            extra = max(0, sum(step.totals) - sum(led.totals))
            collect_state(opt, retro=False)
            self.known.pop(id(opt), None)  # measured again next time
            run.note(f"{type(opt).__name__}'s step at step {run.step} was carried from step {known.step}, and "
                     "what it left differed from that step (its state, or storages freed or made during it): its "
                     "optimizer phase's peak is an upper bound, and the next step was measured again")
        self._replay(known.peak + extra)
        run.ops += known.ops
        self.spans.add(run.step, CARRIED if unchanged else UNVERIFIED)

    def _replay(self, nbytes: int) -> None:
        """The measured step's temporaries, made and freed through the ledger's own calls: its phase peak (and the
        run's, where this is it) is reached with the composition measuring would have found."""
        if nbytes <= 0:
            return
        ghost = _Ghost(nbytes)
        self.ledger.add(ghost, TEMPORARIES)
        del ghost  # freed: the ledger's weak reference queues it, as for a storage torch frees
        self.ledger.settle()

    def _measured(self, opt: "torch.optim.Optimizer", step: _Step) -> None:
        led, run, phases = self.ledger, self.run, self.phases
        self.spans.add(run.step, MEASURED)
        if step.signature is None or step.nested:
            if step.nested:
                self.never.add(id(opt))
            return
        start = phases.phase_start
        peak = led.phase_peak
        # Clean: one phase, every storage it made freed, nothing else changed, its peak only temporaries.
        clean = (self.closes == step.closes and led.totals == step.totals and len(led.entries) == step.entries
                 and all(peak[i] == start[i] for i in range(len(start)) if i != TEMPORARIES)
                 and start == step.totals)
        rise = peak[TEMPORARIES] - start[TEMPORARIES]
        old = step.recheck
        if old is not None and not (clean and rise == old.peak and run.ops - step.ops == old.ops):
            self.never.add(id(opt))
            self.known.pop(id(opt), None)
            run.note(f"{type(opt).__name__}'s step at step {run.step}, measured again as a check, differed from "
                     f"step {old.step}'s, whose figures the steps carried since then repeat ({old.peak:,} bytes of "
                     f"temporaries and {old.ops} ops, against {rise:,} and {run.ops - step.ops} now): those steps' "
                     "optimizer phases may be off, and every later step of it is measured")
            return
        if not clean:
            self.known.pop(id(opt), None)
            return
        self.known[id(opt)] = (weakref.ref(opt), _Known(step.signature, rise, run.ops - step.ops, run.step))
        self._check_formula(opt, rise)

    def _check_formula(self, opt: "torch.optim.Optimizer", measured: int) -> None:
        """The step's temporaries against the formula of anatomy/optimizers.py, once per optimizer: a note where
        they differ (foreach and fused are exact there; a for-loop's is an upper bound)."""
        if id(opt) in self.formula_checked:
            return
        self.formula_checked.add(id(opt))
        from ..anatomy.optimizers import optimizer_implementation, predict_optimizer_step_transient_bytes

        try:
            with_grad = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            formula = predict_optimizer_step_transient_bytes(opt, with_grad)
            impl = optimizer_implementation(opt, with_grad)
        except Exception as failure:  # no formula, or groups with different implementations: nothing to compare
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            return
        if formula is None or measured == formula or (impl == "for-loop" and measured <= formula):
            return
        bound = "at most " if impl == "for-loop" else ""
        self.run.note(f"{type(opt).__name__} ({impl}) allocated {measured:,} bytes of temporaries in its step at "
                      f"step {self.run.step}; the formula (docs/anatomy.md, optimizer step) gives {bound}"
                      f"{formula:,}")

    # -- a step that never ended -----------------------------------------------------------------------

    def before_close(self) -> bool:
        """A phase is closing: True when its temporaries were not measured (a carried step in it never reached
        its end: it raised, or a phase began inside it); the mode is back by then."""
        self.closes += 1
        self.abandon()
        unmeasured, self.unmeasured = self.unmeasured, False
        return unmeasured

    def abandon(self) -> None:
        """The carried step under way will not reach its end (it raised; the profile ends): the dispatch mode
        comes back, nothing is replayed, and the record says the step's temporaries were not measured."""
        step = self.current
        if step is None or step.kind != CARRIED:
            return
        self.current = None
        self._come_back(step)
        opt = step.opt()
        if opt is not None:
            self.known.pop(id(opt), None)
        self.unmeasured = True  # the open phase's record, when it closes
        self.spans.add(self.run.step, NOT_MEASURED)
        self.run.note(f"optimizer.step() at step {self.run.step} did not return (it raised, or the profile ended "
                      "inside it) while memprof carried its allocations from an earlier step: its optimizer "
                      "phase's temporaries are not measured, nor what it made in what was live at an error, and "
                      "ops run after it until memprof's next hook (a forward, a step) were not seen as they ran "
                      "(carry_optimizer_steps=False measures every step)")
