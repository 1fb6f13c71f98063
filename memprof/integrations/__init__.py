"""memprof inside the frameworks people train with.

Each integration imports its framework only when it is itself imported, and needs that framework's
extra (``pip install 'torch-memprof[transformers]'``, ``[lightning]``):

* :mod:`memprof.integrations.transformers` -- ``MemprofCallback`` for the HF ``Trainer``;
* :mod:`memprof.integrations.lightning` -- ``MemprofCallback`` for ``lightning.pytorch.Trainer``.

accelerate needs none: profile what ``accelerator.prepare`` returns (see docs/integrations/accelerate.md).
An integration drives the public API only (``memprof.Profiler``, ``start``, ``end_step``,
``latest_step``, ``stop``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..profiler import Profiler
    from ..report import Report
    from ..schedule import Schedule
    from ..trace import StepRecord

__all__ = ["step_metrics", "require", "Session"]

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


def require(module: str, extra: str, minimum: "tuple[int, ...]", installed: Any) -> None:
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
    ``save_dir``, and end it, with the exception that ended training if one did."""

    def __init__(self, *, mode: str = "auto", schedule: "Schedule | None" = None,
                 save_dir: "str | os.PathLike[str] | None" = None, timeline: bool = False,
                 oom_dump: "str | os.PathLike[str] | None" = None) -> None:
        self.mode = mode
        self.schedule = schedule
        self.save_dir = os.fspath(save_dir) if save_dir is not None else None
        self.timeline = timeline
        self.oom_dump = oom_dump
        self.profiler: "Profiler | None" = None
        self.report: "Report | None" = None
        self._logged: "int | None" = None
        self._rank = 0

    def begin(self, model: Any, optimizers: Any, rank: int) -> None:
        """Start profiling ``model`` (what the framework trains) and its ``optimizers``."""
        from ..profiler import Profiler

        self.stop()
        self._rank = rank
        if self.save_dir is not None:
            os.makedirs(self.save_dir, exist_ok=True)
        on_ready = self._save_window if (self.save_dir is not None and self.schedule is not None) else None
        self.report = None
        self._logged = None
        self.profiler = Profiler(model, optimizers, mode=self.mode, timeline=self.timeline, schedule=self.schedule,
                                 on_trace_ready=on_ready, oom_dump=self.oom_dump)
        self.profiler.start()

    def stop(self, error: "BaseException | None" = None) -> None:
        """End the profile if it runs and keep its report; ``error``: the exception that ended training,
        recorded in the report (and written as an OOM dump with ``oom_dump=``)."""
        prof, self.profiler = self.profiler, None
        if prof is None or not prof.running:
            return
        prof.stop(error)
        self.report = prof.report()
        if self.save_dir is not None:
            self.report.save(os.path.join(self.save_dir, f"memprof-rank{self._rank}.json"))

    def _save_window(self, prof: "Profiler") -> None:
        assert self.save_dir is not None and prof.window is not None
        a, b = prof.window
        prof.report().save(os.path.join(self.save_dir, f"memprof-rank{self._rank}-steps-{a}-{b}.json"))
