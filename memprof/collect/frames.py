"""Module frames: what each module call added at its worst and needed only while it ran, forward and backward.

A forward frame opens in the module's pre-hook and closes in its post-hook (:mod:`.modules`). A backward frame
opens when the gradient of the call's output arrives (a pre-hook on the output's node, or a tensor hook) and
closes when the gradients of its inputs are computed (tensor hooks on them); the module hooks place them,
with the hooks made here. These hooks are made per step and removed when the step ends, once its backward
has run, or with the profile. Exact mode only: op-level
memory is not seen in light mode.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Callable

import torch

from ..vocabulary import Phase
from . import timeline as _timeline
from .ledger import Frame
from .frame_stack import pop_frame, push_frame_below, remove_frame
from .state import EXACT
from .torch_compat import COMPILER as _COMPILER, is_dynamo_compiling as _dynamo_compiling

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .ledger import Ledger
    from .module_table import ModuleTable
    from .phases import PhaseTracker
    from .state import Run
    from .timeline import Timeline

__all__ = ["Frames"]

_now = time.perf_counter_ns
_new_object = object.__new__


class Frames:
    """The frames of module calls, and the per-step hooks that bound the backward ones."""

    def __init__(self, ledger: "Ledger", run: "Run", table: "ModuleTable", phases: "PhaseTracker",
                 timeline: "Timeline") -> None:
        self.ledger = ledger
        self.run = run
        self.table = table
        self.phases = phases
        self.timeline = timeline
        self.bw_frames: dict[int, "Frame"] = {}
        self.tensor_hooks: dict[tuple[int, int], tuple[weakref.ref[torch.Tensor], RemovableHandle]] = {}
        #: Hooks on autograd nodes made for this step's backward (also by :mod:`.graph_saves`).
        self.node_hooks: "list[RemovableHandle]" = []

    # -- closing a frame ---------------------------------------------------------------------

    def close_frame(self, frame: "Frame") -> None:
        if self.run.mode != EXACT:
            return  # op-level memory is not seen in light mode
        info = self.table.info[frame.module]
        led = self.ledger
        if led.released:
            led.settle()
        total = led.total
        rise = frame.max - frame.entry  # what the call added at its worst
        scratch = max(0, frame.max - max(total, frame.entry))  # what it needed but released by its end
        if frame.backward:
            info.bwd_peak = rise if info.bwd_peak is None else max(info.bwd_peak, rise)
            info.bwd_tmp = scratch if info.bwd_tmp is None else max(info.bwd_tmp, scratch)
        else:
            info.fwd_peak = rise if info.fwd_peak is None else max(info.fwd_peak, rise)
            info.fwd_tmp = scratch if info.fwd_tmp is None else max(info.fwd_tmp, scratch)

    def close_backward_frames(self) -> None:
        """Backward is over: every backward frame still open closes."""
        led = self.ledger
        for f in list(led.frames):
            if f.backward:
                for g in pop_frame(led, f):
                    self.close_frame(g)
                break
        self.bw_frames.clear()

    # -- backward frames -----------------------------------------------------------------------

    def enter_hook(self, index: int) -> Callable[[object], None]:
        """The hook that opens module ``index``'s backward frame (its output's gradient arrived). It runs for
        every module call's backward: frame_stack.push_frame, ModuleTable.is_ancestor and Timeline.sample are
        written out in it (each call would be a Python frame).

        The module post-hook puts it on the output's node as a pre-hook where the output has a ``grad_fn``: a
        pre-hook on the node fires when the engine runs it, once every gradient flowing into it is complete,
        when a tensor hook on the output would, at a ninth of the cost (2 us against 19). They differ when
        torch.autograd.grad stops at the output (the node never runs); then the module has no backward in that
        pass. The node hooks are removed when the step ends (its backward has run) or with the profile."""
        run, led, table, timeline, bw_frames = self.run, self.ledger, self.table, self.timeline, self.bw_frames
        stack = led.frames
        path = table.info[index].path

        def enter(_grad: object) -> None:
            if not run.active or _dynamo_compiling() or _COMPILER._is_compiling_flag:  # is_compiling()
                return
            if led.released:
                led.settle()  # what torch released since: the frames and samples read the totals
            if run.phase is not Phase.BACKWARD:
                self.phases.backward_started()
            if index in bw_frames:
                return
            top = led.top
            # Is this module an ancestor of the innermost one (ModuleTable.is_ancestor)?
            if top is not None and top.backward and (path == "" or table.info[top.module].path.startswith(path + ".")):
                # A parent's output gradient can arrive after its last child's (same tensor,
                # hooks in registration order): keep the child innermost.
                bw_frames[index] = push_frame_below(led, index, True, top)
            else:
                total = led.total
                frame = _new_object(Frame)
                frame.module, frame.entry, frame.max, frame.backward = index, total, total, True
                stack.append(frame)
                led.top = frame
                led.module_of_new = index
                bw_frames[index] = frame
            if run.timeline:
                samples = timeline.samples
                if len(samples) < _timeline._MAX_SAMPLES:
                    timeline.seq += 1
                    samples.append((timeline.seq, run.step, run.phase, path or "<model>", tuple(led.totals), _now(),
                                    "enter"))
                else:  # the cap, and its note
                    timeline.sample(path or "<model>", "enter")

        return enter

    def exit_hook(self, index: int) -> Callable[[object], None]:
        """The hook that closes module ``index``'s backward frame (its inputs' gradients are computed), with
        frame_stack.remove_frame (for the frame on top), Frames.close_frame and Timeline.sample written out."""
        run, led, timeline, bw_frames = self.run, self.ledger, self.timeline, self.bw_frames
        stack = led.frames
        info = self.table.info[index]
        path = info.path

        def exit_(_grads: object) -> None:
            if not run.active or _dynamo_compiling() or _COMPILER._is_compiling_flag:  # is_compiling()
                return
            frame = bw_frames.pop(index, None)
            if frame is None:
                return
            if led.released:
                led.settle()  # what torch released since: the frames and samples read the totals
            # Only this module's frame ends: a successor's gradient is often this
            # module's output gradient, which also starts the successor's frame.
            if stack and stack[-1] is frame:
                stack.pop()
                if stack:
                    parent = led.top = stack[-1]
                    led.module_of_new = parent.module
                    if frame.max > parent.max:
                        parent.max = frame.max
                else:
                    led.top = None
                    led.module_of_new = -1
            elif not remove_frame(led, frame):
                return
            if run.mode == EXACT:  # Frames.close_frame, written out (op-level memory is not seen in light mode)
                entry, high = frame.entry, frame.max
                rise = high - entry  # what the call added at its worst
                total = led.total
                scratch = high - (total if total > entry else entry)  # needed but released by its end
                if scratch < 0:
                    scratch = 0
                peak, tmp = info.bwd_peak, info.bwd_tmp
                info.bwd_peak = rise if peak is None or rise > peak else peak
                info.bwd_tmp = scratch if tmp is None or scratch > tmp else tmp
            if run.timeline:
                samples = timeline.samples
                if len(samples) < _timeline._MAX_SAMPLES:
                    timeline.seq += 1
                    samples.append((timeline.seq, run.step, run.phase, path or "<model>", tuple(led.totals), _now(),
                                    "exit"))
                else:  # the cap, and its note
                    timeline.sample(path or "<model>", "exit")

        return exit_

    # -- the hooks' lifetime -------------------------------------------------------------------

    def hook_tensor(self, t: torch.Tensor, index: int, hook: Callable[[object], None]) -> None:
        """A tensor hook for module ``index``, once per tensor (a parameter handed to a submodule
        every forward keeps one hook, not one per call); every one is removed with the profile."""
        key = (id(t), index)
        known = self.tensor_hooks.get(key)
        if known is not None and known[0]() is t:
            return
        handle = t.register_hook(hook)  # type: ignore[no-untyped-call]  # torch's Tensor.register_hook is untyped
        self.tensor_hooks[key] = (weakref.ref(t), handle)

    def prune_hooks(self) -> None:
        """At a step's end its backward has run: drop the node and non-leaf hooks made for it."""
        for handle in self.node_hooks:
            handle.remove()
        self.node_hooks.clear()
        for key, (ref, handle) in list(self.tensor_hooks.items()):
            t = ref()
            if t is None or t.grad_fn is not None:
                handle.remove()
                del self.tensor_hooks[key]

    def remove_hooks(self) -> None:
        for _ref, handle in self.tensor_hooks.values():
            handle.remove()
        self.tensor_hooks.clear()
        for handle in self.node_hooks:
            handle.remove()
        self.node_hooks.clear()
