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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..trace import StepRecord

__all__ = ["step_metrics", "require"]

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
