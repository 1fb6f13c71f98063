"""Simulation: the same training step on meta tensors, through the same trackers.

``memprof.estimate(model, optimizer, inputs=..., loss_fn=...)`` copies the
model onto the ``meta`` device (no data is copied, so a 7-billion-parameter
configuration costs no real memory), rebuilds the optimizer on the copy,
and runs a few steps under :func:`memprof.profile` in exact mode. Autograd
saves exactly what it would save for real and every op output has its real
size, so saved activations and op-level temporaries are exact for this
PyTorch version. A CPU target runs on fake CPU tensors, whose kernels and
autocast are the CPU's, and gives the outputs of the few CPU kernels that keep
another storage than their shape that storage (:mod:`memprof.simulate.cpu_kernels`);
a CUDA target runs on meta tensors with CUDA's kernel
choices (:mod:`memprof.simulate.kernels`) and CUDA's autocast policy
(:mod:`memprof.simulate.autocast`) applied above them. The user's model, optimizer
and tensors are never modified.
"""

from __future__ import annotations

from torch import nn
from typing_extensions import Unpack

from .estimated import Estimate
from .run import EstimateOptions, OptimizerArg, RunConfig
from .stages import simulate

__all__ = ["Estimate", "estimate", "simulate"]


def estimate(model: nn.Module, optimizer: OptimizerArg = None, **options: Unpack[EstimateOptions]) -> Estimate:
    """Simulate ``steps`` training steps of ``model`` on meta tensors and return an :class:`Estimate`.

    ``optimizer`` is an optimizer built on ``model`` (its class and parameter
    groups are rebuilt on the meta copy), or a factory called with the meta
    copy's parameters (``lambda params: torch.optim.AdamW(params)``), or
    ``None``. ``inputs`` is what ``model`` is called with: a tensor, a tuple
    (unpacked as positional arguments) or a dict (keyword arguments); only
    shapes and dtypes matter. The loss is ``loss_fn(output, targets)`` (or
    ``loss_fn(output)`` without targets); without ``loss_fn`` it is the sum of
    the first output tensor. ``precision`` ``"bf16"``/``"fp16"``/``"fp32"``
    casts the copy's parameters; by default they keep their dtypes.
    ``"mixed"`` (``"amp"``) keeps them and runs the forward and the loss
    under bf16 autocast with the target device's policy, ``"mixed-fp16"``
    under fp16 autocast with a GradScaler around each step.
    ``device`` is the device the figures are for: ``"cuda"`` rounds every
    allocation to 512 bytes as the caching allocator does, and runs attention
    and dropout as a CUDA device does (the fused attention kernel torch would
    pick, saving its output and logsumexp rather than the s x s scores; 1-byte
    dropout masks): :mod:`memprof.simulate.kernels`. ``attention`` forces the
    kernel on a CUDA target: ``"flash"``, ``"efficient"`` or ``"math"``.
    ``world_size`` and ``parallel`` (``"ddp"``, ``"fsdp"``, ``"zero1"``, ``"zero2"``, ``"zero3"``) make
    the figures one rank's of a data-parallel job, in this one process: ``inputs`` is that rank's batch,
    and the model states and collective buffers are sharded as the layout does (:mod:`memprof.simulate.ranks`).
    ``parallel="fsdp1"`` runs FSDP1 itself (``FullyShardedDataParallel``: flat parameters, each block of the
    repeated stack a unit, ``FULL_SHARD``, ``use_orig_params=True``) on torch's fake process group
    (:mod:`memprof.simulate.fsdp1`); to simulate FSDP1 as your script configures it, pass your own function as
    ``parallelize``.
    ``routing`` is what a mixture-of-experts model's routers choose, which shape-only tensors cannot decide:
    ``"balanced"`` (default), ``"worst"``, ``"capacity=1.25"``, or a real run's routing (a report profiled
    with ``record_routing=True``, or per-call expert counts) replayed (:mod:`memprof.simulate.routing`).
    ``parallelize=fn`` runs your own ``fn(model, mesh) -> model`` instead (``fully_shard``,
    ``parallelize_module``, with their arguments) on a device mesh of ``world_size`` ranks (``mesh``: a tuple of
    sizes or ``{name: size}``; one dimension by default) on torch's fake process group, and gives rank ``rank``'s
    figures (:mod:`memprof.simulate.parallel`). ``pipeline=Pipeline(split, schedule, microbatches)`` cuts the
    model into pipeline stages along the mesh's ``pp`` dimension and runs torch's schedule on this rank's stage(s)
    (:mod:`memprof.simulate.pipeline`); without ``rank=`` every stage is simulated and the worst rank returned,
    with all of them in ``ranks``. ``extrapolate=k`` simulates the repeated stack of blocks cut to ``k``, ``k + 1``
    and ``k + 2`` blocks (per pipeline stage) and extends the figures to the model's depth when they grow by the
    same bytes per block, as they do once the peak stays put, and a CUDA target's allocation stream with them
    (:mod:`memprof.simulate.depth`); by default (None) a stack of 16 blocks or more per stage is simulated so
    with ``k`` 2, to the same figures as the whole model's, or whole where the checks say no; ``False`` simulates
    the whole model (its per-module tables then hold every block). ``processes``: how many processes, forked
    from this one, simulate a pipeline's rank classes without ``rank=`` (None: one each, at most twice the cores;
    1: all here; else unused).
    ``step_context`` is a function returning the context manager your training loop enters around forward, loss
    and backward (``loss_parallel``, ``context_parallel(...)``, a profiler range): it is entered afresh at each
    simulated step, the optimizer step outside it; under ``pipeline=`` around each step of torch's schedule, as
    torchtitan enters its train context around ``pp_schedule.step``. It is called with no argument when it takes
    none (``step_context=loss_parallel``), else with a :class:`~memprof.simulate.step.StepParts` holding the
    simulated ``model`` (a pipeline rank's stage module, or its stages in a ``ModuleList``), the ``mesh``, the
    step's ``inputs`` and ``targets`` (a pipeline rank's: None where its stages do not take them) and the
    ``optimizer``; a context manager class is such a function.

    ``train_step=fn`` simulates your own training step instead of memprof's loop (:mod:`memprof.simulate.user_step`):
    ``fn(model, optimizer, inputs)``, or ``fn(model, optimizer, inputs, targets)`` when ``targets`` is given, is
    called once per simulated step on the data-less twins (``model`` after your ``parallelize`` function, the
    optimizer rebuilt on it, ``inputs`` and ``targets`` as given, at the precision asked), as your loop calls it: it
    runs forward, loss, backward and the optimizer step itself, with whatever it does besides (clipping, gradient
    accumulation, a scheduler, loss scaling, an EMA copy, gradient hooks, ``zero_grad(set_to_none=False)``). What it
    returns is held until the next call returns, as ``out = fn(...)`` in a loop holds it, the last until the loop
    ends: return the logits and they are held through the next step's forward. State your loop keeps beside the step
    (a scheduler, an EMA copy, hooks) is built by ``fn`` on the model and optimizer it is handed, at its first call.
    A value it reads from a tensor outside the model's forward (``loss.item()``, a GradScaler's ``found_inf``) is
    answered 0, which takes every optimizer step, and the notes say where; with ``precision="mixed"`` (or
    ``"mixed-fp16"``) each call of the model runs under the target's autocast and the rest of ``fn`` as written.
    ``loss_fn``, ``step_context`` and ``pipeline`` are memprof's loop's and are refused with it. An exception ``fn``
    raises reaches you unchanged, but torch's ``RuntimeError`` and ``NotImplementedError`` (an op shape-only tensors
    cannot run), explained as a :class:`~memprof.errors.SimulationError` chained to them, as from the model.

    ``loop`` names a framework's own training step to simulate in place of memprof's loop
    (:mod:`memprof.simulate.loops`): ``"hf-trainer"`` (transformers' ``Trainer.training_step`` and ``compute_loss``
    as installed, with its clipping at ``max_grad_norm=1.0``, ``model.zero_grad()`` and the loss it keeps for
    logging; ``inputs`` the batch dict with its labels), ``"accelerate"`` (``Accelerator.backward`` and
    ``clip_grad_norm_``, ``zero_grad()`` at the top of the step; ``loss_fn`` as above, else the model's own loss),
    ``"plain"`` (memprof's loop, the default). ``"lightning"`` and ``"torchtitan"`` are refused, saying why. Another
    accumulation or clipping: ``train_step=memprof.simulate.loops.loop_step("hf-trainer",
    gradient_accumulation_steps=4)``.
    """
    return simulate(RunConfig.from_options(model, optimizer, **options))
