"""The private torch entry points memprof uses, declared once, each with what it is for and its fallback.

torch has public hooks for most of what memprof watches (module and optimizer hooks, saved-tensor hooks,
dispatch modes); a few facts it needs are only reachable through private names, which may move between
torch versions. Every collector imports them from here, so a torch that renames one is met in one place,
and each name with a fallback degrades to "not known" rather than failing the user's run.
"""

from __future__ import annotations

import contextlib
from types import CodeType
from typing import TYPE_CHECKING, Callable, ContextManager, Literal, Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _python_dispatch as python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import is_interrupt

if TYPE_CHECKING:
    from torch.autograd.graph import Node

    from .aliases import PackHook, SavedPair, UnpackHook
    from .allocation_events import Snapshot

__all__ = [
    "graph_task_id", "dispatch_stack_len", "dispatch_mode_at", "push_dispatch_mode", "pop_dispatch_mode",
    "top_saved_hooks", "push_saved_hooks", "pop_saved_hooks", "saved_hooks_disabled_message",
    "current_autograd_node", "queue_backward_callback", "NoPythonDispatch", "is_compiling", "FakeTensor",
    "KEEPS_COMPILE", "python_dispatch", "MODE_FLAGS_SAVED", "MODE_FLAGS_CURRENT", "attach_cuda_oom_observer",
    "cuda_memory_snapshot", "SKIPS_DYNAMO", "skip_dynamo", "COMPILER", "cuda_history_enabled", "record_cuda_history",
    "set_cuda_metadata", "get_cuda_metadata", "in_compiled_autograd", "UnwrappedMode",
]

# -- autograd's engine ------------------------------------------------------------------------------------

#: The id of the graph task the autograd engine runs on this thread, -1 outside backward: how a hook or an
#: op tells that it runs inside backward (torch/csrc/autograd/engine.cpp). Without it, never in backward.
graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
#: The autograd node the engine is running now (None outside backward): where backward's walk of the graph
#: starts, and the node named in torch's "modified by an inplace operation" error.
current_autograd_node: "Callable[[], Node | None]" = getattr(torch._C, "_current_autograd_node", lambda: None)
#: Run a function when the engine has finished the current backward (the hook torch's own DDP and FSDP use
#: to finish their work): how the backward phase ends. Raises RuntimeError outside the engine.
queue_backward_callback: Callable[[Callable[[], None]], None] = \
    torch.autograd.Variable._execution_engine.queue_callback

# -- the saved-tensor hooks stack (torch/csrc/autograd/python_saved_variable_hooks.cpp) ---------------------

#: The innermost (pack, unpack) pair on this thread's stack, or None: which pair autograd calls now. Without
#: it, memprof cannot tell and treats the stack as empty.
top_saved_hooks: "Callable[[bool], SavedPair | None]" = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _ignore: None)
#: Push and pop a pair, as ``torch.autograd.graph.saved_tensors_hooks`` does on entry and exit: memprof pushes
#: its pair per module call and must pop exactly its own.
push_saved_hooks: "Callable[[PackHook, UnpackHook], None]" = torch._C._autograd._push_saved_tensors_default_hooks
pop_saved_hooks: Callable[[], None] = torch._C._autograd._pop_saved_tensors_default_hooks
#: Not None while saved-tensor hooks are disabled (inside torch.func transforms), where a push would raise.
saved_hooks_disabled_message: Callable[[], "str | None"] = getattr(
    torch._C._autograd, "_saved_tensors_hooks_get_disabled_error_message", lambda: None)

# -- the dispatch mode stack (c10/core/impl/TorchDispatchModeTLS.cpp) --------------------------------------

#: How many dispatch modes are on this thread's stack (-1: cannot tell): where a schedule's window puts
#: memprof's mode back, and whether memprof's mode is the only one (then its own detaches skip Python).
dispatch_stack_len: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack", lambda: -1)
#: The mode at a position of the stack (0: the bottom), to find memprof's own among the user's.
dispatch_mode_at: Callable[[int], TorchDispatchMode] = torch._C._get_dispatch_stack_at
#: Take the top mode off the stack and put one back, without its __enter__/__exit__: how memprof's mode is
#: moved beneath modes the user entered after it (memprof.collect.mode_stack).
pop_dispatch_mode: Callable[[None], TorchDispatchMode] = torch._C._pop_torch_dispatch_stack
push_dispatch_mode: Callable[[TorchDispatchMode], None] = torch._C._push_on_torch_dispatch_stack
#: A context in which ops skip Python dispatch modes: memprof's own detach of a saved tensor, when memprof's
#: mode is the only one, need not go through it (no fallback changes nothing but the cost).
NoPythonDispatch: Callable[[], ContextManager[object]] = getattr(torch._C, "_DisableTorchDispatch",
                                                                  contextlib.nullcontext)
#: The "a mode is in" flags torch keeps in torch/utils/_python_dispatch.py: each mode saves them on entry
#: (``MODE_FLAGS_SAVED``, lists on the mode) and restores them on exit (``MODE_FLAGS_CURRENT``, module globals).
#: Moving a mode under others must swap what each restores (memprof.collect.mode_stack); a missing one is skipped.
MODE_FLAGS_SAVED = ("old_dispatch_mode_flags", "old_non_infra_dispatch_mode_flags",
                    "old_without_ignore_compile_internals_dispatch_mode_flags")
MODE_FLAGS_CURRENT = ("_is_in_torch_dispatch_mode", "_is_in_non_infra_torch_dispatch_mode",
                      "_is_in_any_mode_without_ignore_compile_internals")
#: torch 2.9 added TorchDispatchMode.ignore_compile_internals; before it, any dispatch mode makes torch.compile
#: fall back to eager for the rest of the process (torch/_dynamo/convert_frame.py).
KEEPS_COMPILE = hasattr(TorchDispatchMode, "ignore_compile_internals")

# -- compilation ------------------------------------------------------------------------------------------

#: True while dynamo traces: memprof's hooks then do nothing, so that its code never enters a graph.
is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", lambda: False)


class CompilingFlag(Protocol):
    """What :data:`COMPILER` is read for: torch.compiler's module flag, or the property below."""

    @property
    def _is_compiling_flag(self) -> bool: ...


class _CallsIsCompiling:
    @property
    def _is_compiling_flag(self) -> bool:
        return is_compiling()


#: What ``is_compiling()`` reads, as an attribute: ``COMPILER._is_compiling_flag`` (torch.compiler's flag,
#: held True while dynamo compiles and while export traces). For hooks that autograd's C++ calls for every
#: saved tensor (pack), where the call costs two Python frames (is_compiling and torch.jit.is_scripting).
#: Code that dynamo may inline (module, gradient and optimizer hooks) must not read the flag first: dynamo would
#: guard on it. There ``is_compiling()``, which dynamo folds to True, or the one-frame form below. Where torch has
#: no such flag, a property that calls ``is_compiling()``.
COMPILER: CompilingFlag = torch.compiler if hasattr(torch.compiler, "_is_compiling_flag") else _CallsIsCompiling()

#: ``is_dynamo_compiling() or COMPILER._is_compiling_flag`` answers as ``is_compiling()`` does, in one Python frame
#: instead of two (``is_compiling`` calls ``torch.jit.is_scripting``), for the hooks that run at every module call
#: and every gradient. Dynamo folds ``is_dynamo_compiling()`` to True where it inlines a hook
#: (torch/_dynamo/variables/torch.py, tracing_state_functions), so it never reads the flag there and guards on
#: nothing; run for real, it returns False and the flag answers: True while a compile session or an export runs
#: Python for real (torch/compiler/__init__.py). Where torch has no ``is_dynamo_compiling``, ``is_compiling`` itself,
#: which dynamo folds as well (a function it did not fold would let it read the flag and guard on it).
is_dynamo_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", is_compiling)


def _code_skipper() -> "Callable[[CodeType], None] | None":
    try:
        from torch._C._dynamo import eval_frame as _eval_frame

        strategy = _eval_frame._FrameExecStrategy(_eval_frame._FrameAction.SKIP, _eval_frame._FrameAction.SKIP)
        mark = _eval_frame.set_code_exec_strategy
    except (ImportError, AttributeError, TypeError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return None

    def skip(code: CodeType) -> None:
        mark(code, strategy)

    return skip


_skip_code = _code_skipper()
#: Whether :func:`skip_dynamo` can keep dynamo out of a function without wrapping it.
SKIPS_DYNAMO = _skip_code is not None


def skip_dynamo(code: CodeType) -> None:
    """Keep dynamo out of a code object and of everything it calls, as ``torch._dynamo.disable(recursive=True)``
    does, with no wrapper frame: a per-code execution strategy that the C frame evaluator reads
    (``set_code_exec_strategy``, the mechanism of ``torch._dynamo.eval_frame.skip_code``; skipped for the
    frame and recursively). It needs no import of ``torch._dynamo``. Nothing where torch lacks it."""
    if _skip_code is not None:
        _skip_code(code)


class UnwrappedMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is untyped
    """A dispatch mode whose handler dynamo skips by a flag on its code (:func:`skip_dynamo`) rather than by the
    wrapper torch puts around every subclass's handler (``TorchDispatchMode.__init_subclass__``: four Python frames
    per op per mode, as many as a short handler's own), where torch offers the flag; wrapped as torch wraps it
    elsewhere. For the simulation's modes, each of which sees every simulated op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not SKIPS_DYNAMO

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is untyped
        handler = cls.__dict__.get("__torch_dispatch__")
        if SKIPS_DYNAMO and handler is not None and not isinstance(handler, classmethod):
            skip_dynamo(handler.__code__)


def in_compiled_autograd() -> bool:
    """Is compiled autograd running the backward now (``torch._dynamo.compiled_autograd``'s module flags: its
    region, held while it captures and runs the backward's graph, or its switch, on inside ``_enable``)? False
    where the module was never imported (then it cannot run) or has neither flag."""
    import sys

    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and bool(getattr(module, "in_compiled_autograd_region", False)
                                       or getattr(module, "compiled_autograd_enabled", False))


# FakeTensor (torch._subclasses.fake_tensor) is re-exported above: a simulation's shape-only tensors are fake,
# and fake tensors of another fake mode are metadata torch computes on the side, holding no memory.

# -- the CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp) ----------------------------------------

#: Register a function the allocator calls at a failing allocation, with the request and the device's free
#: bytes (the hook behind torch's "snapshot on OOM" recipe); None where torch has none (no OOM forensics then).
attach_cuda_oom_observer: "Callable[[Callable[[int, int, int, int], None]], None] | None" = getattr(
    torch._C, "_cuda_attach_out_of_memory_observer", None)


def cuda_memory_snapshot() -> "Snapshot":
    """The allocator's state in memory_viz's format (``torch.cuda.memory._snapshot``), written beside an OOM dump."""
    snapshot: "Snapshot" = torch.cuda.memory._snapshot()  # torch leaves it untyped
    return snapshot


#: Whether the allocator records its history now (``_record_memory_history`` was called, by the user or by
#: memprof): how memprof keeps a user's own recording instead of restarting it. None without CUDA in torch.
cuda_history_enabled: "Callable[[], bool] | None" = getattr(torch._C, "_cuda_isHistoryEnabled", None)


def record_cuda_history(enabled: 'Literal["state", "all"] | None', **options: object) -> None:
    """Start (``"all"``), restart or stop (None) the allocator's history
    (``torch.cuda.memory._record_memory_history``)."""
    torch.cuda.memory._record_memory_history(enabled, **options)


#: The string the allocator attaches to every entry it records from now on, and its reader
#: (``torch.cuda.memory._set_memory_metadata`` / ``_get_memory_metadata``, in torch 2.13): the
#: labels memory_viz shows. None where torch has neither (the labels are then skipped).
set_cuda_metadata: "Callable[[str], None] | None" = getattr(torch.cuda.memory, "_set_memory_metadata", None)
get_cuda_metadata: "Callable[[], str] | None" = getattr(torch.cuda.memory, "_get_memory_metadata", None)
