"""A signal whose handler raises (Ctrl-C, a preemption handler that raises to save a checkpoint) is never
swallowed because memprof's code was running when it arrived.

Python runs a signal's handler at the next bytecode boundary of the main thread. Where that boundary is
inside a finaliser (a ``__del__``, a weak reference's callback), the handler's exception cannot propagate:
Python reports it to ``sys.unraisablehook`` ("Exception ignored in ...") and the interrupted code goes on.
memprof's finalisers therefore run no bytecode at all (torch's release of a storage or of a saved slot is
queued by a C callable and settled in memprof's own hooks, where an exception reaches the user), so every
interrupt of a storm reaches the training loop, as it does without memprof.
"""

from __future__ import annotations

import ast
import gc
import pathlib
import signal
import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _pop_mode

import memprof
from memprof.collect.dispatch import DispatchMode, pop_orphan_modes
from memprof.collect.mode_stack import mode_flags, restore_mode_flags

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer (POSIX)")


class Preempted(Exception):
    """What the test's handler raises, as a preemption handler raises to save a checkpoint."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Many small ops and many short-lived storages per step: many finalisations for a signal to land in.
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)) for _ in range(6)],
                         nn.Linear(16, 4))


def _storm(mode: "str | None", interrupts: int) -> tuple[int, int, int]:
    """Train under ``mode`` (None: without memprof) while a timer interrupts: (handled, caught, swallowed)."""
    handled = caught = 0
    swallowed: list[BaseException] = []

    def handler(signum, frame):
        nonlocal handled
        handled += 1
        raise Preempted

    def unraisable(info):
        if isinstance(info.exc_value, Preempted):
            swallowed.append(f"{info.err_msg}: {info.object!r}")
        else:
            previous_hook(info)

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    # AdamW's state exists before the storm: an interrupt inside its lazy creation would leave a half-made
    # state that fails the next step, with or without memprof.
    _step(model, opt, x, y)
    if mode is not None:
        # memprof's modules are imported before the storm too: the first profile imports them, and under pytest
        # each is compiled then (assertion rewriting), where CPython's constant folder drops any exception but
        # KeyboardInterrupt that a handler raises inside it (Python/ast_opt.c, make_const clears the error): a
        # lost interrupt that is CPython's, seen once in a few runs under load (docs/reliability.md, known limits).
        with memprof.profile(model, opt, mode=mode):
            _step(model, opt, x, y)
    # Other tests of this worker leave finalisers behind (a property-testing library's gc callback, torch's
    # weak storage references of an earlier simulation), where an interrupt is swallowed with or without
    # memprof: collected and frozen before the storm, and gc callbacks put aside, so that only this storm's
    # objects finalise during it.
    grad_enabled = torch.is_grad_enabled()
    depth = torch._C._len_torch_dispatch_stack()
    flags = mode_flags()
    gc.collect()
    gc.freeze()
    foreign_callbacks = gc.callbacks[:]
    gc.callbacks.clear()
    previous_handler = signal.signal(signal.SIGALRM, handler)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = unraisable
    # Intervals that do not divide a step's duration evenly, so the interrupts land all over the step.
    intervals = [0.002 + 0.0037 * (i % 11) for i in range(interrupts)]
    try:
        for interval in intervals:
            # An interrupt inside torch's own no_grad regions (the optimizer's step) can leave grad mode off,
            # with or without memprof: each round starts as a training loop's would.
            torch.set_grad_enabled(True)
            try:
                signal.setitimer(signal.ITIMER_REAL, interval)
                # A bounded number of steps: a swallowed interrupt ends the round without reaching the loop.
                if mode is None:
                    _steps(model, opt, x, y)
                else:
                    with memprof.profile(model, opt, mode=mode):
                        _steps(model, opt, x, y)
            except Preempted:
                caught += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        sys.unraisablehook = previous_hook
        gc.callbacks.extend(foreign_callbacks)
        torch.set_grad_enabled(grad_enabled)
        gc.unfreeze()
    # A profile ended while its dispatch mode could not leave the stack (an interrupt inside an op's dispatch)
    # leaves it inert there, passing ops through, until an output is released on top of it or the next profile
    # starts (collect/dispatch.py, pop_orphan_modes): popped here as the next profile would, so that no later
    # test of this worker finds it; anything else left on the stack is a leak.
    pop_orphan_modes()
    # Rarely (once in a full suite run under load, never in 2,400 interrupts alone) an interrupt in exact mode
    # leaves a memprof dispatch mode on the stack that is not listed as an orphan: a known defect
    # (docs/reliability.md, known limits). One way it happens: the interrupt lands inside torch's own
    # TorchDispatchMode.__exit__, after it popped the mode's flags and before it popped the mode (two statements of
    # torch/utils/_python_dispatch.py); the mode then stays with no flags left to pop. Taken off here so that no
    # later test of this worker meets it; a mode of anyone else's left there still fails the test.
    # By its own exit where it still has its flags (a raw pop would leave torch's process-wide "a dispatch mode is
    # in" flags up); else raw, its flags already popped (a second exit raised IndexError and left it, and 31 later
    # tests of the worker failed), the flags put back below.
    while torch._C._len_torch_dispatch_stack() > depth and isinstance(_top_mode(), DispatchMode):
        if getattr(_top_mode(), "old_dispatch_mode_flags", None):
            _top_mode().__exit__(None, None, None)
        else:
            _pop_mode()  # torch.utils._python_dispatch._pop_mode: the stack's top, as the exit would
    assert torch._C._len_torch_dispatch_stack() == depth
    # An interrupt inside torch's own TorchDispatchMode.__exit__ (its flags and its pop are separate statements)
    # can leave those flags wrong whoever's mode it was: put back as they were before the storm, so that no later
    # test of this worker starts with them up (test_long_runs checks them).
    restore_mode_flags(flags)
    # Nor a saved-tensor pair of memprof's (one pushed, and the interrupt landing before memprof recorded the
    # push: test_an_interrupt_right_after_a_saved_hooks_push_leaves_no_pair_of_memprofs_behind).
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    return handled, caught, swallowed


def _top_mode() -> object:
    return torch._C._get_dispatch_stack_at(torch._C._len_torch_dispatch_stack() - 1)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    for _ in range(200):
        _step(model, opt, x, y)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("mode", [None, "exact", "light"])
def test_every_interrupt_of_a_storm_reaches_the_training_loop(mode):
    handled, caught, swallowed = _storm(mode, interrupts=150)
    # Every time the handler ran, its exception reached the loop: none was reported as "ignored".
    assert swallowed == []
    assert caught == handled == 150


def test_a_handlers_exception_inside_memprofs_containment_reaches_the_user():
    # memprof contains what the user's objects raise when it reads them (a tensor subclass whose shape raises:
    # a note, and the step runs as without memprof). An exception a signal handler raises while memprof reads is
    # not one of those: it is the user's, wherever it lands. raise_signal runs the handler at once, inside the
    # shape memprof is reading.
    def handler(signum, frame):
        raise Preempted

    _preempted_while_memprof_reads_a_shape(handler)


def _preempted_while_memprof_reads_a_shape(handler) -> None:
    """A profiled step whose input's ``shape`` raises SIGUSR1, handled by ``handler``: its Preempted reaches the
    caller. raise_signal runs the handler at once, inside the shape memprof is reading."""

    class Shape(torch.Tensor):
        @property
        def shape(self):
            signal.raise_signal(signal.SIGUSR1)
            return super().shape

    model = nn.Linear(4, 4)
    x = torch.randn(2, 4).as_subclass(Shape)
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        with pytest.raises(Preempted):
            with memprof.profile(model, mode="exact"):
                model(x).sum().backward()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_is_interrupt_tells_a_handlers_exception_from_memprofs_own():
    from memprof.errors import is_interrupt

    class Handler:
        def __call__(self, signum, frame):
            raise Preempted

    def caught(fn):
        try:
            fn()
        except BaseException as exc:
            return exc

    assert is_interrupt(KeyboardInterrupt()) and is_interrupt(SystemExit())
    assert not is_interrupt(caught(lambda: [][1]))  # an ordinary failure, raised beneath
    previous = signal.signal(signal.SIGUSR1, Handler())  # a callable object as the handler
    try:
        assert is_interrupt(caught(lambda: signal.raise_signal(signal.SIGUSR1)))
        assert not is_interrupt(caught(lambda: int("x")))
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _unchecked_handlers(tree: ast.AST) -> list[str]:
    """``except`` clauses of memprof's that contain an exception without first asking ``is_interrupt``,
    named by their function."""
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in _own_nodes(func):
            if not isinstance(node, ast.ExceptHandler) or node.type is None:
                continue
            first = node.body[0]
            asks = (isinstance(first, ast.If) and "is_interrupt(" in ast.unparse(first.test)
                    and isinstance(first.body[0], ast.Raise) and first.body[0].exc is None)
            reraises = any(isinstance(n, ast.Raise) and n.exc is None for n in node.body)
            if not asks and not reraises:
                found.append(f"{func.name}: except {ast.unparse(node.type)}")
    return found


def _own_nodes(func: ast.AST):
    """The nodes of a function, not those of the functions defined in it."""
    todo = list(ast.iter_child_nodes(func))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def test_every_containment_lets_a_handlers_exception_through():
    # Every except clause of the package: a handler may raise any type (a TimeoutError from an alarm is an OSError)
    # anywhere, in a profiled block, an estimate, a plan, a report or the command line.
    root = pathlib.Path(memprof.__file__).parent
    found = {str(path.relative_to(root)): unchecked for path in sorted(root.rglob("*.py"))
             if (unchecked := _unchecked_handlers(ast.parse(path.read_text())))}
    # Those that keep the exception for the profile's closing, which raises the user's interruptions
    # (closing.py and undo.py: errors.is_interrupt decides there), the one finaliser (below), and a forked process
    # (a plan's groups of rows, a pipeline's rank classes), which sends whatever its simulation raised to the
    # parent, where it is raised (forked_answers.py).
    assert found == {"collect/undo.py": ["_run: except BaseException", "attempt: except BaseException"],
                     "collect/closing.py": ["close: except BaseException"],
                     "collect/dispatch.py": ["_leave_stack: except Exception"],
                     "simulate/forked_answers.py": ["answer: except BaseException"]}


def _finalisers(tree: ast.AST) -> list[str]:
    """Python code of memprof's that torch or the garbage collector would run as a finaliser."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__del__":
            found.append(f"def __del__ (line {node.lineno})")
        elif isinstance(node, ast.Attribute) and node.attr in ("finalize", "WeakSet", "WeakKeyDictionary",
                                                               "WeakValueDictionary"):
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            # weakref.ref(obj, callback), or a weak reference subclass made with a callback: the callback must
            # be a C callable (a bound method of a builtin container), never a Python function.
            name = ast.unparse(node.func)
            if name in ("weakref.ref", "_weakref", "weakref.proxy") or name.endswith(("Ref", "Entry")):
                callback = node.args[1]
                if not _c_callable(callback):
                    found.append(f"{name}(..., {ast.unparse(callback)}) (line {node.lineno})")
    return found


def _c_callable(node: ast.expr) -> bool:
    # The one spelling memprof uses for a weak reference's callback: a queue's bound append, which is C.
    return isinstance(node, ast.Attribute) and node.attr == "queue_release"


def test_memprof_runs_no_python_finaliser():
    root = pathlib.Path(memprof.__file__).parent
    found = {str(p.relative_to(root)): f for p in sorted(root.rglob("*.py"))
             if (f := _finalisers(ast.parse(p.read_text())))}
    # The one exception, armed only after a profile has ended where its dispatch mode could not leave the
    # stack (ended from another thread, or beneath a mode of the user's): on at most four op outputs, the
    # release of one takes the mode off the stack. A mode can leave only from outside dispatch, and after the
    # profile no hook of memprof's runs there but a finaliser (docs/reliability.md, known limits).
    inert = found.pop("collect/dispatch.py", [])
    assert [f.split(" (")[0] for f in inert] == ["weakref.finalize", "weakref.finalize"]
    assert found == {}


def test_a_handler_that_uninstalls_itself_before_raising_is_still_the_users():
    # "The second Ctrl-C kills": the handler puts the default back, then raises. When it fires, nothing installed
    # names it any more; memprof noted it when the profile started.
    def once(signum, frame):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        raise Preempted

    _preempted_while_memprof_reads_a_shape(once)


@pytest.mark.parametrize("mode", ["exact", "light"])
def test_an_interrupt_right_after_a_saved_hooks_push_leaves_no_pair_of_memprofs_behind(monkeypatch, mode):
    # The storm's rare leak, made certain: a signal handler's exception landing after memprof pushed its
    # saved-tensor pair for a module call and before it recorded the push. The profile's end must still pop it:
    # a pair left on the thread's stack would see every later save (torch.func refuses to run under one).
    from memprof.collect import saved_hooks

    pushed = saved_hooks._push

    def push_then_interrupted(pack, unpack):
        pushed(pack, unpack)
        raise Preempted

    model, x = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)), torch.randn(4, 8)
    with pytest.raises(Preempted):
        with memprof.profile(model, mode=mode):
            monkeypatch.setattr(saved_hooks, "_push", push_then_interrupted)
            model(x).sum().backward()
    monkeypatch.undo()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert torch._C._len_torch_dispatch_stack() == 0
