"""memprof inside the frameworks people train with.

Each integration imports its framework only when it is itself imported, and needs that framework's
extra (``pip install 'torch-memprof[transformers]'``, ``[lightning]``):

* :mod:`memprof.integrations.transformers` -- ``MemprofCallback`` for the HF ``Trainer``;
* :mod:`memprof.integrations.lightning` -- ``MemprofCallback`` for ``lightning.pytorch.Trainer``.

accelerate needs none: profile what ``accelerator.prepare`` returns (see docs/integrations/accelerate.md).
An integration drives the public API only (``memprof.Profiler``, ``start``, ``end_step``,
``latest_step``, ``mark_inputs``, ``stop``), and nothing it does raises into the training loop once
training runs: what fails is a :class:`memprof.errors.MemprofWarning`.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

from ..errors import is_interrupt

if TYPE_CHECKING:
    from ..collect.aliases import FrameworkObject
    from ..report.profiling import Profiler
    from ..report import Report
    from ..collect.schedule import Schedule
    from ..record.trace import StepRecord

__all__ = ["step_metrics", "require", "Session", "warn"]

#: Prefix of every metric an integration logs.
PREFIX = "memprof/"


def step_metrics(step: "StepRecord | None") -> dict[str, int]:
    """One step's memory as flat metrics: ``memprof/peak_bytes`` (the step's highest total) and
    ``memprof/<category>_bytes`` at that moment. A figure that was not measured is left out, never 0."""
    if step is None or not step.phases:
        return {}
    top = max(step.phases, key=lambda p: -1 if p.peak.total is None else p.peak.total)
    out: dict[str, int] = {}
    if top.peak.total is not None:
        out[PREFIX + "peak_bytes"] = top.peak.total
    for cat, value in top.peak.measured().items():
        out[f"{PREFIX}{cat.value}_bytes"] = value
    return out


def require(module: str, extra: str, minimum: "tuple[int, ...]", installed: object) -> None:
    """Refuse a framework version older than the integration supports, naming the fix."""
    from ..errors import InvalidArgumentError

    parts = []
    for piece in str(installed).split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) < minimum:
        wanted = ".".join(map(str, minimum))
        raise InvalidArgumentError(
            f"memprof's {module} integration needs {module} >= {wanted}, found {installed}; upgrade it "
            f"(pip install 'torch-memprof[{extra}]')")


class Session:
    """What every callback does with its profile: hold the arguments, start it at the start of training
    (ending one still running from an earlier run), save each window and the whole run under
    ``save_dir``, and end it, with the exception that ended training if one did.

    Nothing here raises into the training loop once training runs: a file that cannot be written (disk
    full, a quota, the folder removed), or a report that cannot be built, is a :class:`MemprofWarning`
    naming the file and the error, the report stays in memory, and an exception that ended training
    stays the one the framework raises. A folder that cannot be written at all is refused up front."""

    def __init__(self, *, mode: str = "auto", schedule: "Schedule | None" = None,
                 save_dir: "str | os.PathLike[str] | None" = None, timeline: bool = False,
                 oom_dump: "str | os.PathLike[str] | None" = None) -> None:
        from ..collect.oom import checked_folder

        self.mode = mode
        self.schedule = schedule
        # Checked now, as oom_dump= is: a file, or a folder that cannot be made or written, is an error
        # before training rather than a failure at its first save.
        self.save_dir = checked_folder(save_dir, "save_dir") if save_dir is not None else None
        self.timeline = timeline
        self.oom_dump = oom_dump
        if oom_dump is not None:
            checked_folder(oom_dump, "oom_dump")  # the profiler checks it again when training starts
        self.profiler: "Profiler | None" = None
        self.report: "Report | None" = None
        self._logged: "int | None" = None
        self._rank = 0

    def begin(self, model: "FrameworkObject", optimizers: "FrameworkObject", rank: int) -> None:
        """Start profiling ``model`` (what the framework trains) and its ``optimizers``."""
        from ..report.profiling import Profiler
        from ..collect.oom import checked_folder

        self.stop()
        self._rank = rank
        if self.save_dir is not None:
            checked_folder(self.save_dir, "save_dir")  # made again if removed since; refused if now unwritable
        on_ready = self._save_window if (self.save_dir is not None and self.schedule is not None) else None
        self.report = None
        self._logged = None
        self.profiler = Profiler(model, optimizers, mode=self.mode, timeline=self.timeline, schedule=self.schedule,
                                 on_trace_ready=on_ready, oom_dump=self.oom_dump)
        self.profiler.start()

    def step_ended(self) -> dict[str, int]:
        """The framework's optimizer step is over: close memprof's step, and return its metrics when it is
        a step recorded since the last one returned (empty otherwise: a step the schedule leaves out, the
        middle of gradient accumulation). Never raises: an error of memprof's own ends the profile with a
        warning, and training goes on without it."""
        prof = self.profiler
        if prof is None or not prof.running:
            return {}
        try:
            prof.end_step()
            last = prof.latest_step()
            if last is None or last.index == self._logged:
                return {}
            self._logged = last.index
            return step_metrics(last)
        except Exception as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            self.give_up(exc)
            return {}

    def give_up(self, exc: Exception) -> None:
        """An error of memprof's own inside training: warn, end the profile (every hook removed, the report
        kept of what ran until then) and let training go on."""
        warn(f"memprof stopped profiling after an error of its own ({type(exc).__name__}: {exc}); training goes "
             "on without it, and the report holds what was measured until then")
        self.stop()

    def stop(self, error: "BaseException | None" = None) -> None:
        """End the profile if it runs and keep its report; ``error``: the exception that ended training,
        recorded in the report (and written as an OOM dump with ``oom_dump=``). Never raises: what fails
        here is a warning (memprof's hooks are removed whatever fails)."""
        prof, self.profiler = self.profiler, None
        if prof is None or not prof.running:
            return
        try:
            prof.stop(error)
        except Exception as exc:  # the hooks are gone by now: ending them comes before anything that can fail
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            warn(f"memprof's profile ended with an error ({type(exc).__name__}: {exc})")
        try:
            self.report = prof.report()
        except Exception as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            warn(f"memprof could not build its report ({type(exc).__name__}: {exc}); training is not affected")
            return
        if self.save_dir is not None:
            self._save(self.report, f"memprof-rank{self._rank}.json")

    def _save_window(self, prof: "Profiler") -> None:
        """``on_trace_ready``: save the window that just ended. Runs inside the training step (at its end,
        or at the next forward), so nothing may raise from here."""
        try:
            a, b = prof.window or (None, None)
            name = f"memprof-rank{self._rank}-steps-{a}-{b}.json"
            report = prof.report()
        except Exception as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            warn(f"memprof could not build the report of the window that ended ({type(exc).__name__}: {exc}); "
                 "training goes on, and the report at the end of training holds its steps")
            return
        self._save(report, name)

    def _save(self, report: "Report", name: str) -> None:
        assert self.save_dir is not None
        path = os.path.join(self.save_dir, name)
        try:
            report.save(path)
        except Exception as exc:  # disk full, a quota, the folder removed or made read-only mid-run
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            warn(f"memprof could not save {path} ({type(exc).__name__}: {exc}); training goes on, and the "
                 "callback's report keeps the profile in memory (cb.report.save(path) writes it elsewhere)")


def warn(message: str) -> None:
    """A :class:`MemprofWarning`: what memprof does on the side failed, and training goes on."""
    from ..errors import MemprofWarning

    # stacklevel 3: the callback method that called into memprof, not this helper.
    warnings.warn(message, MemprofWarning, stacklevel=3)
