"""The user's own training step in a simulation (``estimate(..., train_step=fn)``).

memprof's own loop (:class:`memprof.simulate.step.TrainingStep`) runs forward, loss, backward, step and
``zero_grad()`` and keeps only the loss. A real loop does more, and what it does decides the peak as much as the
model: it keeps the output across steps, clips, accumulates, scales the loss, keeps an EMA copy, hooks gradients,
zeroes gradients in place, logs ``loss.item()``. :class:`UserStep` runs the user's function instead, on the
shape-only twins, once per simulated step, as their loop calls it::

    for batch in loader:
        out = train_step(model, optimizer, batch)            # without targets=
        out = train_step(model, optimizer, batch, targets)   # with targets=

What the function returns is held until the next call returns (the ``out =`` of that loop), the last value until
the loop ends. Under mixed precision each call of the model runs under the target's autocast.

Shape-only tensors hold no values: a value the step reads outside the model's forward (``loss.item()``,
``float(norm)``, a GradScaler's ``found_inf.item()``) is answered 0 by :class:`LoopValues`, and the notes say
where. A value the model reads inside its forward is still refused, as without ``train_step``.
"""

from __future__ import annotations

import contextlib
import inspect
import traceback
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from ..errors import InvalidArgumentError, is_interrupt

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from torch._ops import OpOverload

    from ..collect.simulated import SimulatedProfile
    from .aliases import OpValue, UserValue
    from .autocast import AutocastFactory, CudaAutocast

__all__ = ["UserStep", "LoopValues", "check_train_step", "check_arity", "LOOP_READS"]

_aten = torch.ops.aten
#: The ops that hand a tensor's value to Python: ``item()``, ``float()``, ``int()`` (``_local_scalar_dense``),
#: ``bool()`` (``is_nonzero``).
READS = {_aten._local_scalar_dense.default: "item()", _aten.is_nonzero.default: "bool()"}


#: The reads one place of a step's code may have answered in one step with no backward pass between them. Each is
#: answered 0 (False), so a loop that stops on a value (``generate()``'s stop test, ``while not done.item()``) never
#: stops on shape-only tensors: the estimate ran for as long as it was let (2,161 decoding steps a minute for a step
#: whose real loop made 4, a new user's sweep). A loop with a backward in each round (accumulation logging each
#: micro-batch's ``loss.item()``) progresses, and is counted afresh after each; a real step that reads one place
#: more often than this without one is refused with it.
LOOP_READS = 256


def _endless(key: "tuple[str, str]", failure: BaseException) -> Exception:
    from ..errors import SimulationError

    what, where = key
    error = SimulationError(
        f"the training step read a value ({what}) at {where} more than {LOOP_READS:,} times in one simulated step "
        f"with no backward pass between them: "
        f"shape-only tensors hold no values, each read is answered 0 (False), and a loop that stops on a value "
        f"(model.generate()'s stop test, a while loop on a tensor) never stops; simulate the step with the "
        f"sequences it makes given at their final length (generate's part: memprof.estimate_generation), or "
        f"profile the real run (memprof.profile)")
    error.__cause__ = failure
    return error


def check_train_step(fn: object) -> "Callable[..., object] | None":
    """``fn`` if it can be called as a training step; None stays None."""
    if fn is None:
        return None
    if not callable(fn) or isinstance(fn, (nn.Module, torch.optim.Optimizer)):
        raise InvalidArgumentError(
            f"train_step must be the function your loop calls once per step, train_step(model, optimizer, batch) "
            f"(with targets=: train_step(model, optimizer, batch, targets)), got {type(fn).__name__}")
    if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        # Called, it returns a generator or a coroutine and runs none of its body: the estimate held nothing.
        raise InvalidArgumentError(
            f"train_step {_name(fn)} is a {'coroutine' if inspect.iscoroutinefunction(fn) else 'generator'} "
            f"function, whose call runs none of its body; pass a plain function that runs the whole step")
    return fn


def check_arity(fn: "Callable[..., object]", with_targets: bool) -> None:
    """An InvalidArgumentError where ``fn`` cannot be called as the loop calls it, ``fn(model, optimizer, batch)``
    or, with ``targets=``, ``fn(model, optimizer, batch, targets)``: torch's own TypeError came out of the
    simulated step before, naming neither the step nor the fix. A callable whose signature Python cannot read is
    left to its call."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return
    names = ("model", "optimizer", "batch") + (("targets",) if with_targets else ())
    try:
        signature.bind(*names)
    except TypeError as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        called = f"train_step({', '.join(names)})"
        other = ("leave out targets= and take the targets from the batch" if with_targets
                 else "give targets= for a step that takes them")
        raise InvalidArgumentError(f"{_name(fn)}{signature} cannot be called as the loop calls it, {called} "
                                   f"({exc}); take {len(names)} arguments, or {other}") from None


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


class LoopValues:
    """Answers the values a training step reads from shape-only tensors outside the model's forward: 0 (``0.0``,
    ``0``, ``False``), counted by call site for the notes. Asked by the value shadows' rule beneath the collector
    (:attr:`memprof.simulate.shadows.ValueShadows.reads`) where a read fails, so that the collector sees the read as
    in a real run. ``in_forward`` says whether the model's forward runs now (a read there is the
    model's value-dependent code, refused as without a training step). With ``optimizer_only`` (memprof's own loop)
    only the reads of torch.optim's own code are answered (:func:`memprof.simulate.failures.read_by_optimizer`:
    ASGD's step counters, Adafactor's parameter norms, a tensor learning rate), which decide scalars of the step,
    not what it allocates; LBFGS, whose evaluations and history follow the values, is refused before."""

    def __init__(self, in_forward: Callable[[], bool], optimizer_only: bool = False,
                 backwards: Callable[[], int] = lambda: 0) -> None:
        self.in_forward = in_forward
        #: How many backward passes the step has begun: reads with one between them are a loop that progresses.
        self.backwards = backwards
        self._backwards = 0
        #: Only reads of torch.optim's own code are answered (memprof's own loop, whose other code reads nothing).
        self.optimizer_only = optimizer_only
        #: (what was read, where) -> how many times.
        self.answered: dict[tuple[str, str], int] = {}
        #: The same, in the step that runs now (:meth:`new_step`) since its last backward: a loop that stops on a
        #: value never stops here.
        self.this_step: dict[tuple[str, str], int] = {}

    def new_step(self) -> None:
        """A simulated step begins: its reads are counted afresh against :data:`LOOP_READS`."""
        self.this_step.clear()
        self._backwards = 0

    def answer(self, func: OpOverload, args: tuple[OpValue, ...], failure: BaseException) -> OpValue:
        """The answer to read ``func`` (one of :data:`READS`) of ``args``, which failed with ``failure``: 0, or
        ``failure`` raised again where the read is not one this mode answers."""
        from .failures import read_by_optimizer
        from .shadows import shape_only

        t = args[0] if args else None
        if not shape_only(t) or self.in_forward():
            raise failure
        stack = traceback.extract_stack()
        if self.optimizer_only and not read_by_optimizer([f.filename for f in stack]):
            raise failure
        key = (READS[func], _call_site(stack))
        self.answered[key] = self.answered.get(key, 0) + 1
        backwards = self.backwards()
        if backwards != self._backwards:
            # A backward since the last read: an accumulation loop logging each micro-batch's loss, not one that
            # waits on a value.
            self._backwards = backwards
            self.this_step.clear()
        n = self.this_step[key] = self.this_step.get(key, 0) + 1
        if n > LOOP_READS:
            raise _endless(key, failure)
        if func is _aten.is_nonzero.default or t.dtype == torch.bool:
            return False
        return 0.0 if (t.is_floating_point() or t.is_complex()) else 0

    def notes(self) -> list[str]:
        def said(optimizer: bool) -> str:
            return "; ".join(f"{what} x{n} at {where}" for (what, where), n in sorted(self.answered.items())
                             if where.startswith("torch/optim/") == optimizer)

        out = []
        own = said(True)
        if own:
            out.append(f"the optimizer's step read values that shape-only tensors do not hold ({own}): each was "
                       "answered 0 (0.0, 0, False); they set scalars of its update (step counts, a learning rate, a "
                       "norm), and where its code branches on one it took the branch 0 takes")
        loop = said(False)
        if loop:
            out.append(f"the training step read values that shape-only tensors do not hold ({loop}): each was "
                       "answered 0 (0.0, 0, False), so code that branches on them took the branch 0 takes (a "
                       "GradScaler's found_inf of 0 takes every optimizer step, the most memory); what it logged is "
                       "not the real value")
        return out


def _call_site(stack: "traceback.StackSummary") -> str:
    """The innermost frame of ``stack`` outside torch and memprof, or torch.optim's where that comes first (an
    optimizer's own read: ASGD's counters), as ``file:line``."""
    for f in reversed(stack):
        name = f.filename.replace("\\", "/")
        if "/torch/optim/" in name:
            return "torch/optim/" + name.rsplit("/torch/optim/", 1)[-1] + f":{f.lineno}"
        if "/torch/" not in name and "/memprof/" not in name:
            return f"{name.rsplit('/', 1)[-1]}:{f.lineno}"
    return "torch"


class UserStep:
    """One simulated step: ``train_step(model, optimizer, inputs[, targets])``, its result held until the next
    call returns. ``autocast`` (a CPU target's ``torch.autocast`` factory) or ``emulated`` (a
    :class:`~memprof.simulate.autocast.CudaAutocast`) runs each call of the model under mixed precision."""

    def __init__(self, fn: Callable[..., object], model: nn.Module, optimizer: "torch.optim.Optimizer | None",
                 inputs: UserValue, targets: UserValue, autocast: "AutocastFactory | None" = None,
                 emulated: "CudaAutocast | None" = None) -> None:
        self.fn, self.model, self.optimizer, self.inputs, self.targets = fn, model, optimizer, inputs, targets
        self.autocast, self.emulated = autocast, emulated
        #: What the last call returned, held as ``out = train_step(...)`` holds it (None before and after the loop).
        self.kept: object = None
        self.calls = 0
        self.values: "LoopValues | None" = None
        # The autocast contexts entered around the model's calls, innermost last (None: the emulated autocast's).
        self._regions: "list[AbstractContextManager[object] | None]" = []

    def run(self) -> None:
        args = (self.model, self.optimizer, self.inputs) + ((self.targets,) if self.targets is not None else ())
        if self.values is not None:
            self.values.new_step()
        # Rebinding after the call returns: the previous result lives through this call, as in a loop.
        self.kept = self.fn(*args)
        self.calls += 1

    def release(self) -> None:
        """The loop has ended: the last result is let go (inside the profiled run)."""
        self.kept = None

    def answering(self, prof: SimulatedProfile) -> LoopValues:
        """What answers the step's value reads (:class:`LoopValues`), kept for the notes; the simulation hands it to
        the value shadows' rule beneath the collector."""
        self.values = LoopValues(lambda: prof.innermost_module() is not None, backwards=prof.backwards)
        return self.values

    @contextlib.contextmanager
    def model_autocast(self) -> Iterator[None]:
        """Entered after the collector: under mixed precision, each call of the model under the target's autocast
        (entered before the collector's own hooks of the call, left after them, as ``with torch.autocast(...):
        out = model(x)`` around the call)."""
        if self.autocast is None and self.emulated is None:
            yield
            return
        pre = self.model.register_forward_pre_hook(self._enter, prepend=True)
        post = self.model.register_forward_hook(self._exit, always_call=True)
        try:
            yield
        finally:
            pre.remove()
            post.remove()
            while self._regions:  # a step that raised inside the model: its regions end with it
                self._leave()

    def _enter(self, module: nn.Module, args: tuple[UserValue, ...]) -> None:
        if self.emulated is not None:
            if not self._regions:
                self.emulated.begin_forward()
            self._regions.append(None)
        else:
            assert self.autocast is not None  # model_autocast() hooks the model only with one of the two
            region = self.autocast()
            region.__enter__()
            self._regions.append(region)

    def _exit(self, module: nn.Module, args: tuple[UserValue, ...], output: UserValue) -> None:
        if self._regions:
            self._leave()

    def _leave(self) -> None:
        region = self._regions.pop()
        if region is not None:
            region.__exit__(None, None, None)
        elif not self._regions:
            assert self.emulated is not None  # a None region is the emulated autocast's (_enter)
            self.emulated.end_forward()

    def notes(self) -> list[str]:
        name = _name(self.fn)
        call = f"{name}(model, optimizer, batch{', targets' if self.targets is not None else ''})"
        own = getattr(self.fn, "loop_notes", None)  # a named loop (memprof.simulate.loops) says what it ran
        out = own(self.calls) if callable(own) else [
            f"the training loop: your {call}, called {self.calls} time{'s' if self.calls != 1 else ''} on the "
            "shape-only twins, what it returned held until the next call returned (as out = train_step(...) in a "
            "loop holds it), the last until the loop ended"]
        if self.autocast is not None or self.emulated is not None:
            out.append("mixed precision with train_step: each call of the model ran under the target's autocast; "
                       "what your step computes outside the model (its loss) ran as written")
        if self.values is not None:
            out.extend(self.values.notes())
        return out
