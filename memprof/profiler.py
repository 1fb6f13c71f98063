"""The profiler: owns every hook's lifetime and produces the Trace.

``memprof.profile(model, optimizer)`` returns a :class:`Profiler`, a context
manager. While it is active it sees:

* every storage created (exact mode: a ``TorchDispatchMode``),
* what autograd saves for backward (``saved_tensors_hooks``),
* the model's module calls (forward pre/post hooks; backward via
  ``register_multi_grad_hook`` on each call's outputs and inputs),
* gradients as they are stored (``register_post_accumulate_grad_hook``),
* optimizer steps (torch's global optimizer step hooks, filtered to the
  optimizers that hold this model's parameters).

Everything it installs sits on one ``ExitStack`` that unwinds on exit, also
when the body raises; the exception propagates unchanged and the record up
to the failure stays readable through :meth:`Profiler.report`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import torch
import torch.optim.optimizer as _optim_mod
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import __version__  # noqa: F401  (defined before submodules import)
from .categories import Phase
from .anatomy.activations import TensorMeta
from .anatomy.optimizers import param_group_implementations
from .errors import InvalidArgumentError, ProfilerStateError, UnknownNameError
from .units import format_bytes
from .track.device import DeviceProbe
from .track.operations import OperationLog
from .track.saved import Saved, SavedHooks, is_checkpoint_pair, pop_orphans
from .track.saved import unpack as unpack_saved
from .track.ledger import (
    TAGS,
    ACTIVATIONS,
    BUFFERS,
    GRADIENTS,
    INPUTS,
    OPTIMIZER_STATES,
    TEMPORARIES,
    WEIGHTS,
    Ledger,
)
from .trace import (
    Breakdown,
    ModelFacts,
    ModuleRecord,
    OperationRecord,
    PhaseRecord,
    Sample,
    StepRecord,
    Trace,
)

if TYPE_CHECKING:
    from .report import Report

__all__ = ["Profiler", "profile"]

_MODES = ("full", "light", "auto")
_DETACH = torch.ops.aten.detach.default
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_top_saved_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _ignore: None)
_get_ident = threading.get_ident
_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", lambda: -1)
_NoPythonDispatch = getattr(torch._C, "_DisableTorchDispatch", contextlib.nullcontext)
_MAX_SAMPLES = 20_000
# torch 2.9 added TorchDispatchMode.ignore_compile_internals; before it, any dispatch mode makes
# torch.compile fall back to eager (torch/_dynamo/convert_frame.py).
_DISPATCH_KEEPS_COMPILE = hasattr(TorchDispatchMode, "ignore_compile_internals")

_aten = torch.ops.aten
_BACKWARD = Phase.BACKWARD
_FORWARD = Phase.FORWARD
_TAG = {name: i for i, name in enumerate(TAGS)}
_TAG_SAVED_OUTSIDE = _TAG["saved_outside_modules"]
_TAG_SAVED_TWICE = _TAG["saved_by_two_modules"]
_TAG_WEIGHT_COPY = _TAG["autocast_weight_copy"]
_TAG_SAVED_AS_VIEW = _TAG["saved_as_view_of_larger"]
_TAG_SAVED_EXPANDED = _TAG["saved_as_expanded_view"]
# "Where" tags that describe what the rule modules saving a storage count (or no tag yet).
_WHERE_BY_RULES = (-1, _TAG_SAVED_TWICE, _TAG_SAVED_AS_VIEW, _TAG_SAVED_EXPANDED)
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _op(name: str, overload: str = "default") -> Any:
    # Ops differ between torch versions; a missing one simply gets no rule.
    packet = getattr(_aten, name, None)
    return getattr(packet, overload, None) if packet is not None else None


def _tag_outputs(indices: tuple[int, ...], tag: str):
    def rule(prof: "Profiler", func: Any, args: Any, out: Any) -> None:
        if isinstance(out, (tuple, list)):
            for i in indices:
                if i < len(out) and isinstance(out[i], torch.Tensor):
                    prof._tag(out[i], _TAG[tag])
    return rule


def _tag_dropout_inplace(prof: "Profiler", func: Any, args: Any, out: Any) -> None:
    # F.dropout's CPU path: empty_like -> bernoulli_ -> div_ -> mul; the mask is bernoulli_'s target.
    if args and isinstance(args[0], torch.Tensor):
        size = args[0].element_size()
        prof._tag(args[0], _TAG["dropout_mask_4byte" if size >= 4 else "dropout_mask_2byte" if size == 2
                                else "dropout_mask"])


def _tag_weight_cast(prof: "Profiler", func: Any, args: Any, out: Any) -> None:
    # autocast casts an fp32 parameter to 16 bits with _to_copy.
    if isinstance(out, torch.Tensor) and out.dtype in _LOW_PRECISION and args and isinstance(args[0], torch.Tensor):
        entry = prof._entry_of(args[0])
        if entry is not None and entry.cat == WEIGHTS:
            prof._tag(out, _TAG["autocast_weight_copy"])


def _tag_fp32_under_autocast(index: "int | None"):
    def rule(prof: "Profiler", func: Any, args: Any, out: Any) -> None:
        if prof._autocast_dtype not in ("bfloat16", "float16"):
            return
        t = out[index] if index is not None and isinstance(out, (tuple, list)) else out
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and torch.is_autocast_enabled(prof.device.type):
            prof._tag(t, _TAG["autocast_fp32_output"])
    return rule


def _both(*rules: Any):
    def rule(prof: "Profiler", func: Any, args: Any, out: Any) -> None:
        for r in rules:
            r(prof, func, args, out)
    return rule


_NORM = _tag_outputs((1, 2), "norm_statistics")
_LSE = _tag_outputs((1,), "attention_logsumexp")
_TAG_RULES: dict[Any, Any] = {
    k: v for k, v in {
        _op("_to_copy"): _tag_weight_cast,
        _op("native_dropout"): _tag_outputs((1,), "dropout_mask"),
        _op("bernoulli_", "float"): _tag_dropout_inplace,
        _op("bernoulli_", "Tensor"): _tag_dropout_inplace,
        _op("native_layer_norm"): _both(_NORM, _tag_fp32_under_autocast(0)),
        _op("native_batch_norm"): _NORM,
        _op("_native_batch_norm_legit"): _NORM,
        _op("_native_batch_norm_legit", "no_stats"): _NORM,
        _op("native_group_norm"): _NORM,
        _op("_fused_rms_norm"): _tag_outputs((1,), "norm_statistics"),
        _op("_scaled_dot_product_flash_attention_for_cpu"): _LSE,
        _op("_scaled_dot_product_flash_attention"): _LSE,
        _op("_scaled_dot_product_efficient_attention"): _LSE,
        _op("_scaled_dot_product_cudnn_attention"): _LSE,
        _op("_softmax"): _tag_fp32_under_autocast(None),
        _op("_log_softmax"): _tag_fp32_under_autocast(None),
    }.items() if k is not None
}

# Models currently being profiled, so that a second profiler on the same model is refused.
_ACTIVE_MODELS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
# Profiles active per thread id: dispatch modes and saved-tensor hooks are per thread, and an
# inner profile's hooks would hide every saved tensor from the outer one. A dict rather than a
# threading.local, so that a profile ended from another thread still frees its thread's slot.
_ACTIVE_THREADS: dict[int, int] = {}
# Dispatch trackers that could not be popped because their profile ended in another thread:
# (thread id, tracker). The next profile started in that thread pops those on top of its stack.
_ORPHAN_MODES: list[tuple[int, Any]] = []


def profile(
    model: nn.Module,
    optimizer: "torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None" = None,
    *,
    mode: str = "auto",
    timeline: bool = True,
    operations: bool = False,
) -> "Profiler":
    """Profile the training (or evaluation) of ``model`` inside a ``with`` block.

    ``optimizer`` may be one optimizer, several, or ``None``; with ``None``
    any optimizer that steps the model's parameters is still seen, and until
    one is, each backward ends a step. ``mode`` is ``"full"`` (exact: every
    storage, default on CPU), ``"light"`` (allocator counters and hooks only,
    default on accelerators) or ``"auto"``. ``timeline=False`` skips the
    per-module samples that plots use. ``operations=True`` (full mode) also
    records every op's class, flops and bytes moved, for
    :meth:`Report.operations` (it costs a few microseconds per op).

    The profiler holds no strong reference to the model, its tensors or the
    optimizer after the block ends.
    """
    return Profiler(model, optimizer, mode=mode, timeline=timeline, operations=operations)


class _DispatchTracker(TorchDispatchMode):
    """Sees every op; registers each new output storage with the ledger."""

    def __init__(self, prof: "Profiler") -> None:
        super().__init__()
        self.prof: "Profiler | None" = prof

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Any other dispatch mode makes torch.compile run the model eagerly, and the code
        # object stays eager for the rest of the process (torch/_dynamo/convert_frame.py skips
        # frames while a mode without this flag is on the stack). With it, compiled code stays
        # compiled and this mode sees the ops the compiled artifact dispatches at run time.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        # The hot path of exact mode: runs for every op, so it avoids calls and lookups it can.
        prof = self.prof
        if func is _DETACH or prof is None:
            # A detach only aliases (the engine and saved-tensor packing issue many): nothing to count.
            # No owner: the profile ended in another thread and this mode is waiting to be popped.
            return func(*args, **(kwargs or {}))
        phase = prof._phase
        if phase is _BACKWARD:
            prof._watch_recompute()
        elif prof._scan_args and not prof._fwd_stack:
            # Only outside the model's modules (the loss, data movement): inside them every tensor
            # was either handed to the model (marked by the root hook) or made by an op already.
            prof._scan_inputs(args)
        out = func(*args, **(kwargs or {}))
        # Keyed by id(): OpOverload.__hash__ is a Python method, a second call per op.
        info = _OP_INFO.get(id(func))
        if info is None:
            info = _op_info(func)
        kind = info[0]
        if kind >= _NOT_WORK:  # views and profiler markers
            return out
        if kind == _WRITES_OUT:
            # An out= op writes into a buffer it was handed. A buffer memprof never saw was
            # allocated where no op reaches dispatch: inside compiled code (torch.compile's
            # generated kernels allocate directly) or by the caller before the profile.
            prof._register_unseen(args, kwargs)
        prof._ops += 1
        if prof._operations is not None:
            prof._operations.record(phase.value, func, args, kwargs, out)
        if phase is not _BACKWARD and _graph_task_id() != -1:
            prof._backward_started()
        if kind == _NEW_OUTPUTS:
            led = prof._ledger
            entries = led.entries
            on_cpu = prof._on_cpu
            for o in (out,) if type(out) is torch.Tensor else out if isinstance(out, (tuple, list)) else ():
                if not isinstance(o, torch.Tensor):
                    continue
                if on_cpu:
                    if not o.is_cpu:
                        continue
                elif o.device != prof.device:
                    continue
                try:
                    st = o.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                if st._cdata not in entries:
                    led.add(st, TEMPORARIES)
            if type(out) is not torch.Tensor and isinstance(out, torch.Tensor):
                prof._register_output(out)  # a tensor subclass result (e.g. a Parameter)
        rule = info[1]
        if rule is not None:
            rule(prof, func, args, out)
        return out


# What an op's outputs are, decided once per op from its schema.
_NEW_OUTPUTS, _ALIASES, _WRITES_OUT, _NOT_WORK, _VIEW = 0, 1, 2, 3, 4
# Ops whose schema says "returns an alias of the input" but which hand out a storage made outside
# dispatch: torch.tensor(...), torch.as_tensor(list) and from_numpy build the tensor in C++ and only
# then pass it through lift_fresh (torch/csrc/utils/tensor_new.cpp). The output is a new storage.
_LIFTS = frozenset(o for o in (_op("lift_fresh"), _op("lift_fresh_copy"), _op("lift")) if o is not None)
# id(op) -> (kind, tag rule or None, op). The op itself is kept so that its id stays its own.
_OP_INFO: dict[int, tuple[int, Any, Any]] = {}


def _op_info(func: Any) -> tuple[int, Any, Any]:
    if func.namespace == "profiler":  # record_function markers are not work
        kind = _NOT_WORK
    else:
        try:
            returns = func._schema.returns
            # Views and in-place ops return storages they were given: no new memory.
            aliases = bool(returns) and all(r.alias_info is not None for r in returns)
            writes = aliases and any(r.alias_info.is_write for r in returns)
        except Exception:
            aliases = writes = False
        # In-place ops (_ALIASES) write their result; views (_VIEW) move no data at all.
        kind = (_ALIASES if writes else _VIEW) if aliases else _NEW_OUTPUTS
        if kind == _ALIASES and func._overloadname == "out":
            kind = _WRITES_OUT
        if func in _LIFTS:
            kind = _NEW_OUTPUTS
    info = (kind, _TAG_RULES.get(func), func)
    _OP_INFO[id(func)] = info
    return info


class _ModuleInfo:
    __slots__ = ("path", "type", "calls", "act_step", "act_bytes", "fwd_peak", "bwd_peak", "fwd_tmp", "bwd_tmp")

    def __init__(self, path: str, type_name: str) -> None:
        self.path = path
        self.type = type_name
        self.calls = 0
        self.act_step = -1
        self.act_bytes = 0
        self.fwd_peak: "int | None" = None
        self.bwd_peak: "int | None" = None
        self.fwd_tmp: "int | None" = None
        self.bwd_tmp: "int | None" = None


class Profiler:
    """A profiling session. Create it with :func:`memprof.profile`.

    Use once: ``with prof:`` may be entered a single time. After the block,
    :attr:`trace` is the frozen record and :meth:`report` its views.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: "torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None" = None,
        *,
        mode: str = "auto",
        timeline: bool = True,
        operations: bool = False,
        _allow_meta: bool = False,
        _rounding: "int | None" = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(
                f"profile() needs a torch.nn.Module as its first argument, got {type(model).__name__}; "
                "pass the model whose training you want to measure"
            )
        optimizers = _as_optimizers(optimizer)
        if not isinstance(mode, str) or mode not in _MODES:
            raise UnknownNameError(f"unknown mode {mode!r}; use one of: full, light, auto")
        model_params = {id(p) for p in model.parameters()}
        for opt in optimizers:
            foreign = [p for g in opt.param_groups for p in g["params"] if id(p) not in model_params]
            if foreign:
                raise InvalidArgumentError(
                    f"{type(opt).__name__} holds {len(foreign)} parameter(s) that are not the model's; "
                    "pass the optimizer built from model.parameters(), or profile the module that owns them"
                )
        if getattr(model, "_compiled_call_impl", None) is not None:
            # nn.Module.compile() compiles the module's own __call__, hooks included: memprof's hooks
            # would be traced into the graph (splitting it) or, added after compilation, never run.
            raise InvalidArgumentError(
                f"{type(model).__name__} was compiled in place with model.compile(), so memprof's hooks on it "
                "would run inside the compiled code; profile the wrapper torch.compile(model) returns instead "
                "(memprof.profile(torch.compile(model), optimizer)), or compile its blocks in place and "
                "profile the model that holds them"
            )
        device = _model_device(model)
        if device.type == "meta" and not _allow_meta:
            raise InvalidArgumentError(
                "the model is on the meta device, where nothing can be measured; move it to a real device "
                "(model.to('cpu') after materialising), or use memprof.estimate() to simulate it"
            )
        self._mode_requested = mode
        if mode == "auto":
            mode = "full" if device.type in ("cpu", "meta") else "light"
        self.mode = mode
        self.device = device
        self._on_cpu = device.type == "cpu"
        # Per-module backward frames measure op-level memory, which only full mode sees;
        # light mode skips their tensor hooks (backward itself is found by grad and unpack hooks).
        self._track_backward_modules = mode == "full"
        self._dispatching = mode == "full"  # memprof's dispatch mode is installed
        self._model_ref = weakref.ref(model)
        # Held strongly only until the block ends (a model built inline must survive until then).
        self._model_hold: "nn.Module | None" = model
        self._optimizer_ids = {id(o) for o in optimizers}
        self._optimizer_refs = [weakref.ref(o) for o in optimizers]
        self._timeline_enabled = bool(timeline)
        self._want_operations = bool(operations)
        self._operations: "OperationLog | None" = None
        self._state = "new"
        self._trace: "Trace | None" = None
        self._probe = DeviceProbe(device)
        self._ledger = Ledger(rounding=_rounding if _rounding is not None else self._probe.rounding)
        self._stack: "contextlib.ExitStack | None" = None
        self._notes: list[str] = []
        self._thread = 0
        self._setup_error: "str | None" = None

    # ------------------------------------------------------------------ public

    def __enter__(self) -> "Profiler":
        if self._state != "new":
            raise ProfilerStateError(
                "this profiler was already used; profilers are single-use, create a new one with memprof.profile()"
            )
        model = self._model_ref()
        assert model is not None  # held by self._model_hold until the block ends
        if model in _ACTIVE_MODELS:
            raise ProfilerStateError(
                "memprof.profile() is already active on this model; exit that block first "
                "(one profiler per model at a time)"
            )
        thread = _get_ident()
        if _ACTIVE_THREADS.get(thread, 0):
            raise ProfilerStateError(
                "another memprof.profile() is active in this thread; profiles cannot nest (the inner one would "
                "hide saved tensors from the outer); profile the outer model once and read report.modules() "
                "for its submodules"
            )
        _pop_orphans()
        # Collect garbage first so that cycles left by earlier code are not freed
        # mid-step and counted as this step's frees.
        gc.collect()
        self._state = "active"
        self._thread = thread
        _ACTIVE_MODELS.add(model)
        _ACTIVE_THREADS[thread] = 1
        self._stack = contextlib.ExitStack()
        try:
            self._setup(model)
        except BaseException as exc:
            # The user's own error comes through unchanged (a lazy module, a hook that raises);
            # nothing memprof installed stays behind, and no partial record is made of it.
            self._setup_error = f"{type(exc).__name__}: {exc}"
            self._state = "failed"
            self._teardown()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._state != "active":
            return None
        if exc is not None:
            self._error = f"{exc_type.__name__}: {exc}"
            # What was live at the failing moment, before anything unwinds further.
            self._live_at_error = self._breakdown(self._ledger.totals, where="now")
            self._live_modules_at_error = self._modules_live_now()
        elsewhere = _get_ident() != self._thread
        self._teardown()
        if elsewhere and exc is None:
            raise ProfilerStateError(
                "this profile was ended in another thread than the one that started it; its hooks are removed "
                "and prof.report() holds what was measured, but the starting thread keeps memprof's per-thread "
                "hooks, inert, until a profile starts there again: end a profile in the thread that started it"
            )
        return None  # never swallow the body's exception

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:  # noqa: C901
        """Mark one step explicitly: ``with prof.step(): ...``.

        Once used, steps are delimited only by these blocks (optimizer steps
        and backward passes no longer end steps on their own).
        """
        if self._state != "active":
            raise ProfilerStateError("prof.step() is only valid inside the 'with memprof.profile(...)' block")
        if not self._explicit_steps:
            self._explicit_steps = True
            self._pending_step_end = False
            self._end_step()
        try:
            yield
        finally:
            if self._state == "active":
                self._end_step()
                if _get_ident() == self._thread:
                    self._saved.release()

    @property
    def trace(self) -> Trace:
        """The frozen record. Available after the block ends (also after an exception)."""
        if self._trace is None:
            if self._state == "new":
                raise ProfilerStateError(
                    "nothing was profiled yet; run your step inside 'with memprof.profile(model, optimizer) as prof:' "
                    "and read prof.report() after the block"
                )
            if self._state == "active":
                raise ProfilerStateError(
                    "the profiler is still running; read prof.report() after the 'with' block ends"
                )
            if self._state == "failed":
                raise ProfilerStateError(
                    f"profiling never started: setting it up raised {self._setup_error}; fix that error "
                    "(it was raised to your code too) and profile again"
                )
        assert self._trace is not None
        return self._trace

    def report(self) -> "Report":
        """The :class:`memprof.Report` built on :attr:`trace`."""
        from .report import Report

        return Report(self.trace)

    # ------------------------------------------------------------------ setup

    def _setup(self, model: nn.Module) -> None:
        stack = self._stack
        assert stack is not None
        led = self._ledger
        # State of the phase machine.
        self._phase = Phase.OTHER
        self._ops = 0
        self._phase_ops_start = 0
        self._step = 0
        self._step_phases: list[PhaseRecord] = []
        self._steps: list[StepRecord] = []
        self._occurrence: dict[Phase, int] = {}
        self._phase_start: list[int] = led.totals.copy()
        self._phase_serial_where: dict[int, tuple[int, Phase]] = {}
        self._explicit_steps = False
        self._pending_backward_end = False
        self._pending_step_end = False
        self._grad_keys: set[int] = set()
        self._optimizer_seen = bool(self._optimizer_ids)
        self._scan_args = False
        self._recomputing = False
        self._recompute_start = 0
        self._error: "str | None" = None
        self._live_at_error: "Breakdown | None" = None
        self._live_modules_at_error: tuple[tuple[str, int], ...] = ()
        self._samples: list[tuple[int, int, Phase, str, tuple[int, ...]]] = []
        self._sample_seq = 0
        self._fwd_stack: list[int] = []
        self._bw_frames: dict[int, Any] = {}
        self._opt_class: "str | None" = None
        self._opt_impl: "str | None" = None
        self._ours_cache: dict[int, bool] = {}
        self._discovered: list[weakref.ref] = []
        self._autocast_dtype: "str | None" = None
        # Input/output shapes of every module call in the first grad-enabled forward, for the formulas.
        self._capture_metas = False
        self._metas_done = False
        self._pending_meta: dict[int, Any] = {}
        self._metas: list[tuple[int, Any, Any, bool]] = []
        # Inputs saved by modules with a rule during that forward: (module, storage key) -> bytes saved.
        self._saved_inputs: dict[tuple[int, int], int] = {}

        # Per-thread and per-tensor hooks: memprof's saved-tensor pushes, tensor and node hooks.
        self._saved = SavedHooks(self)
        self._scoped: list[int] = []  # module calls whose forward holds a scoped saved-tensor push
        self._tensor_hooks: dict[tuple[int, int], tuple[weakref.ref, Any]] = {}
        self._node_hooks: list[Any] = []
        self._foreign_threads: set[int] = set()
        self._compiled_calls = 0
        self._compiled_depth = 0
        self._model_changed = False
        self._changes: list[str] = []
        self._forward_seen = False  # a forward began in this step
        self._calls = 0  # module forward calls seen
        self._marks: list[tuple[int, int, int]] = []  # per open call: module, _calls and _unseen_saves at entry
        self._unseen_saves: list[int] = []  # unknown storages saved as inputs in the current outermost call
        self._skipped_paths: list[str] = []  # modules whose calls ran none of their children's hooks
        self._invisible_forwards = 0  # gradients of the model from forwards memprof did not see
        stack.callback(self._close_thread_hooks)

        # One table of the model's modules, by path (named_modules() yields a shared module once,
        # under its first path): what each one is and which parameters it holds.
        self._modules: list[_ModuleInfo] = []
        self._modules_ref: list[weakref.ref] = []
        self._module_index: dict[int, int] = {}  # id(module) -> its row in the tables below
        self._module_params: list[list[weakref.ref]] = []
        # The tag a storage saved while this module is innermost gets when no op rule named it.
        self._saved_tag: list[int] = []
        self._brackets: set[int] = set()  # modules whose calls run compiled code memprof cannot see into
        self._compiled_paths: list[str] = []
        self._unhooked: set[int] = set()  # modules inside compiled code: no hooks, no per-module figures
        self._parents: set[int] = set()  # modules with hooked children
        self._params: list[weakref.ref] = []
        self._param_ids: set[int] = set()
        self._pending_params: list[weakref.ref] = []  # lazy parameters not materialised yet
        self._root_ref = weakref.ref(model)
        params = [p for p in _unique_params(model) if not _is_lazy(p)]
        self._param_dtypes = tuple(sorted({str(p.dtype).replace("torch.", "") for p in params}))

        # What exists already: weights, buffers, gradients, optimizer state.
        for p in params:
            self._add_tensor(p, WEIGHTS)
        for p in params:
            if p.grad is not None:
                self._add_grad(p.grad, retro=False)
        for b in model.buffers():
            self._add_tensor(b, BUFFERS)
        for ref in self._optimizer_refs:
            opt = ref()
            if opt is not None:
                self._note_optimizer(opt)
                self._collect_optimizer_state(opt, retro=False)
        self._start_totals = led.totals.copy()
        led.start_phase()
        self._phase_start = led.totals.copy()
        self._phase_serial_where[led.phase_serial] = (0, Phase.OTHER)

        # Hooks. Each registration goes on the stack right away so that a
        # failure half-way still removes what was installed.
        self._adopt_modules(model)
        if self._compiled_paths and self.mode == "full" and not _DISPATCH_KEEPS_COMPILE:
            # With this torch any dispatch mode makes compiled code run eagerly, and for the rest of
            # the process: full mode would change the user's training.
            if self._mode_requested == "full":
                raise InvalidArgumentError(
                    f"{self._compiled_paths[0]} runs torch.compile'd code, and with torch {torch.__version__} "
                    "full mode's dispatch mode would make it run eagerly for the rest of the process; profile "
                    "it with mode='light', or upgrade torch (2.9 and later keep compiled code compiled)"
                )
            self.mode = "light"
            self._dispatching = self._track_backward_modules = False
            self._notes.append(
                f"light mode: the model runs torch.compile'd code, which full mode's dispatch mode would make "
                f"run eagerly with torch {torch.__version__}"
            )
        h = _optim_mod.register_optimizer_step_pre_hook(self._opt_pre_hook)
        stack.callback(h.remove)
        h = _optim_mod.register_optimizer_step_post_hook(self._opt_post_hook)
        stack.callback(h.remove)
        # The model may gain parameters or submodules inside the block (a new head, lazy modules).
        from torch.nn.modules import module as _module_mod

        for name in ("register_module_parameter_registration_hook", "register_module_module_registration_hook"):
            register = getattr(_module_mod, name, None)
            if register is not None:
                stack.callback(register(self._registration_hook).remove)
        if self._want_operations and self.mode != "full":
            self._notes.append("operations=True needs mode='full' (it sees ops through the dispatch mode)")
        if self.mode == "full":
            if self._want_operations:
                self._operations = OperationLog()
            tracker = _DispatchTracker(self)
            tracker.__enter__()
            stack.callback(self._close_tracker, tracker)
        else:
            self._probe.start_light()
            self._notes.extend(self._probe.light_notes())
        self._sample("start")

    def _adopt_modules(self, model: nn.Module) -> None:
        """Add the model's modules not in the table yet (all of them at the start) and hook them.

        Modules inside compiled code get no hooks: torch.compile would trace memprof's hooks into
        its graph (splitting it) or, for hooks added after compilation, never run them. The call
        that enters compiled code (the torch.compile wrapper, or the nearest hooked ancestor of a
        module compiled in place) is hooked and marks where memprof cannot see inside.
        """
        stack = self._stack
        assert stack is not None
        from .anatomy.activations import saved_bytes_rule

        inside: list[str] = []  # path prefixes of compiled code
        parents: dict[str, int] = {}
        root = self._root_ref()
        for path, mod in model.named_modules():
            compiled_here = any(path == p or path.startswith(p + ".") for p in inside)
            known = self._module_index.get(id(mod))
            if known is not None and self._modules_ref[known]() is mod:
                parents[path] = known
                if not compiled_here and getattr(mod, "_compiled_call_impl", None) is not None:
                    inside.append(path)
                elif not compiled_here and _is_compile_wrapper(mod):
                    inside.append(f"{path}._orig_mod" if path else "_orig_mod")
                continue
            index = len(self._modules)
            parents[path] = index
            self._modules.append(_ModuleInfo(path or "", type(mod).__name__))
            self._modules_ref.append(weakref.ref(mod))
            self._module_index[id(mod)] = index
            self._module_params.append([weakref.ref(p) for p in _unique_params(mod)])
            if any(True for _ in mod.children()):
                self._saved_tag.append(_TAG["saved_in_container_code"])
            elif saved_bytes_rule(mod) is None:
                self._saved_tag.append(_TAG["saved_in_module_without_rule"])
            else:
                self._saved_tag.append(-1)
            if compiled_here:
                self._unhooked.add(index)
                continue
            if getattr(mod, "_compiled_call_impl", None) is not None:
                # Compiled in place: its own hooks would run inside the compiled code.
                self._unhooked.add(index)
                inside.append(path)
                parent = path.rsplit(".", 1)[0] if "." in path else ""
                if parent in parents:
                    self._brackets.add(parents[parent])
                self._note_compiled(path or "<model>")
                continue
            if _is_compile_wrapper(mod):
                inside.append(f"{path}._orig_mod" if path else "_orig_mod")
                self._brackets.add(index)
                self._note_compiled(path or "<model>")
            if path and path.rpartition(".")[0] in parents:
                self._parents.add(parents[path.rpartition(".")[0]])
            is_root = mod is root
            pre_hook, post_hook = self._make_pre_hook(index, is_root), self._make_post_hook(index, is_root)
            if is_root and "torch._dynamo" in sys.modules and not _is_compile_wrapper(mod):
                # A torch.compile wrapper of the model, called by the user, runs the model's own hooks
                # inside its compiled frame: keep dynamo from tracing memprof's code into the graph.
                pre_hook, post_hook = torch.compiler.disable(pre_hook), torch.compiler.disable(post_hook)
            pre = mod.register_forward_pre_hook(pre_hook, with_kwargs=True)
            stack.callback(pre.remove)
            post = mod.register_forward_hook(post_hook, with_kwargs=True, always_call=True)
            stack.callback(post.remove)
        for p in _unique_params(model):
            if id(p) not in self._param_ids:
                self._adopt_param(p)

    def _adopt_param(self, p: nn.Parameter) -> None:
        """A parameter of the model: its storage is a weight and its gradient is watched."""
        if _is_lazy(p):
            if all(r() is not p for r in self._pending_params):
                self._pending_params.append(weakref.ref(p))
            return
        self._params.append(weakref.ref(p))
        self._param_ids.add(id(p))
        # Already a weight for the parameters that existed at the start; one made inside the block
        # (a new head, a materialised lazy parameter) was a temporary until now.
        entry = self._add_tensor(p, WEIGHTS)
        if entry is not None and entry.cat != WEIGHTS:
            self._ledger.move(entry, WEIGHTS, retro=True)
        if p.requires_grad:
            assert self._stack is not None
            self._stack.callback(p.register_post_accumulate_grad_hook(self._grad_hook).remove)

    def _note_compiled(self, path: str) -> None:
        self._compiled_paths.append(path)

    def _registration_hook(self, module: nn.Module, name: str, value: Any) -> None:
        # Global: fires for every module in the process. Only the model's matter; what changed
        # is adopted at the next point where the model is not running (a forward's start, a step).
        if self._state == "active" and id(module) in self._module_index and value is not None:
            self._model_changed = True

    def _sync_model(self) -> None:
        """Adopt parameters and modules the model gained since the last look, and lazy parameters."""
        model = self._root_ref()
        if model is None:
            return
        before_params, before_mods = len(self._params), len(self._modules)
        if self._pending_params:
            pending = [r() for r in self._pending_params]
            self._pending_params = []
            for p in pending:
                if p is not None:
                    self._adopt_param(p)
        if self._model_changed:
            self._model_changed = False
            self._adopt_modules(model)
        new_params = self._params[before_params:]
        new_mods = len(self._modules) - before_mods
        if new_params and self._ops == self._phase_ops_start:
            self._phase_start = self._ledger.totals.copy()  # the phase has just begun: it starts with them
        if new_params or new_mods:
            nbytes = sum(self._ledger.size_of(p.untyped_storage().nbytes()) for p in
                         (r() for r in new_params) if p is not None)
            what = [f"{len(new_params)} parameter(s) ({format_bytes(nbytes)})"] if new_params else []
            if new_mods:
                what.append(f"{new_mods} module(s)")
            self._changes.append(f"step {self._step}: " + " and ".join(what))

    def _close_thread_hooks(self) -> None:
        """Undo memprof's per-thread saved-tensor pushes and remove its tensor and node hooks."""
        for _ref, handle in self._tensor_hooks.values():
            handle.remove()
        self._tensor_hooks.clear()
        for handle in self._node_hooks:
            handle.remove()
        self._node_hooks.clear()
        if not self._saved.close() and _get_ident() == self._thread:
            self._notes.append(
                "saved_tensors_hooks entered inside the profile were still active when it ended (above "
                "memprof's own pair), so memprof's pair is left inert beneath them until they exit"
            )

    def _close_tracker(self, tracker: "_DispatchTracker") -> None:
        tracker.prof = None  # inert from now on, wherever it still sits
        if _get_ident() == self._thread:
            tracker.__exit__(None, None, None)
        else:
            _ORPHAN_MODES.append((self._thread, tracker))

    def _teardown(self) -> None:
        stack, self._stack = self._stack, None
        self._model_hold = None
        model = self._model_ref()
        try:
            if stack is not None:
                stack.close()
        finally:
            if model is not None:
                _ACTIVE_MODELS.discard(model)
            if self._thread:
                _ACTIVE_THREADS.pop(self._thread, None)
            if self._state == "active":
                self._state = "done"
                try:
                    self._trace = self._build_trace()
                finally:
                    self._ledger.close()
                    self._samples = []
            else:
                if self._state != "failed":
                    self._state = "done"
                self._ledger.close()

    # ------------------------------------------------------------------ registration

    def _add_tensor(self, t: torch.Tensor, cat: int) -> Any:
        if t.device != self.device:
            return None
        if t.layout is not torch.strided:
            if t.is_sparse:
                self._add_tensor(t._indices(), cat)
                return self._add_tensor(t._values(), cat)
            return None
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        return self._ledger.add(st, cat)

    def _add_grad(self, g: torch.Tensor, *, retro: bool) -> None:
        entry = self._add_tensor(g, GRADIENTS)
        if entry is not None and entry.cat in (TEMPORARIES, ACTIVATIONS, INPUTS):
            self._ledger.move(entry, GRADIENTS, retro=retro)
        if entry is not None and entry.cat == GRADIENTS:
            self._grad_keys.add(entry.key)

    def _release_stale_grads(self) -> None:
        """A storage that is no parameter's .grad any more (zero_grad(set_to_none=True)
        while the user still holds it) is an ordinary tensor again."""
        if not self._grad_keys:
            return
        current: set[int] = set()
        for ref in self._params:
            p = ref()
            g = p.grad if p is not None else None
            if g is not None and g.layout is torch.strided:
                current.add(g.untyped_storage()._cdata)
            elif g is not None and g.is_sparse:
                current.add(g._values().untyped_storage()._cdata)
                current.add(g._indices().untyped_storage()._cdata)
        led = self._ledger
        for key in list(self._grad_keys):
            if key in current:
                continue
            self._grad_keys.discard(key)
            entry = led.entries.get(key)
            if entry is not None and entry.cat == GRADIENTS:
                led.move(entry, TEMPORARIES)

    def _register_output(self, t: torch.Tensor) -> None:
        if self._on_cpu:
            if not t.is_cpu:
                return
        elif t.device != self.device:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        self._ledger.add(st, TEMPORARIES)

    def _register_unseen(self, args: Any, kwargs: Any) -> None:
        # out= tensors are keyword-only in the schemas of .out overloads.
        for value in (kwargs or {}).values():
            for t in (value,) if isinstance(value, torch.Tensor) else value if isinstance(value, (tuple, list)) else ():
                if isinstance(t, torch.Tensor):
                    self._register_output(t)

    def _entry_of(self, t: torch.Tensor) -> Any:
        try:
            return self._ledger.entries.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return None

    def _tag(self, t: torch.Tensor, tag: int) -> None:
        entry = self._entry_of(t)
        if entry is not None:
            self._ledger.set_tag(entry, tag)

    def _scan_inputs(self, args: Iterable[Any]) -> None:
        # Tensors that come from outside the profile (targets handed to the
        # loss, masks) are inputs; known storages are skipped in O(1).
        entries = self._ledger.entries
        for a in args:
            if isinstance(a, torch.Tensor):
                try:
                    st = a.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                if st._cdata not in entries and a.device == self.device:
                    self._ledger.add(st, INPUTS)

    def _mark_inputs(self, objs: Any, depth: int = 0, *, made_in_block_too: bool = True) -> None:
        # Tensors handed to the model's forward are its inputs: unknown ones (made before the
        # profile), and temporaries made in the block (the batch built inside it). Handed to a
        # submodule called directly (made_in_block_too=False), only the unknown ones are: a
        # temporary there may be the encoder's output, or the loop's F.gelu of it.
        if depth > 4:
            return
        if isinstance(objs, torch.Tensor):
            entry = self._add_tensor(objs, INPUTS)
            if entry is not None and entry.cat == TEMPORARIES and made_in_block_too:
                self._ledger.move(entry, INPUTS)
        elif isinstance(objs, (list, tuple)):
            for o in objs:
                self._mark_inputs(o, depth + 1, made_in_block_too=made_in_block_too)
        elif isinstance(objs, dict):
            for o in objs.values():
                self._mark_inputs(o, depth + 1, made_in_block_too=made_in_block_too)

    # ------------------------------------------------------------------ saved tensors

    def _pack(self, t: torch.Tensor) -> Any:
        # memprof's own pack (no user pair beneath): runs for every tensor autograd saves.
        key = self._account_saved(t)
        if key is not None:
            return Saved(self._detached(t), self, key, t._version)
        # Weights, inputs, buffers: a tensor without grad_fn cannot close a reference cycle.
        return Saved(t if t.grad_fn is None else self._detached(t), None, 0, t._version)

    def _account_saved(self, t: torch.Tensor) -> "int | None":
        """Ledger work for a tensor autograd now holds: returns its storage's key when that is
        a counted activation (the caller's slot must release it through ``_unsaved``)."""
        if self._state != "active" or t.layout is not torch.strided or (
                not t.is_cpu if self._on_cpu else t.device != self.device):
            return None
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        led = self._ledger
        entry = led.entries.get(st._cdata)
        if entry is None:
            # Full mode saw every op output, so an unknown storage came from outside the profile
            # (an input) or from compiled code, which allocates out of dispatch's sight. Light mode
            # sees no op outputs, so an unknown storage that autograd saves is an activation.
            made_here = self.mode != "full" or self._compiled_depth > 0
            entry = led.add(st, ACTIVATIONS if made_here else INPUTS)
            if entry.cat == ACTIVATIONS:
                self._attribute_saved(entry)
            elif self._fwd_stack:
                self._unseen_saves.append(entry.key)  # an input, unless its call turns out compiled
        elif entry.cat == TEMPORARIES:
            led.move(entry, ACTIVATIONS)
            self._attribute_saved(entry)
        stack = self._fwd_stack
        if stack and self._phase is _FORWARD and self._saved_tag[stack[-1]] < 0:
            view = t.nbytes
            if entry.savers is None and view == entry.nbytes and entry.where < 0 and entry.cat == ACTIVATIONS:
                entry.savers = {stack[-1]: view}  # the common case: first saved whole, by a rule module
            else:
                self._saved_by_rule_module(entry, stack[-1], view)
        if entry.cat == ACTIVATIONS:
            if entry.saved < 0:
                entry.saved = 0
            entry.saved += 1
            return entry.key
        return None

    def _saved_by_rule_module(self, entry: Any, index: int, view_bytes: int) -> None:
        """Account for what the per-module formula counts: each rule counts the tensor its module
        saves (a view's bytes), once per module, whatever storage it shares."""
        if entry.cat == INPUTS:
            if self._capture_metas:
                # The model's inputs that a module with a rule saves: its rule counts them as activations.
                key = (index, entry.key)
                self._saved_inputs[key] = max(view_bytes, self._saved_inputs.get(key, 0))
            return
        if entry.cat != ACTIVATIONS:
            return
        savers = entry.savers
        if savers is None:
            savers = entry.savers = {}
        elif savers.get(index, 0) >= view_bytes:
            return
        savers[index] = view_bytes
        # What the rules of the modules that saved it count, against the storage memprof counts once.
        covered = sum(savers.values())
        where = entry.where
        led = self._ledger
        if covered > entry.nbytes:
            # Rules count more than the storage holds: several modules saved it (ReLU's output, the next
            # Linear's input; q, k and v projections of one tensor), or one saved an expanded view of it.
            tag = _TAG_SAVED_TWICE if len(savers) > 1 else _TAG_SAVED_EXPANDED
            led.set_tag(entry, tag, covered - entry.nbytes)
        elif where in _WHERE_BY_RULES:
            if covered < entry.nbytes:
                # Rules count the views their modules saved (x[:, 0]); memprof, the whole storage.
                led.set_tag(entry, _TAG_SAVED_AS_VIEW, entry.nbytes - covered)
            elif where >= 0:
                led.set_tag(entry, where, 0)
        else:
            # First saved where no rule sees it (container code, a module without a rule, outside the
            # model): that cause names only what the rules of later savers do not count.
            led.set_tag(entry, where, entry.nbytes - covered)

    def _detached(self, t: torch.Tensor) -> torch.Tensor:
        # In full mode this detach would go through memprof's own dispatch mode, which does
        # nothing with it but costs the Python dispatch round trip (~5 us, a saved tensor or
        # more per op). When that mode is the only one and ``t`` a plain tensor, no Python
        # code wants to see it; a subclass or another mode still gets its detach.
        if self._dispatching and type(t) is torch.Tensor and _dispatch_stack_len() == 1:
            with _NoPythonDispatch():
                return t.detach()
        return t.detach()

    def _unpack(self, saved: Any) -> torch.Tensor:
        # The first unpack of a backward pass can come before any gradient hook
        # (the loss's own backward): it starts the backward phase in light mode.
        if self._phase is not _BACKWARD and self._state == "active" and _graph_task_id() != -1:
            self._backward_started()
        return unpack_saved(saved)

    def _unpacking(self) -> None:
        # The first unpack of a backward pass can come before any gradient hook
        # (the loss's own backward): it starts the backward phase in light mode.
        if self._phase is not _BACKWARD and self._state == "active" and _graph_task_id() != -1:
            self._backward_started()

    def _attribute_saved(self, entry: Any) -> None:
        # Where it was saved from, for the per-module formula's causes. An autocast weight copy has a
        # cause of its own in every comparison, so it gets no "where" that would name it twice.
        where = entry.where < 0 and entry.tag != _TAG_WEIGHT_COPY
        stack = self._fwd_stack
        if not stack:
            if where and self._phase is _FORWARD:
                self._ledger.set_tag(entry, _TAG_SAVED_OUTSIDE)
            return
        if self._phase is not _FORWARD:
            return  # recomputation in backward (reentrant checkpoint) is not the module's forward saving
        index = stack[-1]
        if where:
            tag = self._saved_tag[index]
            if tag >= 0:
                self._ledger.set_tag(entry, tag)
        info = self._modules[index]
        if info.act_step != self._step:
            info.act_step = self._step
            info.act_bytes = 0
        info.act_bytes += entry.nbytes

    def _unsaved(self, key: int) -> None:
        if self._state != "active":
            return
        entry = self._ledger.entries.get(key)
        if entry is None or entry.cat != ACTIVATIONS:
            return
        entry.saved -= 1
        if entry.saved == 0:
            # Autograd released its last reference; whoever still holds the
            # storage holds an ordinary tensor.
            self._ledger.move(entry, TEMPORARIES)

    def _watch_recompute(self) -> None:
        # During backward, torch.utils.checkpoint's pair on top of the stack means a checkpointed
        # region is being recomputed under its hooks (which store what it saves out of our sight).
        foreign = is_checkpoint_pair(_top_saved_hooks(False))
        if foreign and not self._recomputing:
            self._recomputing = True
            self._recompute_start = self._ledger.seq
        elif not foreign and self._recomputing:
            self._recomputing = False
            self._flush_recompute()

    def _flush_recompute(self) -> None:
        # Storages created while a checkpointed region was recomputed in
        # backward under checkpoint's own saved-tensor hooks, still alive
        # now, are what checkpoint saved for this backward.
        self._recompute_pending = False
        start = self._recompute_start
        led = self._ledger
        for entry in list(led.entries.values()):
            if entry.created > start and entry.cat == TEMPORARIES:
                led.move(entry, ACTIVATIONS)
                entry.saved = -1  # held by checkpoint, released as backward unpacks it

    # ------------------------------------------------------------------ module hooks

    def _make_pre_hook(self, index: int, is_root: bool):
        def pre_hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if self._state != "active":
                return None
            if _get_ident() != self._thread and _graph_task_id() == -1:
                # The model runs in a thread other than the one that started the profile, where
                # memprof's dispatch mode and saved-tensor hooks are not installed (both are per thread).
                self._foreign_threads.add(_get_ident())
                return None
            info = self._modules[index]
            in_backward = self._phase is Phase.BACKWARD
            grad = torch.is_grad_enabled()
            # A forward is a call of the root, or an outermost call of its submodules with autograd on
            # (model.encoder(x), then model.decoder(h); a ModuleDict's members). A submodule run under
            # no_grad outside the model's forward (a frozen encoder, a probe) is not one.
            outermost = is_root or not self._fwd_stack
            if outermost and not in_backward:
                if self._phase is not Phase.FORWARD and (is_root or grad):
                    self._begin_phase(Phase.FORWARD)
                if self._model_changed or self._pending_params:
                    self._sync_model()
                if grad and not self._capture_metas and not self._metas_done and self._phase is Phase.FORWARD:
                    # The first grad-enabled forward gives the formula its shapes, also when a no_grad
                    # call of the model began this forward.
                    self._capture_metas = True
                    self._pending_meta = {}
                self._mark_inputs(args, made_in_block_too=is_root)
                self._mark_inputs(kwargs, made_in_block_too=is_root)
                self._note_autocast()
            info.calls += 1
            if grad and not in_backward:
                top = _top_saved_hooks(False)
                # The common case first: memprof's own pair is already the innermost one.
                if (top is None or top[0] is not self._saved.own_pack) and self._saved.cover():
                    self._scoped.append(index)
            if index in self._brackets:
                self._compiled_depth += 1
                self._compiled_calls += 1
            if self._capture_metas and not in_backward:
                self._pending_meta[index] = [TensorMeta.of(t) for t in _tensors(args, kwargs)
                                             if t.is_floating_point() or not t.is_complex()]
            self._fwd_stack.append(index)
            self._calls += 1
            self._marks.append((index, self._calls, len(self._unseen_saves)))
            self._ledger.push_frame(index, backward=False)
            if self._timeline_enabled:
                self._sample(info.path or "<model>")
            if self._track_backward_modules and grad and not in_backward:
                hook = None
                for a in _tensors(args, kwargs):
                    if a.requires_grad:
                        # A tensor hook, not a pre-hook on a.grad_fn: torch.autograd.grad(out, [a])
                        # captures a's gradient without running a.grad_fn, and only tensor hooks fire then.
                        hook = hook or self._make_bw_exit(index)
                        self._hook_tensor(a, index, hook)
            return None

        return pre_hook

    def _make_post_hook(self, index: int, is_root: bool):
        def post_hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self._state != "active" or (_get_ident() != self._thread and _graph_task_id() == -1):
                return None
            if self._scoped and self._scoped[-1] == index:
                self._scoped.pop()
                self._saved.uncover()
            if index in self._brackets and self._compiled_depth > 0:
                self._compiled_depth -= 1
                if self.mode == "full":
                    # What compiled code returns was allocated out of dispatch's sight.
                    for t in _tensors((output,), None):
                        self._register_output(t)
            led = self._ledger
            frame = led.frames[-1] if led.frames and led.frames[-1].module == index else None
            if frame is not None:
                for f in led.pop_frame(frame):
                    self._close_frame(f)
            if self._fwd_stack and self._fwd_stack[-1] == index:
                self._fwd_stack.pop()
            if self._marks and self._marks[-1][0] == index:
                _index, calls, unseen = self._marks.pop()
                if calls == self._calls and index in self._parents and self._phase is Phase.FORWARD:
                    self._children_skipped(index, unseen)
            if not self._fwd_stack:
                self._unseen_saves.clear()
            if is_root and self._pending_params:
                self._sync_model()  # lazy modules took their shapes in this forward
            metas = self._pending_meta.pop(index, None) if self._capture_metas else None
            if metas is not None:
                outs = [TensorMeta.of(t) for t in _tensors((output,), None)]
                grad = any(t.requires_grad for t in _tensors(args, kwargs)) or any(
                    p.requires_grad for p in module.parameters(recurse=False))
                self._metas.append((index, metas, outs[0] if outs else None, grad and torch.is_grad_enabled()))
            if self._phase is Phase.BACKWARD:
                return None  # a checkpointed module recomputing: no backward hooks for the recompute
            if self._timeline_enabled:
                self._sample(self._modules[index].path or "<model>")
            if self._track_backward_modules and torch.is_grad_enabled() and self._phase is Phase.FORWARD:
                hook = None
                for t in _tensors((output,), None):
                    if t.requires_grad:
                        hook = hook or self._make_bw_enter(index)
                        if t.grad_fn is not None:
                            # A pre-hook on the node fires when the engine runs it, once every gradient
                            # flowing into it is complete: when a tensor hook on t would, at a ninth of
                            # the cost (2 us against 19). They differ when torch.autograd.grad stops at t
                            # (the node never runs); then the module has no backward in that pass.
                            # Removed when the step ends (its backward has run) or with the profile.
                            self._node_hooks.append(t.grad_fn.register_prehook(hook))
                        else:
                            self._hook_tensor(t, index, hook)
            return None

        return post_hook

    def _children_skipped(self, index: int, unseen: int) -> None:
        """A call of a module with hooked children ran none of their hooks: compiled code ran it (a
        torch.compile wrapper of the model calls it from compiled code, which skips hooks added after
        compilation), or its forward called them through .forward(). What it saved out of dispatch's
        sight is an activation, not an input; its later calls are treated the same way."""
        led = self._ledger
        for key in self._unseen_saves[unseen:]:
            entry = led.entries.get(key)
            if entry is not None and entry.cat == INPUTS:
                led.move(entry, ACTIVATIONS, retro=True)
                if entry.saved < 0:
                    entry.saved = 0
                self._attribute_saved(entry)
        if index not in self._brackets:
            self._brackets.add(index)
            self._skipped_paths.append(self._modules[index].path or "<model>")

    def _hook_tensor(self, t: torch.Tensor, index: int, hook: Any) -> None:
        """A tensor hook for module ``index``, once per tensor (a parameter handed to a submodule
        every forward keeps one hook, not one per call); every one is removed with the profile."""
        key = (id(t), index)
        known = self._tensor_hooks.get(key)
        if known is not None and known[0]() is t:
            return
        self._tensor_hooks[key] = (weakref.ref(t), t.register_hook(hook))

    def _prune_hooks(self) -> None:
        """At a step's end its backward has run: drop the node and non-leaf hooks made for it."""
        for handle in self._node_hooks:
            handle.remove()
        self._node_hooks.clear()
        for key, (ref, handle) in list(self._tensor_hooks.items()):
            t = ref()
            if t is None or t.grad_fn is not None:
                handle.remove()
                del self._tensor_hooks[key]

    def _close_frame(self, frame: Any) -> None:
        if self.mode != "full":
            return  # op-level memory is not seen in light mode
        info = self._modules[frame.module]
        total = self._ledger.total
        rise = frame.max - frame.entry  # what the call added at its worst
        scratch = max(0, frame.max - max(total, frame.entry))  # what it needed but released by its end
        if frame.backward:
            info.bwd_peak = rise if info.bwd_peak is None else max(info.bwd_peak, rise)
            info.bwd_tmp = scratch if info.bwd_tmp is None else max(info.bwd_tmp, scratch)
        else:
            info.fwd_peak = rise if info.fwd_peak is None else max(info.fwd_peak, rise)
            info.fwd_tmp = scratch if info.fwd_tmp is None else max(info.fwd_tmp, scratch)

    def _make_bw_enter(self, index: int):
        def enter(_grad: Any) -> None:
            if self._state != "active":
                return
            if self._phase is not Phase.BACKWARD:
                self._backward_started()
            if index in self._bw_frames:
                return
            led = self._ledger
            top = led.top
            if top is not None and top.backward and self._is_ancestor(index, top.module):
                # A parent's output gradient can arrive after its last child's (same tensor,
                # hooks in registration order): keep the child innermost.
                self._bw_frames[index] = led.push_frame_below(index, True, top)
            else:
                self._bw_frames[index] = led.push_frame(index, backward=True)
            if self._timeline_enabled:
                self._sample(self._modules[index].path or "<model>")

        return enter

    def _make_bw_exit(self, index: int):
        def exit_(_grads: Any) -> None:
            if self._state != "active":
                return
            frame = self._bw_frames.pop(index, None)
            # Only this module's frame ends: a successor's gradient is often this
            # module's output gradient, which also starts the successor's frame.
            if frame is not None and self._ledger.remove_frame(frame):
                self._close_frame(frame)
                if self._timeline_enabled:
                    self._sample(self._modules[index].path or "<model>")

        return exit_

    def _is_ancestor(self, parent: int, child: int) -> bool:
        p = self._modules[parent].path
        c = self._modules[child].path
        return p == "" or c.startswith(p + ".")

    # ------------------------------------------------------------------ grads and optimizer

    def _grad_hook(self, param: torch.Tensor) -> None:
        if self._state != "active":
            return
        if not self._forward_seen:
            # A gradient of the model from a forward memprof's module hooks never saw: a torch.compile
            # wrapper of this model ran (its hooks are inside compiled code), or the forward ran
            # before the profile. What that forward saved was never seen.
            self._invisible_forwards += 1
        if self._phase is not Phase.BACKWARD:
            self._backward_started()
        g = param.grad
        if g is not None:
            self._add_grad(g, retro=True)

    def _is_ours(self, opt: torch.optim.Optimizer) -> bool:
        """Does ``opt`` step the model: one passed to profile(), or any other holding its parameters
        (created inside the block, re-created, or not passed at all)?"""
        if id(opt) in self._optimizer_ids:
            return True
        cached = self._ours_cache.get(id(opt))
        if cached is not None and cached[0]() is opt:
            return cached[1]
        known = any(id(p) in self._param_ids for g in opt.param_groups for p in g["params"])
        self._ours_cache[id(opt)] = (weakref.ref(opt), known)
        return known

    def _opt_pre_hook(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._state != "active":
            return None
        if _get_ident() == self._thread:
            # Between the loss and the next forward: memprof's saved-tensor pair can leave the stack.
            self._saved.release()
            if self._model_changed or self._pending_params:
                self._sync_model()
        if not self._is_ours(opt):
            return None
        self._optimizer_seen = True
        if id(opt) not in self._optimizer_ids and all(r() is not opt for r in self._discovered):
            self._discovered.append(weakref.ref(opt))
            if self._optimizer_ids:
                self._changes.append(f"step {self._step}: {type(opt).__name__} not passed to profile() stepped "
                                     "the model's parameters (its state is measured from its first step)")
        self._note_optimizer(opt)
        self._walk_grads()
        if self._phase is not Phase.OPTIMIZER:
            self._begin_phase(Phase.OPTIMIZER)
        return None

    def _opt_post_hook(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._state != "active" or not self._is_ours(opt):
            return None
        self._collect_optimizer_state(opt, retro=True)
        self._release_stale_grads()
        self._begin_phase(Phase.OTHER)
        if not self._explicit_steps:
            if self._forward_seen:
                # The step ends here; it is closed when the next forward (or the end) comes,
                # so that several optimizers stepping one after another stay one step.
                self._pending_step_end = True
            else:
                self._end_step()  # no forward to wait for: the model's forward runs unseen
        return None

    def _collect_optimizer_state(self, opt: torch.optim.Optimizer, *, retro: bool) -> None:
        led = self._ledger
        for state in opt.state.values():
            if not isinstance(state, dict):
                continue
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    entry = self._add_tensor(value, OPTIMIZER_STATES)
                    if entry is not None and entry.cat in (TEMPORARIES, INPUTS, ACTIVATIONS):
                        led.move(entry, OPTIMIZER_STATES, retro=retro)

    def _note_optimizer(self, opt: torch.optim.Optimizer) -> None:
        if self._opt_class is None:
            self._opt_class = f"{type(opt).__module__}.{type(opt).__qualname__}"
            try:
                # Decided as torch decides it (foreach defaults, per-class rules), group by group.
                impls = set(param_group_implementations(opt))
                self._opt_impl = impls.pop() if len(impls) == 1 else "mixed"
            except Exception:  # an unusual optimizer must never break the measurement
                self._opt_impl = None

    def _note_autocast(self) -> None:
        if self._autocast_dtype is not None:
            return
        dev = self.device.type if self.device.type in ("cpu", "cuda") else None
        if dev is not None and torch.is_autocast_enabled(dev):
            self._autocast_dtype = str(torch.get_autocast_dtype(dev)).replace("torch.", "")

    def _walk_grads(self) -> None:
        for ref in self._params:
            p = ref()
            if p is not None and p.grad is not None:
                self._add_grad(p.grad, retro=False)

    # ------------------------------------------------------------------ phases

    def _backward_started(self) -> None:
        if self._phase is Phase.BACKWARD:
            return
        self._begin_phase(Phase.BACKWARD)
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        except RuntimeError:
            # Not inside the engine (a grad hook called by hand): the next
            # phase change closes backward instead.
            pass

    def _backward_done(self) -> None:
        if self._state != "active" or self._phase is not Phase.BACKWARD:
            return
        led = self._ledger
        for f in list(led.frames):
            if f.backward:
                for g in led.pop_frame(f):
                    self._close_frame(g)
                break
        self._bw_frames.clear()
        self._walk_grads()
        self._begin_phase(Phase.OTHER)
        if not self._explicit_steps and not self._optimizer_seen:
            # Without an optimizer each backward ends a step; decided at the
            # next forward, so that an optimizer created later still counts.
            self._pending_backward_end = True

    def _begin_phase(self, phase: Phase) -> None:
        if phase is Phase.FORWARD and self._pending_step_end:
            self._pending_step_end = False
            self._pending_backward_end = False
            self._release_stale_grads()
            self._end_step()
        if phase is Phase.FORWARD and self._grad_keys:
            self._release_stale_grads()
        if phase is Phase.FORWARD and self._pending_backward_end:
            self._pending_backward_end = False
            if not self._optimizer_seen and not self._explicit_steps:
                self._end_step()
        self._close_phase()
        if self._capture_metas:
            self._capture_metas = False
            self._metas_done = True
        if phase is Phase.FORWARD and not self._metas_done and torch.is_grad_enabled():
            self._capture_metas = True
            self._pending_meta = {}
        self._phase = phase
        if phase is Phase.FORWARD:
            self._forward_seen = True
        led = self._ledger
        led.start_phase()
        self._phase_start = led.totals.copy()
        self._phase_ops_start = self._ops
        self._phase_serial_where[led.phase_serial] = (self._step, phase)
        self._scan_args = self.mode == "full" and phase in (Phase.FORWARD, Phase.OTHER)
        self._probe.phase_started()
        self._sample(phase.value)

    def _close_phase(self) -> None:
        led = self._ledger
        phase = self._phase
        end = led.totals
        ops = self._ops - self._phase_ops_start
        if phase is Phase.OTHER and ops == 0 and end == self._phase_start and led.phase_peak == self._phase_start:
            return  # nothing happened between two phases: no record
        occ = self._occurrence.get(phase, 0)
        self._occurrence[phase] = occ + 1
        device_now = self._probe.phase_ended()
        record = PhaseRecord(
            step=self._step,
            phase=phase,
            occurrence=occ,
            start=self._breakdown(self._phase_start, where="start", device=device_now),
            peak=self._breakdown(led.phase_peak, where="peak", device=device_now),
            end=self._breakdown(end, where="end", device=device_now),
            ops=ops,
            tags_peak=_tag_pairs(led.phase_peak_tags),
            tags_end=_tag_pairs(led.tag_act),
        )
        self._step_phases.append(record)

    def _end_step(self) -> None:
        self._prune_hooks()
        self._forward_seen = False
        self._close_phase()
        if self._step_phases:
            self._steps.append(StepRecord(self._step, tuple(self._step_phases)))
            self._step += 1
        self._step_phases = []
        self._occurrence = {}
        # Re-open an "other" phase without closing anything again.
        self._phase = Phase.OTHER
        led = self._ledger
        led.start_phase()
        self._phase_start = led.totals.copy()
        self._phase_ops_start = self._ops
        self._phase_serial_where[led.phase_serial] = (self._step, Phase.OTHER)
        self._scan_args = self.mode == "full"

    # ------------------------------------------------------------------ records

    def _breakdown(self, totals: list[int], *, where: str, device: Any = None) -> Breakdown:
        values: list["int | None"] = list(totals)
        total: "int | None"
        if self.mode == "light":
            values[TEMPORARIES] = None
            total = None
            if device is not None and where in ("peak", "end", "now") and device.allocated is not None:
                allocated = device.peak_allocated if where == "peak" else device.allocated
                known = sum(v for v in totals[:TEMPORARIES])
                values[TEMPORARIES] = max(0, allocated - known)
                total = known + values[TEMPORARIES]
        else:
            total = sum(totals)
        overhead = outside = None
        if device is not None and total is not None:
            if device.reserved is not None:
                overhead = max(0, device.reserved - total)
            if device.nvml_used is not None and device.reserved is not None:
                outside = max(0, device.nvml_used - max(device.reserved, total))
        full = values + [overhead, outside]
        if total is not None:
            total += (overhead or 0) + (outside or 0)
        return Breakdown(tuple(full), total)

    def _sample(self, label: str) -> None:
        if not self._timeline_enabled or len(self._samples) >= _MAX_SAMPLES:
            return
        self._sample_seq += 1
        # Raw ints now; Breakdown objects are built once, when the trace is.
        self._samples.append((self._sample_seq, self._step, self._phase, label, tuple(self._ledger.totals)))

    def _modules_live_now(self) -> tuple[tuple[str, int], ...]:
        # Bytes of live storages created while each module was innermost.
        by_module: dict[int, int] = {}
        for entry in self._ledger.entries.values():
            if entry.cat in (ACTIVATIONS, TEMPORARIES) and entry.module >= 0:
                by_module[entry.module] = by_module.get(entry.module, 0) + entry.nbytes
        ranked = sorted(by_module.items(), key=lambda kv: -kv[1])
        return tuple((self._modules[i].path or "<model>", n) for i, n in ranked[:20])

    def _build_trace(self) -> Trace:
        led = self._ledger
        # Close whatever is open; a trailing step holding only "other" joins the previous step.
        self._close_phase()
        phases = self._step_phases
        if phases:
            if self._steps and all(p.phase is Phase.OTHER for p in phases):
                last = self._steps[-1]
                self._steps[-1] = StepRecord(last.index, last.phases + tuple(
                    dataclasses.replace(p, step=last.index, occurrence=p.occurrence + sum(
                        1 for q in last.phases if q.phase is p.phase)) for p in phases))
            else:
                self._steps.append(StepRecord(self._step, tuple(phases)))
        self._step_phases = []
        device_now = self._probe.finish()
        end = self._breakdown(led.totals, where="end", device=device_now)
        start = self._breakdown(self._start_totals, where="start")
        peak_where = self._phase_serial_where.get(led.peak_phase_serial)
        peak_step = peak_where[0] if peak_where else None
        if peak_step is not None and self._steps and peak_step > self._steps[-1].index:
            peak_step = self._steps[-1].index
        # The global peak's device figures are those of the phase that held it.
        peak_device = None
        for s in self._steps:
            for p in s.phases:
                if peak_where and s.index == peak_where[0] and p.phase is peak_where[1] and p.peak.total is not None:
                    peak_device = p.peak
        peak = self._breakdown(led.peak, where="peak", device=self._probe.global_peak())
        if peak_device is not None and self.mode == "full":
            peak = Breakdown(peak.counts[:7] + peak_device.counts[7:],
                             sum(peak.counts[:7]) + sum(v or 0 for v in peak_device.counts[7:]))
        modules = []
        for i, info in enumerate(self._modules):
            params = 0
            grads = 0
            seen: set[int] = set()
            for ref in self._module_params[i]:
                p = ref()
                if p is None:
                    continue
                params += _storage_bytes(p, seen, led)
                if p.grad is not None:
                    grads += _storage_bytes(p.grad, seen, led)
            full = self.mode == "full" and i not in self._unhooked
            modules.append(ModuleRecord(
                path=info.path or "<model>",
                type=info.type,
                parameters=params,
                gradients=grads,
                activations=None if i in self._unhooked else info.act_bytes,
                peak_forward=info.fwd_peak if full else None,
                peak_backward=info.bwd_peak if full else None,
                temporaries_forward=info.fwd_tmp if full else None,
                temporaries_backward=info.bwd_tmp if full else None,
                calls=info.calls,
            ))
        # Recursive activation totals: a container holds what its children saved.
        act = {m.path: m.activations or 0 for m in modules}
        totals_by_path: dict[str, "int | None"] = {m.path: m.activations for m in modules}
        for m in modules:
            if m.path == "<model>" or m.activations is None:
                continue
            parts = m.path.split(".")
            for k in range(len(parts) - 1, -1, -1):
                parent = ".".join(parts[:k]) if k else "<model>"
                total = totals_by_path.get(parent)
                if total is not None:
                    totals_by_path[parent] = total + act[m.path]
        first_inputs: dict[int, int] = {}
        for index, metas, _out, _grad in self._metas:
            first_inputs.setdefault(index, sum(m.nbytes for m in metas))
        path_index = {(info.path or "<model>"): i for i, info in enumerate(self._modules)}
        modules = [dataclasses.replace(m, activations=totals_by_path[m.path], own_activations=m.activations,
                                       input_bytes=first_inputs.get(path_index[m.path])) for m in modules]
        peak_module = None
        if self.mode == "full" and 0 <= led.peak_module < len(self._modules):
            peak_module = self._modules[led.peak_module].path or "<model>"
        notes = list(self._notes) + self._probe.notes() + self._coverage_notes()
        if not self._steps:
            notes.append("nothing ran inside the profile: no forward, backward or optimizer step was seen")
        blank = self._unmeasured()
        steps = self._steps
        timeline = tuple(Sample(seq, step, phase, label, self._breakdown(list(totals), where="sample"))
                         for seq, step, phase, label, totals in self._samples)
        live_at_error = self._live_at_error
        if blank is not None:
            start, peak, end = (_blank(b, *blank) for b in (start, peak, end))
            steps = [StepRecord(s.index, tuple(
                dataclasses.replace(p, start=_blank(p.start, *blank), peak=_blank(p.peak, *blank),
                                    end=_blank(p.end, *blank)) for p in s.phases)) for s in steps]
            timeline = tuple(dataclasses.replace(x, breakdown=_blank(x.breakdown, *blank)) for x in timeline)
            if live_at_error is not None:
                live_at_error = _blank(live_at_error, *blank)
        return Trace(
            mode=self.mode,
            device=dataclasses.replace(self._probe.info(), rounding=self._ledger.rounding),
            torch_version=torch.__version__,
            memprof_version=__version__,
            start=start,
            peak=peak,
            end=end,
            peak_step=peak_step,
            peak_phase=peak_where[1] if peak_where else None,
            peak_module=peak_module,
            steps=tuple(steps),
            modules=tuple(modules),
            timeline=timeline,
            notes=tuple(dict.fromkeys(notes)),
            error=self._error,
            live_at_error=live_at_error,
            live_modules_at_error=self._live_modules_at_error,
            optimizer=self._opt_class,
            optimizer_implementation=self._opt_impl,
            param_dtypes=self._param_dtypes,
            autocast_dtype=self._autocast_dtype,
            peak_tags=_tag_pairs(led.peak_tags),
            facts=self._facts(),
            operations=tuple(
                OperationRecord(phase, cls, op, *vals)
                for (phase, cls, op), vals in sorted(self._operations.rows.items())
            ) if self._operations is not None else None,
        )

    def _unmeasured(self) -> "tuple[frozenset[int], bool] | None":
        """Categories (and whether the total) this run could not measure, or None when it measured all."""
        cats: set[int] = set()
        total = False
        if self._foreign_threads:
            # The dispatch mode and saved-tensor hooks are per thread: ops and saves there were not seen.
            cats |= {ACTIVATIONS, INPUTS, TEMPORARIES}
            total = self.mode == "full"
        if self._saved.in_transform:
            # Saved there or not cannot be told apart: torch.func allows no saved-tensor hooks.
            cats |= {ACTIVATIONS, TEMPORARIES}
        if self._invisible_forwards:
            cats |= {ACTIVATIONS}
        return (frozenset(cats), total) if cats else None

    def _coverage_notes(self) -> list[str]:
        """What this run could not see, or saw only in part, in the words the report prints."""
        notes = []
        if self._foreign_threads:
            notes.append(
                f"the model ran in {len(self._foreign_threads)} thread(s) other than the one that started the "
                "profile, where memprof's dispatch mode and saved-tensor hooks (both per thread) are not "
                "installed: activations, inputs and temporaries" + (" and the total" if self.mode == "full"
                                                                   else "") + " are not measured; start the "
                "profile in the thread that trains")
        if self._saved.in_transform:
            notes.append(
                f"the model ran {self._saved.in_transform} time(s) inside torch.func transforms (grad, vjp, "
                "jacrev, hessian), where torch allows no saved-tensor hooks: what autograd saved there cannot "
                "be told from temporaries, so activations and temporaries are not measured")
        if self._invisible_forwards:
            notes.append(
                "the model's parameters got gradients from a forward memprof's module hooks did not see (a "
                "torch.compile wrapper of this model was called, whose compiled code skips the hooks of the "
                "module it wraps, or the forward ran before the profile): activations are not measured; profile "
                "the module you call, memprof.profile(compiled_model, optimizer)")
        if self._saved.chained_to:
            names = ", ".join(sorted(self._saved.chained_to))
            notes.append(
                f"saved_tensors_hooks of your own were active ({names}): memprof ran them as without it and "
                f"counted as activations the tensors on {self.device.type} that their pack returned; tensors "
                "saved under them outside the model's modules (a loss computed inside such a block) are not seen")
        if self._skipped_paths:
            where = ", ".join(self._skipped_paths[:3]) + (" ..." if len(self._skipped_paths) > 3 else "")
            notes.append(
                f"calls of {where} ran none of their submodules' hooks (a torch.compile wrapper of the model "
                "ran them from compiled code, or they called submodules through .forward()): those submodules "
                "have no per-module figures, and what the calls saved counts as their activations; to see "
                "inside, profile the compiled wrapper itself (memprof.profile(compiled_model, optimizer))")
        if self._compiled_paths:
            where = ", ".join(self._compiled_paths[:3]) + (" ..." if len(self._compiled_paths) > 3 else "")
            notes.append(
                f"{self._compiled_calls} call(s) ran torch.compile'd code ({where}): memprof saw what the "
                "compiled code returned and what autograd saved from it, not the scratch memory its kernels "
                "use inside, so temporaries and peaks inside those calls are lower bounds and per-module "
                "figures stop at the compiled module")
        if self._changes:
            notes.append("the model or its optimizer changed during profiling (" + "; ".join(self._changes)
                         + "): figures before that count what existed then")
        return notes

    def _facts(self) -> ModelFacts:
        """Model and optimizer figures the reconciler needs, from the live objects at exit."""
        from .anatomy.activations import module_saved_bytes
        from .anatomy.optimizers import predict_optimizer_state_bytes, predict_optimizer_step_transient_bytes

        params = [p for p in (r() for r in self._params) if p is not None]
        trainable = [p for p in params if p.requires_grad]
        model = self._model_ref()
        buffers = 0
        if model is not None:
            seen: set[int] = set()
            for b in model.buffers():
                buffers += _storage_bytes(b, seen, self._ledger)
        seen = set()
        weight_bytes = sum(_storage_bytes(p, seen, self._ledger) for p in params)
        seen = set()
        trainable_bytes = sum(_storage_bytes(p, seen, self._ledger) for p in trainable)
        state = transient = None
        opts = [o for o in (r() for r in self._optimizer_refs) if o is not None] or list(self._seen_optimizers())
        if opts:
            try:
                states = [predict_optimizer_state_bytes(o, trainable) for o in opts]
                transients = [predict_optimizer_step_transient_bytes(o, trainable) for o in opts]
                state = None if any(v is None for v in states) else sum(states)  # type: ignore[misc]
                transient = None if any(v is None for v in transients) else max(transients)  # type: ignore[type-var]
            except Exception as exc:  # a formula must never break a measurement
                self._notes.append(f"optimizer formula failed: {exc!r}")
        activation: "int | None" = None
        without: set[str] = set()
        if self._metas:
            device = "cuda" if self.device.type == "cuda" else "cpu"
            activation = 0
            for index, metas, out, grad in self._metas:
                module = self._modules_ref[index]()
                if module is None or not grad or any(True for _ in module.children()):
                    continue  # containers: their children carry the rules
                try:
                    value = module_saved_bytes(module, metas, out, device=device, requires_input_grad=grad)
                except Exception:
                    value = None
                if value is None:
                    if self._modules[index].act_bytes:  # a module that saved nothing needs no rule (Identity)
                        without.add(type(module).__name__)
                else:
                    activation += value
        dims: list[tuple[str, str, int]] = []
        for i, info in enumerate(self._modules):
            module = self._modules_ref[i]()
            for attr in ("in_features", "out_features", "in_channels", "out_channels",
                         "num_embeddings", "embedding_dim"):
                value = getattr(module, attr, None)
                if isinstance(value, int) and isinstance(module, (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)):
                    dims.append((info.path or "<model>", attr, value))
        batch = None
        root_metas = next((m for i, m, _o, _g in self._metas if i == 0), None)
        if root_metas and root_metas[0].shape:
            batch = root_metas[0].shape[0]
        return ModelFacts(
            dims=tuple(dims),
            batch_size=batch,
            num_params=sum(p.numel() for p in params),
            num_trainable=sum(p.numel() for p in trainable),
            trainable_tensors=len(trainable),
            weight_bytes=weight_bytes,
            trainable_bytes=trainable_bytes,
            buffer_bytes=buffers,
            optimizer_state_formula=state,
            optimizer_transient_formula=transient,
            activation_formula=activation,
            activation_inputs_saved=sum(self._saved_inputs.values()) if self._metas else None,
            modules_without_rule=tuple(sorted(without)),
        )

    def _seen_optimizers(self) -> Iterator[torch.optim.Optimizer]:
        for ref in self._discovered:
            opt = ref()
            if opt is not None:
                yield opt


# ---------------------------------------------------------------------- helpers


def _as_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    out = []
    for item in items:
        inner = _unwrap_optimizer(item)
        if inner is None:
            raise InvalidArgumentError(
                f"optimizer must be a torch.optim.Optimizer (or a wrapper of one, such as accelerate's "
                f"AcceleratedOptimizer), a list of them, or None; got {type(item).__name__}"
            )
        out.append(inner)
    return out


def _unwrap_optimizer(opt: Any) -> "torch.optim.Optimizer | None":
    """The torch optimizer a wrapper drives: accelerate's AcceleratedOptimizer and DeepSpeed's wrap
    it as ``.optimizer``, Lightning's LightningOptimizer as ``._optimizer``. torch's step hooks fire
    for the optimizer whose step() runs, the innermost one, so that is the one memprof must follow."""
    chain = [opt]
    while len(chain) < 8:  # wrappers of wrappers; a cycle ends here too
        inner = next((c for c in (getattr(chain[-1], a, None) for a in ("optimizer", "_optimizer"))
                      if c is not None and all(c is not o for o in chain)), None)
        if inner is None:
            break
        chain.append(inner)
    # The innermost torch optimizer: an Optimizer subclass whose `optimizer` attribute is something
    # else (not an optimizer) is itself the one that steps.
    return next((o for o in reversed(chain) if isinstance(o, torch.optim.Optimizer)), None)


def _is_lazy(p: torch.Tensor) -> bool:
    """A parameter of a lazy module (nn.LazyLinear ...) before its first forward gives it a shape."""
    return isinstance(p, nn.parameter.UninitializedTensorMixin)


def _is_compile_wrapper(mod: nn.Module) -> bool:
    """The module torch.compile(model) returns (torch._dynamo.eval_frame.OptimizedModule)."""
    return type(mod).__name__ == "OptimizedModule" and isinstance(getattr(mod, "_orig_mod", None), nn.Module)


def _pop_orphans() -> None:
    """Pop what profiles ended in another thread left on this thread's stacks, where it is on top."""
    pop_orphans()
    me = _get_ident()
    for entry in [e for e in _ORPHAN_MODES if e[0] == me]:
        tracker = entry[1]
        if _dispatch_stack_len() > 0 and torch._C._get_dispatch_stack_at(_dispatch_stack_len() - 1) is tracker:
            tracker.__exit__(None, None, None)
            _ORPHAN_MODES.remove(entry)


def _unique_params(model: nn.Module) -> Iterator[nn.Parameter]:
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _collect_tensors(args, out, 0)
    if kwargs:
        _collect_tensors(kwargs, out, 0)
    return out


def _collect_tensors(obj: Any, out: list[torch.Tensor], depth: int) -> None:
    # A module-level function, not a nested closure: a recursive closure is a
    # reference cycle that would keep the user's tensors alive until gc runs.
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for x in obj:
            _collect_tensors(x, out, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for x in obj.values():
            _collect_tensors(x, out, depth + 1)


def _blank(bd: Breakdown, cats: frozenset[int], total: bool) -> Breakdown:
    """``bd`` with the categories a run could not measure (and maybe its total) as None."""
    counts = tuple(None if i in cats else v for i, v in enumerate(bd.counts))
    return Breakdown(counts, None if total else bd.total)


def _tag_pairs(values: list[int]) -> tuple[tuple[str, int], ...]:
    return tuple((name, v) for name, v in zip(TAGS, values) if v)


def _storage_bytes(t: torch.Tensor, seen: set[int], led: Ledger) -> int:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return 0
    if st._cdata in seen:
        return 0
    seen.add(st._cdata)
    return led.size_of(st.nbytes())

