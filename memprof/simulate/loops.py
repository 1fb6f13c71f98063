"""The training loops people run, by name: ``estimate(..., loop="hf-trainer")``.

Each named loop is a training step (:mod:`memprof.simulate.user_step` runs it on the shape-only twins) built from
the framework's OWN code of the installed version, called as functions on a small object that holds only the
attributes that code reads, rather than an imitation of it:

- ``"plain"``: memprof's own loop (:class:`memprof.simulate.step.TrainingStep`); the default of ``estimate``.
- ``"hf-trainer"``: transformers' ``Trainer`` (:class:`HfTrainerStep`): its ``training_step``, ``compute_loss``,
  ``_get_num_items_in_batch``, ``_clip_grad_norm`` and ``_get_grad_norm`` run as they are, on top of accelerate's
  ``Accelerator.backward`` and ``Accelerator.clip_grad_norm_``; the inner loop around them (``_inner_training_loop``,
  which needs a data loader and callbacks) is followed line by line. The default of ``estimate_hf`` and ``plan_hf``.
- ``"accelerate"``: the loop of accelerate's documentation (:class:`AccelerateStep`): ``Accelerator.backward``,
  ``Accelerator.clip_grad_norm_`` and the optimizer's ``zero_grad()`` at the start of the step.
- ``"lightning"`` and ``"torchtitan"`` are refused, naming why (:func:`loop_step`).

No named loop creates an ``Accelerator`` or a ``Trainer``: both set process-wide state (accelerate's
``AcceleratorState`` singleton), which an estimate must not leave behind in the user's process.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import TYPE_CHECKING, Callable

from ..errors import InvalidArgumentError, MissingExtraError, UnknownNameError, is_interrupt

if TYPE_CHECKING:  # the command line reads LOOPS without importing torch
    import torch
    from torch import nn

    from .aliases import Library, UserValue

__all__ = ["LOOPS", "check_loop", "loop_step", "HfTrainerStep", "AccelerateStep", "transformers_version_note"]

#: The loops ``loop=`` names.
LOOPS = ("plain", "hf-trainer", "accelerate", "lightning", "torchtitan")


def check_loop(loop: object) -> "str | None":
    """``loop`` if it names a loop (None stays None), else one error listing them."""
    if loop is None:
        return None
    if not isinstance(loop, str) or loop not in LOOPS:
        raise UnknownNameError(f"unknown loop {loop!r}; use one of: {', '.join(LOOPS)} (or train_step=your function)")
    return loop


def loop_step(loop: "str | None", *, precision: "str | None" = None,
              loss_fn: "Callable[..., torch.Tensor] | None" = None, gradient_accumulation_steps: int = 1,
              max_grad_norm: float = 1.0) -> "Callable[..., object] | None":
    """The training step of the loop ``loop`` names (None for ``"plain"``: memprof's own loop runs), configured
    as the framework's defaults are: ``max_grad_norm`` 1.0 (``TrainingArguments.max_grad_norm``),
    ``gradient_accumulation_steps`` 1. A framework that is not installed is a :class:`MissingExtraError` naming the
    extra; a loop that cannot be run on shape-only tensors is refused, saying why."""
    loop = check_loop(loop)
    if loop in (None, "plain"):
        return None
    if isinstance(gradient_accumulation_steps, bool) or not isinstance(gradient_accumulation_steps, int) \
            or gradient_accumulation_steps < 1:
        raise InvalidArgumentError(f"gradient_accumulation_steps must be a positive int, got "
                                   f"{gradient_accumulation_steps!r}")
    if precision == "mixed-fp16" and loop in ("hf-trainer", "accelerate"):
        raise InvalidArgumentError(f"loop={loop!r} with precision='mixed-fp16' (accelerate's GradScaler path) is not "
                                   "simulated; use precision='mixed' (bf16), loop='plain' (memprof's own loop and its "
                                   "GradScaler), or train_step= with your own GradScaler")
    mixed = precision in ("mixed", "amp")
    if loop == "hf-trainer" and loss_fn is not None:
        raise InvalidArgumentError("loop='hf-trainer' computes its loss as the Trainer does (Trainer.compute_loss: "
                                   "the model's own loss from the batch's labels); leave loss_fn out")
    if loop == "hf-trainer":
        return HfTrainerStep(gradient_accumulation_steps=gradient_accumulation_steps, max_grad_norm=max_grad_norm,
                             mixed=mixed, loss_fn=loss_fn)
    if loop == "accelerate":
        return AccelerateStep(gradient_accumulation_steps=gradient_accumulation_steps, max_grad_norm=max_grad_norm,
                              mixed=mixed, loss_fn=loss_fn)
    if loop == "lightning":
        _imported("lightning", "lightning")
        raise InvalidArgumentError(
            "loop='lightning' is not simulated: Lightning's automatic optimization (_AutomaticOptimization: "
            "training_step, zero_grad, backward inside optimizer.step(closure)) runs only inside Trainer.fit, which "
            "cannot be driven on shape-only tensors; write the step as train_step=fn (optimizer.step(closure) with "
            "your LightningModule.training_step inside the closure, zero_grad before backward)")
    raise MissingExtraError("loop='torchtitan' needs torchtitan, which is not installed here and has no pip extra of "
                            "memprof; its train step (torchtitan/train.py) is not simulated: write it as "
                            "train_step=fn")


def _imported(module: str, extra: str) -> types.ModuleType:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if is_interrupt(exc):
            raise
        raise MissingExtraError(f"this loop calls {module}'s own code, and {module} is not installed; pip install "
                                f"'torch-memprof[{extra}]' (or pip install {module})") from None


def _borrowed(cls: type, names: "tuple[str, ...]", version: str) -> "dict[str, Callable[..., object]]":
    """The functions ``names`` of ``cls``, as they are in the installed version (to be called on a small object),
    or one error naming what this version lacks."""
    missing = [name for name in names if not callable(getattr(cls, name, None))]
    if missing:
        raise MissingExtraError(f"{cls.__module__}.{cls.__qualname__} {version} has no {', '.join(missing)}: the "
                                "named loop calls them; install the version memprof supports, or use train_step=")
    return {name: getattr(cls, name) for name in names}


def _device_of(inputs: "UserValue") -> "torch.device":
    import torch

    found = [t for t in (inputs.values() if isinstance(inputs, dict) else
                         inputs if isinstance(inputs, (tuple, list)) else (inputs,)) if isinstance(t, torch.Tensor)]
    return found[0].device if found else torch.device("cpu")


# ------------------------------------------------------------------------------------------------------ accelerate

def accelerator_shell(gradient_accumulation_steps: int = 1) -> "Library":
    """An object of a class whose ``backward``, ``clip_grad_norm_``, ``unscale_gradients``,
    ``_clip_grad_norm_dtensor_aware`` and ``unwrap_model`` are ``accelerate.Accelerator``'s own, holding what they
    read for one process without DeepSpeed, FSDP, XLA or a GradScaler (``DistributedType.NO``)."""
    accelerate = _imported("accelerate", "accelerate")
    from accelerate.utils import DistributedType

    names = ("backward", "clip_grad_norm_", "unscale_gradients", "_clip_grad_norm_dtensor_aware", "unwrap_model")
    shell = type("AcceleratorShell", (), _borrowed(accelerate.Accelerator, names, accelerate.__version__))()
    shell.__dict__.update(distributed_type=DistributedType.NO, gradient_accumulation_steps=gradient_accumulation_steps,
                          scaler=None, has_lomo_optimizer=False, native_amp=False, mixed_precision="no",
                          parallelism_config=None, sync_gradients=True, num_processes=1, _models=[], _optimizers=[])
    return shell


def fp32_outputs(model: "nn.Module") -> None:
    """Under mixed precision accelerate's ``prepare_model`` wraps the forward in ``convert_outputs_to_fp32``: the
    model's half-precision outputs (its logits) come back as fp32 copies. Done here as a forward hook, after the
    autocast region of the call ends, as accelerate's wrapper sits outside its autocast."""
    from accelerate.utils.operations import convert_to_fp32

    model.register_forward_hook(lambda module, args, output: convert_to_fp32(output))


@dataclasses.dataclass(eq=False)
class _Loop:
    """What a named loop keeps per run (per optimizer: each estimate hands a new twin and optimizer)."""

    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    mixed: bool = False
    loss_fn: "Callable[..., torch.Tensor] | None" = None
    optimizer: "torch.optim.Optimizer | None" = dataclasses.field(default=None, repr=False)

    def _started(self, model: "nn.Module", optimizer: "torch.optim.Optimizer | None", inputs: "UserValue") -> bool:
        """Whether this call starts a new run (a new optimizer); the loop's state is made afresh for it."""
        if optimizer is self.optimizer and optimizer is not None:
            return False
        self.optimizer = optimizer
        if self.mixed:
            fp32_outputs(model)
        return True

    def _loss(self, model: "nn.Module", inputs: "UserValue", targets: "UserValue") -> "torch.Tensor":
        if isinstance(inputs, dict):
            outputs = model(**inputs)
        elif isinstance(inputs, tuple):
            outputs = model(*inputs)
        else:
            outputs = model(inputs)
        if self.loss_fn is not None:
            return self.loss_fn(outputs, targets) if targets is not None else self.loss_fn(outputs)
        loss: "torch.Tensor | None" = outputs["loss"] if isinstance(outputs, dict) else getattr(outputs, "loss", None)
        if loss is None:
            raise InvalidArgumentError("the loop takes the model's own loss (outputs.loss, from labels in the batch "
                                       "dict); this model returned none: give loss_fn=")
        return loss


class AccelerateStep(_Loop):
    """The loop of accelerate's documentation (``accelerate/README.md``, "Accelerate" example, and
    ``Accelerator.accumulate``), one optimizer step per call::

        optimizer.zero_grad()                       # at the top: the last step's gradients live until here
        for micro-batch in range(gradient_accumulation_steps):
            loss = model(**batch).loss              # or loss_fn(model(x), y)
            accelerator.backward(loss)              # Accelerator.backward: divides by the accumulation steps
        accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()

    ``backward`` and ``clip_grad_norm_`` are accelerate's own (:func:`accelerator_shell`); ``zero_grad()`` is the
    optimizer's (``AcceleratedOptimizer.zero_grad`` hands on to it with torch's default, ``set_to_none=True``)."""

    def __call__(self, model: "nn.Module", optimizer: "torch.optim.Optimizer | None", inputs: "UserValue",
                 targets: "UserValue" = None) -> "torch.Tensor | None":
        if self._started(model, optimizer, inputs):
            self.accelerator: "Library" = accelerator_shell(self.gradient_accumulation_steps)
        if optimizer is not None:
            optimizer.zero_grad()
        loss = None
        for _ in range(self.gradient_accumulation_steps):
            loss = self._loss(model, inputs, targets)
            self.accelerator.backward(loss)
        if self.max_grad_norm > 0:
            self.accelerator.clip_grad_norm_(model.parameters(), self.max_grad_norm)
        if optimizer is not None:
            optimizer.step()
        return loss

    def loop_notes(self, calls: int) -> "list[str]":
        import accelerate
        import torch

        return [f"the training loop: accelerate's ({accelerate.__version__}, torch {torch.__version__}), "
                f"{calls} optimizer step{'s' if calls != 1 else ''}: optimizer.zero_grad() at the top of each "
                f"(the last step's gradients live through the next forward), "
                f"{self.gradient_accumulation_steps} forward and Accelerator.backward per step, "
                f"Accelerator.clip_grad_norm_(max_norm={self.max_grad_norm}), optimizer.step(); the loss held "
                "until the next step's replaces it"] + _mixed_note(self.mixed)


def _mixed_note(mixed: bool) -> "list[str]":
    return ["mixed precision: each model call under autocast and its half-precision outputs copied to fp32 (as "
            "accelerate's convert_outputs_to_fp32 does)"] if mixed else []


def transformers_version_note(config: object) -> "list[str]":
    """A note when ``config`` was written by a transformers whose major or minor version differs from the installed
    one (whose code paths the simulation runs)."""
    written = getattr(config, "transformers_version", None)
    try:
        import transformers
    except ImportError as exc:
        if is_interrupt(exc):
            raise
        return []
    if not isinstance(written, str) or not written:
        return []
    mine = transformers.__version__
    if written.split(".")[:2] == mine.split(".")[:2]:
        return []
    return [f"the config was written by transformers {written}; the simulation ran the installed transformers {mine}, "
            "whose code paths (attention, caches, the loss) may differ from that version's"]


# ----------------------------------------------------------------------------------------------------- HF Trainer

#: The ``Trainer`` functions the loop calls as they are in the installed transformers.
_TRAINER_FUNCTIONS = ("training_step", "compute_loss", "compute_loss_context_manager", "autocast_smart_context_manager",
                      "_prepare_input", "_prepare_inputs", "_prepare_context_parallel_inputs",
                      "_get_num_items_in_batch", "get_tp_size", "get_cp_size", "get_sp_size", "_clip_grad_norm",
                      "_has_mixed_mesh_grads", "_mixed_mesh_grad_norm", "_get_grad_norm")


def trainer_shell(model: "nn.Module", optimizer: "torch.optim.Optimizer | None", device: "torch.device",
                  gradient_accumulation_steps: int, max_grad_norm: float) -> "Library":
    """An object of a class whose methods :data:`_TRAINER_FUNCTIONS` are ``transformers.Trainer``'s own, holding the
    attributes they read as ``Trainer.__init__`` sets them for ``model`` on one process: ``args`` the
    ``TrainingArguments`` dataclass's defaults (read from its fields, not constructed: constructing it sets up
    accelerate's process-wide state) with ``max_grad_norm`` and ``gradient_accumulation_steps``,
    ``model_accepts_loss_kwargs`` and ``_loss_shifts_labels`` computed as ``__init__`` computes them, no label
    smoother (``label_smoothing_factor`` 0), no ``compute_loss_func``, and an accelerator of accelerate's own
    ``backward`` and ``clip_grad_norm_`` (:func:`accelerator_shell`, one accumulation step: the Trainer's
    ``create_accelerator_and_postprocess`` sets ``num_steps=1`` and scales the loss itself)."""
    transformers = _imported("transformers", "transformers")
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    Trainer = transformers.Trainer
    shell = type("TrainerShell", (), _borrowed(Trainer, _TRAINER_FUNCTIONS, transformers.__version__))()
    defaults = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)
                if f.default is not dataclasses.MISSING}
    args = types.SimpleNamespace(**{**defaults, "max_grad_norm": max_grad_norm, "label_smoothing_factor": 0.0,
                                    "gradient_accumulation_steps": gradient_accumulation_steps, "n_gpu": 1,
                                    "world_size": 1, "device": device})
    if hasattr(model, "accepts_loss_kwargs"):  # Trainer.__init__, "Model introspection"
        accepts = bool(model.accepts_loss_kwargs)
    else:
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD
                      for p in inspect.signature(model.forward).parameters.values())
    loss_type: "str | None" = getattr(model, "loss_type", None)  # a transformers model's (None: no loss type named)
    # (transformers types the mapping's keys str; a model that names no loss type looks up None, as Trainer does)
    shifts = (LOSS_MAPPING.get(loss_type) is ForCausalLMLoss  # type: ignore[arg-type]
              and not getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    shell.__dict__.update(args=args, model=model, model_wrapped=model, optimizer=optimizer,
                          accelerator=accelerator_shell(1), state=types.SimpleNamespace(global_step=0),
                          label_smoother=None, compute_loss_func=None, model_accepts_loss_kwargs=accepts,
                          loss_is_scaled_for_ga=None, _loss_shifts_labels=shifts, is_deepspeed_enabled=False,
                          is_model_parallel=False, _mixed_mesh_grads=None,
                          current_gradient_accumulation_steps=gradient_accumulation_steps)
    return shell


class HfTrainerStep(_Loop):
    """One optimizer step of transformers' ``Trainer`` (``Trainer._inner_training_loop`` of the installed version,
    its lines followed in order), the functions it calls run as they are (:func:`trainer_shell`)::

        # once, before the first step:  self._tr_loss = torch.tensor(0.0, device=args.device); model.zero_grad()
        num_items_in_batch = self._get_num_items_in_batch(batch_samples, device)
        for inputs in batch_samples:                        # gradient_accumulation_steps micro-batches
            tr_loss_step = self.training_step(model, inputs, num_items_in_batch)
            if torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step): ...    # logging_nan_inf_filter
            else: self._tr_loss += tr_loss_step
        grad_norm = self._clip_grad_norm(model)             # max_grad_norm > 0
        grad_norm = self._get_grad_norm(model, grad_norm=grad_norm)
        self.optimizer.step()
        model.zero_grad()                                   # nn.Module.zero_grad(): set_to_none=True

``training_step`` runs ``compute_loss`` (the model's own loss from the batch's labels, with the number of label
tokens when the model takes loss kwargs), divides by the accumulation steps where the loss is not already scaled,
calls ``Accelerator.backward`` and returns ``loss.detach()``, held with ``grad_norm`` and ``num_items_in_batch`` as
the loop's locals hold them, until the next step replaces them. Left out, because they hold no tensor: callbacks,
the learning-rate scheduler's ``step()`` (a LambdaLR of Python floats), ``floating_point_ops``, the token count
(``include_num_input_tokens_seen`` is "no" by default) and logging (every ``logging_steps``, 500 by default)."""

    def __call__(self, model: "nn.Module", optimizer: "torch.optim.Optimizer | None", inputs: "UserValue",
                 targets: "UserValue" = None) -> "torch.Tensor | None":
        import torch

        if not isinstance(inputs, dict) or targets is not None:
            raise InvalidArgumentError("loop='hf-trainer' feeds the Trainer's batches: inputs= a dict of the model's "
                                       "keyword arguments with its labels (input_ids, labels), and no targets=")
        device = _device_of(inputs)
        if self._started(model, optimizer, inputs):
            self.trainer: "Library" = trainer_shell(model, optimizer, device, self.gradient_accumulation_steps,
                                         self.max_grad_norm)
            self.tr_loss = torch.tensor(0.0, device=device)
            model.zero_grad()
            self.grad_norm: object = None  # held as the loop's local holds it
            self.num_items: object = None
        trainer, gas = self.trainer, self.gradient_accumulation_steps
        batches = [inputs] * gas
        self.num_items = trainer._get_num_items_in_batch(batches, device)
        step: "torch.Tensor | None" = None
        for batch in batches:
            step = trainer.training_step(model, batch, self.num_items)
            if torch.isnan(step) or torch.isinf(step):  # args.logging_nan_inf_filter (True by default)
                self.tr_loss += self.tr_loss / (1 + trainer.state.global_step)
            else:
                self.tr_loss += step
        self.grad_norm = None  # the loop's `grad_norm = None` at the sync step: the last step's is let go here
        grad_norm = trainer._clip_grad_norm(model) if trainer.args.max_grad_norm > 0 else None
        self.grad_norm = trainer._get_grad_norm(model, grad_norm=grad_norm)
        if optimizer is not None:
            optimizer.step()
        model.zero_grad()
        trainer.state.global_step += 1
        return step

    def loop_notes(self, calls: int) -> "list[str]":
        import accelerate
        import torch
        import transformers

        gas, steps = self.gradient_accumulation_steps, f"{calls} optimizer step{'s' if calls != 1 else ''}"
        micro = f"{gas} micro-batch{'es' if gas != 1 else ''} per step"
        return [f"the training loop: the HF Trainer's (transformers {transformers.__version__}, torch "
                f"{torch.__version__}), {steps}: Trainer.training_step, compute_loss (the model's own loss from the "
                "labels), _get_num_items_in_batch, _clip_grad_norm and _get_grad_norm of the installed "
                "transformers/trainer.py as they are, on Accelerator.backward and clip_grad_norm_ of "
                f"accelerate/accelerator.py ({accelerate.__version__}); Trainer._inner_training_loop followed: "
                f"{micro}, clipping at max_grad_norm={self.max_grad_norm}, optimizer.step(), model.zero_grad() "
                "(set_to_none); loss.detach(), the summed loss and the gradient norm held as the loop holds them; "
                "TrainingArguments' defaults assumed, no scheduler, callbacks or logging (they hold no tensor)"] \
            + _mixed_note(self.mixed)
