"""memprof in the HF ``Trainer``: a ``TrainerCallback`` that profiles the whole ``trainer.train()``.

    from memprof.integrations.transformers import MemprofCallback

    cb = MemprofCallback(schedule=memprof.schedule(wait=10, active=2), save_dir="memprof")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    trainer.train()
    print(cb.report)

Each logged step gets ``memprof/peak_bytes`` and ``memprof/<category>_bytes`` in the Trainer's logs,
so they reach TensorBoard, W&B or whatever ``report_to`` chose.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import torch

from ..errors import MissingExtraError, is_interrupt
from . import Session, require

try:
    import transformers
    from transformers import TrainerCallback
except ImportError as failure:  # pragma: no cover - the extra is missing
    if is_interrupt(failure):
        raise  # a signal handler's exception (errors.is_interrupt) is the user's
    raise MissingExtraError(
        "memprof.integrations.transformers needs transformers; install it with "
        "pip install 'torch-memprof[transformers]'") from None

if TYPE_CHECKING:
    from types import FrameType

    from ..collect.aliases import FrameworkObject
    from ..collect.schedule import Schedule

__all__ = ["MemprofCallback"]

require("transformers", "transformers", (4, 36), transformers.__version__)


class MemprofCallback(Session, TrainerCallback):
    """Profile ``trainer.train()``: the model the Trainer calls (``trainer.model_wrapped``, the
    ``torch.compile`` wrapper with ``torch_compile=True``) and its optimizer (followed through
    accelerate's wrapper), from ``on_train_begin`` to ``on_train_end``.

    ``mode`` and ``schedule`` are those of :func:`memprof.profile`. With ``save_dir`` the report is
    saved there at the end (``memprof-rank<N>.json``) and, with a schedule, after each recorded
    window (``memprof-rank<N>-steps-<a>-<b>.json``). :attr:`report` holds the report after training.
    If ``train()`` raises, call :meth:`stop` (the Trainer has no event for it).
    """

    def __init__(self, *, mode: str = "auto", schedule: "Schedule | None" = None,
                 save_dir: "str | os.PathLike[str] | None" = None, timeline: bool = False,
                 oom_dump: "str | os.PathLike[str] | None" = None) -> None:
        Session.__init__(self, mode=mode, schedule=schedule, save_dir=save_dir, timeline=timeline,
                         oom_dump=oom_dump)
        self._metrics: dict[str, int] = {}

    # -- the Trainer's events -------------------------------------------------------------

    def on_train_begin(self, args: "FrameworkObject", state: "FrameworkObject", control: "FrameworkObject",
                       model: "FrameworkObject" = None, optimizer: "FrameworkObject" = None, **kwargs: object) -> None:
        caller = sys._getframe(1)
        self._log_first(caller)
        # A second train() on the same callback: the first profile ends here.
        self.begin(_called_model(caller, model), optimizer, int(getattr(args, "process_index", 0) or 0))

    def on_step_end(self, args: "FrameworkObject", state: "FrameworkObject", control: "FrameworkObject",
                    **kwargs: object) -> None:
        # Every optimizer of this step has stepped: its record closes now. Only a step recorded since the
        # last one logged has metrics (a schedule leaves the others out).
        self._metrics = self.step_ended()

    def on_log(self, args: "FrameworkObject", state: "FrameworkObject", control: "FrameworkObject",
               logs: "dict[str, object] | None" = None, **kwargs: object) -> None:
        if logs is not None and self._metrics and "loss" in logs:
            logs.update(self._metrics)  # a training log line: this step's memory beside its loss
            history = getattr(state, "log_history", None)
            if history and history[-1].get("step") == state.global_step and "loss" in history[-1]:
                history[-1].update(self._metrics)  # and in trainer.state.log_history (trainer_state.json)

    def on_train_end(self, args: "FrameworkObject", state: "FrameworkObject", control: "FrameworkObject",
                     **kwargs: object) -> None:
        self.stop()

    # -- ending -------------------------------------------------------------------------

    def stop(self, error: "BaseException | None" = None) -> None:
        """End the profile if it runs (the Trainer calls this through ``on_train_end``); keep its report.
        The Trainer calls no callback when ``train()`` raises: call ``cb.stop(exc)`` in your ``except``,
        which records the exception (and writes the OOM dump with ``oom_dump=``)."""
        Session.stop(self, error)

    def _log_first(self, frame: "FrameType | None") -> None:
        """Run this callback's ``on_log`` before the reporting callbacks', which read the same ``logs``:
        the Trainer calls callbacks in the order they were added, and user callbacks come last."""
        handler = frame.f_locals.get("self") if frame is not None else None
        callbacks = getattr(handler, "callbacks", None)
        if isinstance(callbacks, list) and self in callbacks and callbacks[0] is not self:
            callbacks.remove(self)
            callbacks.insert(0, self)


def _called_model(frame: "FrameType | None", model: "FrameworkObject") -> "FrameworkObject":
    """The module the Trainer's loop calls: ``trainer.model_wrapped``, what accelerate's ``prepare`` returned
    (the ``torch.compile`` wrapper with ``torch_compile=True``, DDP across processes), of the Trainer whose
    ``train()`` runs this event; ``model`` (the Trainer's own, which callbacks are handed) where there is
    none. The unwrapped model runs inside the wrapper's compiled code, where its hooks are skipped: profiled
    alone, its forward would be unseen."""
    for _ in range(8):  # the Trainer's loop, then CallbackHandler.on_train_begin and call_event
        if frame is None:
            break
        trainer = frame.f_locals.get("self")
        if isinstance(trainer, transformers.Trainer):
            called = getattr(trainer, "model_wrapped", None)
            return called if isinstance(called, torch.nn.Module) else model
        frame = frame.f_back
    return model
