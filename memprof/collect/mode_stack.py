"""memprof's dispatch mode beneath modes the user entered after it, and taken out from beneath them.

A schedule installs memprof's mode at the start of each recorded window, often inside a mode the user
enters every step (``with FlopCounterMode(): ...``). Pushed on top, it would be what the user's
``__exit__`` pops (torch pops the top of the stack, c10/core/impl/TorchDispatchModeTLS.cpp), leaving
the user's mode on the stack for good. So memprof's mode goes where it would be had it stayed
installed: beneath the modes entered since the profile began. The same when it leaves while a mode of
the user's is still open above it.

torch keeps three "is a mode in" flags in torch/utils/_python_dispatch.py, saved by each mode on
entry and restored on exit, in stack order. Moving a mode under others swaps which mode restores
what, so the saved values are exchanged to match the new order and the current values are left as
they were. Modes torch keeps outside the plain stack (fake, proxy, functional, pre-dispatch) are never
moved: with one of those above, this returns False and the caller falls back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import is_interrupt
from .torch_compat import MODE_FLAGS_CURRENT as _CURRENT
from .torch_compat import MODE_FLAGS_SAVED as _SAVED
from .torch_compat import dispatch_mode_at, dispatch_stack_len, pop_dispatch_mode, push_dispatch_mode
from .torch_compat import python_dispatch as _pd

if TYPE_CHECKING:
    from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["push_beneath", "pop_from_beneath", "exit_mode", "mode_flags", "restore_mode_flags"]


def _stack() -> "list[TorchDispatchMode]":
    return [dispatch_mode_at(i) for i in range(dispatch_stack_len())]


def _plain(mode: "TorchDispatchMode") -> bool:
    return getattr(mode, "_mode_key", None) is None and getattr(mode, "_dispatch_key", None) is None


def mode_flags() -> tuple[object, ...]:
    """torch's "is a mode in" flags as they are now, for :func:`restore_mode_flags`."""
    return tuple(getattr(_pd, name, None) for name in _CURRENT)


def restore_mode_flags(values: tuple[object, ...]) -> None:
    """Put torch's "is a mode in" flags back to ``values`` (:func:`mode_flags`): what the exits of modes taken off
    the stack without them (a raw pop) would have put back."""
    for name, value in zip(_CURRENT, values):
        if hasattr(_pd, name):
            setattr(_pd, name, value)
    setter = getattr(_pd, "set_is_in_mode_without_ignore_compile_internals", None)
    if setter is not None and values[2] is not None:
        setter(values[2])


def _saved(mode: "TorchDispatchMode") -> "list[object] | None":
    try:
        return [getattr(mode, name)[-1] for name in _SAVED]
    except (AttributeError, IndexError) as failure:  # an older torch, or a mode entered without torch's __enter__
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return None


def _set_saved(mode: "TorchDispatchMode", values: "list[object] | None") -> None:
    if values is None:
        return
    try:
        for name, value in zip(_SAVED, values):
            getattr(mode, name)[-1] = value
    except (AttributeError, IndexError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        pass


def _lift(count: int) -> "list[TorchDispatchMode]":
    return [pop_dispatch_mode(None) for _ in range(count)]  # top first


def _put_back(lifted: "list[TorchDispatchMode]") -> None:
    for mode in reversed(lifted):
        push_dispatch_mode(mode)


def push_beneath(mode: "TorchDispatchMode", depth: int) -> None:
    """Enter ``mode`` at position ``depth`` of this thread's stack, beneath the modes above it (on top
    when there are none, or when one of them cannot be moved)."""
    stack = _stack()
    above = stack[depth:] if 0 <= depth < len(stack) else []
    if not above or not all(_plain(m) for m in above):
        mode.__enter__()  # type: ignore[no-untyped-call]  # TorchDispatchMode's is untyped
        return
    before = mode_flags()
    lifted = _lift(len(above))
    bottom = _saved(lifted[-1])
    mode.__enter__()  # type: ignore[no-untyped-call]  # TorchDispatchMode's is untyped
    # As if entered before them: it restores what the lowest of them had saved, and they saved "a
    # (non-infra) mode is in"; whether a mode ignores compile internals is unchanged by memprof's.
    _set_saved(mode, bottom)
    for m in lifted:
        saved = _saved(m)
        if saved is not None:
            _set_saved(m, [True, True, saved[2]])
    _put_back(lifted)
    restore_mode_flags(before)


def pop_from_beneath(mode: "TorchDispatchMode") -> bool:
    """Exit ``mode`` from wherever it is in this thread's stack; False when it is not there, or when a
    mode above it cannot be moved."""
    stack = _stack()
    where = next((i for i, m in enumerate(stack) if m is mode), None)
    if where is None:
        return False
    above = stack[where + 1:]
    if not above:
        exit_mode(mode)
        return True
    if not all(_plain(m) for m in above):
        return False
    before = mode_flags()
    lifted = _lift(len(above))
    ours = _saved(mode)
    depth = dispatch_stack_len()
    try:
        exit_mode(mode)
    finally:
        # Also when the exit raised (an interrupt): the modes above back as they were, and torch's flags. Only if
        # the mode left (an interrupt after torch's pop) does the lowest of them now restore what memprof's would
        # have; cut short before it, the stack is as it was and running this again finds it so.
        if dispatch_stack_len() < depth:
            _set_saved(lifted[-1], ours)
        _put_back(lifted)
        restore_mode_flags(before)
    return True


def exit_mode(mode: "TorchDispatchMode") -> None:
    """``mode.__exit__``, safe to run again when cut short.

    torch's exit pops the flags the mode saved on entry into torch's globals, and only then pops the mode off the
    stack (``TorchDispatchMode.__exit__``, torch/utils/_python_dispatch.py). A Ctrl-C in between left the lists
    popped and the mode on the stack; the exit run again (an undo step's retry) raised IndexError on an empty list,
    and the mode stayed. Cut short with the mode still on the stack, what the exit popped is put back, and torch's
    flags too, so that running it again runs the whole exit."""
    saved = _saved(mode)
    lengths = [len(getattr(mode, name, ())) for name in _SAVED]
    flags = mode_flags()
    depth = dispatch_stack_len()
    try:
        mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # TorchDispatchMode's is untyped
    except BaseException:
        if dispatch_stack_len() == depth and saved is not None:  # its pop never ran: as before the exit
            for name, value, length in zip(_SAVED, saved, lengths):
                kept = getattr(mode, name)
                if len(kept) < length:
                    kept.append(value)
            restore_mode_flags(flags)
        raise
