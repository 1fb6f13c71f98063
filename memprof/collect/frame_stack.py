"""The ledger's stack of module calls in progress (forward and backward frames), for each call's temporaries peak.

The innermost frame is :attr:`Ledger.top`, whose high :meth:`Ledger.add` keeps up to date, and its module is
the one new storages are attributed to (:attr:`Ledger.module_of_new`). The module hooks do the common push and
pop inline (:mod:`.modules`, :mod:`.frames`); these functions do the same for everyone else.
"""

from __future__ import annotations

from ..errors import is_interrupt
from .ledger import Frame, Ledger, new_frame

__all__ = ["push_frame", "pop_frame", "push_frame_below", "remove_frame"]

_new_object = object.__new__


def push_frame(led: Ledger, module: int, backward: bool) -> Frame:
    """Push a frame for a call of ``module``: it becomes the innermost, and the module of new storages.
    (The forward pre-hook of :mod:`.modules` does the same inline.)"""
    frame = _new_object(Frame)
    frame.module, frame.entry, frame.max, frame.backward = module, led.total, led.total, backward
    led.frames.append(frame)
    led.top = frame
    led.module_of_new = module
    return frame


def pop_frame(led: Ledger, frame: Frame) -> list[Frame]:
    """Pop ``frame`` and any frames above it; return them, innermost first."""
    popped: list[Frame] = []
    frames = led.frames
    if frame not in frames:
        return popped
    while frames:
        f = frames.pop()
        popped.append(f)
        if frames:
            parent = frames[-1]
            if f.max > parent.max:
                parent.max = f.max
        if f is frame:
            break
    led.top = frames[-1] if frames else None
    led.module_of_new = led.top.module if led.top is not None else -1
    return popped


def push_frame_below(led: Ledger, module: int, backward: bool, below: Frame) -> Frame:
    """Push a frame under ``below`` (a parent entering after its child, as in backward)."""
    frame = new_frame(module, led.total, backward)
    frame.max = max(frame.max, below.max)
    led.frames.insert(led.frames.index(below), frame)
    return frame


def remove_frame(led: Ledger, frame: Frame) -> bool:
    """Remove one frame wherever it is (backward calls need not nest); keep the others."""
    frames = led.frames
    try:
        i = frames.index(frame)
    except ValueError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return False
    frames.pop(i)
    # The frames above it opened after it and are still open: what they saw happened while it ran (a
    # module's backward ends while its child's, entered on the same gradient, is still open). Only the
    # innermost frame's high is kept up to date as storages come and go.
    for above in frames[i:]:
        if above.max > frame.max:
            frame.max = above.max
    if i > 0 and frame.max > frames[i - 1].max:
        frames[i - 1].max = frame.max
    led.top = frames[-1] if frames else None
    led.module_of_new = led.top.module if led.top is not None else -1
    return True
