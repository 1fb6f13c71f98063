"""What failed in a simulated step, in words a user can act on: the model's own code, an op that shape-only
tensors cannot run, or one of memprof's own rules (then memprof is to blame, never the model)."""

from __future__ import annotations

import logging
import threading
from types import TracebackType
from typing import TYPE_CHECKING

from ..errors import SimulationError

if TYPE_CHECKING:
    import traceback

__all__ = ["simulation_error", "KernelRefusal", "read_by_optimizer", "QuietMetaFailures"]


class _MetaFailure(logging.Filter):
    """Drops fake tensors' log of a meta kernel that raised (torch/_subclasses/fake_tensor.py logs the traceback,
    then raises it on): the exception goes on to the user as one line (:func:`simulation_error`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


_FILTER = _MetaFailure()
_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")
_users = 0
_lock = threading.Lock()


class QuietMetaFailures:
    """While a simulation runs on fake tensors: a meta kernel that raises does not print torch's traceback above
    memprof's one-line error (docs/cli.md: errors are one line). Only that record is dropped, from that logger,
    and only while some simulation runs (nested or in threads: the filter goes when the last one ends)."""

    def __enter__(self) -> None:
        global _users
        with _lock:
            _users += 1
            _FAKE_LOG.addFilter(_FILTER)

    def __exit__(self, kind: "type[BaseException] | None", exc: "BaseException | None",
                 tb: "TracebackType | None") -> None:
        global _users
        with _lock:
            _users -= 1
            if _users <= 0:
                _users = 0
                _FAKE_LOG.removeFilter(_FILTER)


class KernelRefusal(RuntimeError):
    """What a device kernel refuses, raised by memprof's rule that runs its checks on shape-only tensors (the
    grouped GEMM's, :mod:`memprof.simulate.grouped_mm`): a run on the device fails the same way, so the failure
    is the run's, not memprof's. ``fix`` says what the kernel accepts."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix


def simulation_error(exc: BaseException, step: "int | str") -> SimulationError:
    """What failed in a simulated step (a training step's index, or the name of what ran: "generation"), in
    words a user can act on."""
    text = str(exc).strip()
    first = (text.splitlines()[0] if text else type(exc).__name__).rstrip(".")
    low = text.lower()
    # A value read from a shape-only tensor: a meta tensor's .item() says so, a fake tensor's raises
    # DataDependentOutputException naming only the op (aten._local_scalar_dense).
    reads = ("item()" in low or "data-dependent" in low or "datadependent" in type(exc).__name__.lower()
             or "cannot be called on meta tensors" in low)
    if reads and _optimizers_read(exc):
        fix = ("the optimizer's step reads tensor values (torch's own code does for this optimizer), which "
               "shape-only tensors do not have; simulate without it (optimizer=None) and add its state from the "
               "formula, or with an optimizer that does not")
    elif ("no fake impl" in low or "fake impl" in low and "register" in low or (
            isinstance(exc, NotImplementedError) and "meta" in low)) and _optimizers_read(exc):
        fix = ("an op of the optimizer's step (torch's own code for this optimizer and these gradients) has no "
               "fake (meta) kernel, so it cannot run on shape-only tensors; simulate without it (optimizer=None) "
               "and add its state from the formula, or with an optimizer that does not")
    elif "no fake impl" in low or "fake impl" in low and "register" in low or (
            isinstance(exc, NotImplementedError) and "meta" in low):
        fix = ("an op of the model has no fake (meta) kernel, so it cannot run on shape-only tensors; register one "
               "with torch.library.register_fake, returning empty tensors of the output shapes")
    elif "dynamicoutputshape" in type(exc).__name__.lower():
        fix = ("the op's output shape depends on tensor values (indexing with a boolean mask, x[mask], or its "
               "gradient; nonzero; CTC's alignment; packed sequences' lengths), which shape-only tensors do not "
               "hold, so no simulation can size it; estimate a step without that op and add what it allocates (a "
               "model's training-time masking or dropping by chance, such as wav2vec2's SpecAugment "
               "mask_time_prob or layerdrop, set to 0 in its config; for a loss, a loss_fn with the same output)")
    elif "sharding strategy" in low and "_for_cpu" in low:
        fix = ("context parallelism's ring attention has handlers for the CUDA attention kernels only (torch's "
               "_context_parallel/_attention.py): estimate for device='cuda', whose attention the simulation runs as "
               "the flash or efficient kernel")
    elif "unsupported scalartype" in low and "autocast" in _model_source(exc):
        fix = ("the model asks torch's autocast about its tensors' device type (torch.get_autocast_dtype or "
               "torch.autocast of x.device.type, as Nemotron's layer norm does), which is 'meta' in a simulation for "
               "a CUDA target and which torch does not answer; on a GPU it asks about 'cuda'. Estimate this "
               "precision with device='cpu' (fake CPU tensors, whose autocast torch answers), or in bf16")
    elif reads:
        fix = ("the model reads tensor values (.item(), .tolist(), a tensor in an if), which shape-only tensors do "
               "not have; pass such values as Python numbers, or keep that code out of the training step")
    else:
        fix = ("the model must run on shape-only tensors (meta or fake): the same call with real tensors of these "
               "shapes is the way to check it")
    what = f"training step {step}" if isinstance(step, int) else step
    if isinstance(exc, KernelRefusal):  # the device's own kernel refuses the same arguments: not memprof's defect
        where = _model_frame(exc)
        return SimulationError(f"the simulated {what} failed: {first}{f' (at {where})' if where else ''}, which the "
                               "device's kernel refuses as well: a run on the device fails here too. "
                               f"{exc.fix}".rstrip())
    rule = _rule_frame(exc)
    if rule:  # memprof's own rule made the failing call: the model is not to blame
        return SimulationError(f"the simulated {what} failed inside memprof's own simulation rule {rule}, not in the "
                               f"model: {type(exc).__name__}: {first}. This is memprof's defect; please report it")
    where = _model_frame(exc)
    return SimulationError(f"the simulated {what} failed: {type(exc).__name__}: {first}"
                           f"{f' (at {where})' if where else ''}. {fix[0].upper()}{fix[1:]}")


# The modules of memprof's rules above and below the ops (memprof.simulate.modes, .shadows), and the frames of theirs
# that hand the model's own call on unchanged.
_RULE_MODULES = ("kernels", "sdpa_rules", "autocast", "cpu_kernels", "moe", "routers", "grouped_mm", "experts",
                 "shadows")
_PASSING_ON = frozenset({"__torch_dispatch__", "__torch_function__", "handle"})


def _rule_frame(exc: BaseException) -> str:
    """The rule, as ``memprof.simulate.module.function (line n)``, when the innermost frame of the failure outside
    torch is a memprof rule's own call rather than the model's call handed on; else ``""``."""
    import traceback

    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        name = f.filename.replace("\\", "/")
        if "/torch/" in name:
            continue
        module = name.rsplit("/", 1)[-1].removesuffix(".py")
        if "/memprof/simulate/" in name and module in _RULE_MODULES and f.name not in _PASSING_ON:
            return f"memprof.simulate.{module}.{f.name} (line {f.lineno})"
        return ""
    return ""


def _optimizers_read(exc: BaseException) -> bool:
    """Whether the failure is in the optimizer step's own code (:func:`read_by_optimizer`): a value it read, or
    an op it called."""
    import traceback

    return read_by_optimizer([f.filename for f in traceback.extract_tb(exc.__traceback__)])


def read_by_optimizer(files: "list[str]") -> bool:
    """Whether, in a stack of source files (innermost last), the innermost frame that is torch.optim's code or
    outside torch and memprof is torch.optim's: a value read by the optimizer step's own code (Adagrad's
    ``_get_value(step)``), not by the model called from inside it (a closure's forward under ``step(closure)``,
    ``AveragedModel``'s wrapped model)."""
    for name in reversed(files):
        name = name.replace("\\", "/")
        if "/torch/optim/" in name:
            return True
        if "/torch/" not in name and "/memprof/" not in name:
            return False
    return False


def _model_line(exc: BaseException) -> "traceback.FrameSummary | None":
    """The innermost frame of the failure outside torch and memprof: the model's line."""
    import traceback

    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        name = f.filename.replace("\\", "/")
        if "/torch/" not in name and "/memprof/" not in name:
            return f
    return None


def _model_frame(exc: BaseException) -> str:
    """The model's line (:func:`_model_line`) as ``file:line``, its path from site-packages on."""
    f = _model_line(exc)
    if f is None:
        return ""
    name = f.filename.replace("\\", "/")
    return f"{name.split('/site-packages/')[-1]}:{f.lineno}"


def _model_source(exc: BaseException) -> str:
    """The source text of the model's line (:func:`_model_line`), "" where there is none."""
    f = _model_line(exc)
    return (f.line or "") if f is not None else ""
