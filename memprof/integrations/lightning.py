"""memprof in Lightning: a ``lightning.pytorch.Callback`` that profiles ``trainer.fit()``.

    from memprof.integrations.lightning import MemprofCallback

    cb = MemprofCallback(schedule=memprof.schedule(wait=10, active=2))
    trainer = L.Trainer(max_steps=100, callbacks=[cb])
    trainer.fit(module, data)
    print(cb.report)

Phases are right under automatic optimisation (where forward and backward run inside
``optimizer.step(closure)``), manual optimisation and gradient accumulation. After each training
batch whose step was recorded, ``memprof/peak_bytes`` and ``memprof/<category>_bytes`` go to the
Trainer's loggers at the step's global step.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import MissingExtraError, is_interrupt
from . import Session, require, warn

try:
    import lightning
    from lightning.pytorch import Callback
except ImportError as failure:  # pragma: no cover - the extra is missing
    if is_interrupt(failure):
        raise  # a signal handler's exception (errors.is_interrupt) is the user's
    raise MissingExtraError(
        "memprof.integrations.lightning needs lightning; install it with pip install 'torch-memprof[lightning]'"
    ) from None

if TYPE_CHECKING:
    from torch import nn

    from ..collect.aliases import FrameworkObject
    from ..collect.schedule import Schedule

__all__ = ["MemprofCallback"]

require("lightning", "lightning", (2, 0), lightning.__version__)


class MemprofCallback(Session, Callback):
    """Profile ``trainer.fit()``: the LightningModule and the Trainer's optimizers, from the start of
    training to its end (also when it raises). ``mode`` and ``schedule`` are those of
    :func:`memprof.profile`; with ``save_dir`` the report is saved there at the end
    (``memprof-rank<N>.json``) and, with a schedule, after each recorded window. :attr:`report`
    holds the report after training."""

    def __init__(self, *, mode: str = "auto", schedule: "Schedule | None" = None,
                 save_dir: "str | os.PathLike[str] | None" = None, timeline: bool = False,
                 oom_dump: "str | os.PathLike[str] | None" = None) -> None:
        Callback.__init__(self)
        Session.__init__(self, mode=mode, schedule=schedule, save_dir=save_dir, timeline=timeline,
                         oom_dump=oom_dump)

    def on_train_start(self, trainer: "FrameworkObject", pl_module: "nn.Module") -> None:
        self.begin(pl_module, list(trainer.optimizers), int(getattr(trainer, "global_rank", 0) or 0))

    def on_train_batch_start(self, trainer: "FrameworkObject", pl_module: "nn.Module", batch: object,
                             batch_idx: int) -> None:
        prof = self.profiler
        if prof is None or not prof.running:
            return
        try:
            # The batch training_step gets, on its device: its inputs. memprof sees no call of the module
            # with it (training_step calls submodules, or is compiled when fit() was given torch.compile's
            # wrapper), so without this the batch would count as temporaries.
            prof.mark_inputs(batch)
        except Exception as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            self.give_up(exc)

    def on_train_batch_end(self, trainer: "FrameworkObject", pl_module: "nn.Module", outputs: object, batch: object,
                           batch_idx: int) -> None:
        # Closes the step if its optimizer stepped in this batch (not mid-accumulation).
        metrics = self.step_ended()
        if not metrics:
            return
        for logger in trainer.loggers:
            try:
                logger.log_metrics(dict(metrics), step=max(0, trainer.global_step - 1))
            except Exception as exc:  # memprof's figures are a side output: a logger refusing them ends nothing
                if is_interrupt(exc):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                warn(f"memprof could not log its metrics to {type(logger).__name__} ({type(exc).__name__}: {exc}); "
                     "training goes on")

    def on_train_end(self, trainer: "FrameworkObject", pl_module: "nn.Module") -> None:
        self.stop()

    def on_exception(self, trainer: "FrameworkObject", pl_module: "nn.Module", exception: BaseException) -> None:
        self.stop(exception)  # every hook is removed; the report holds what was measured until then

