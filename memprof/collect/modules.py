"""Module calls: the hooks on every module of the model, and a model that changes.

Every module of the model gets a forward pre-hook and an always-called
post-hook. They begin forwards (an outermost grad-enabled call), keep the
stack of module calls on the run state (which module saved or made a
storage), open a ledger frame per call (its peak and scratch memory,
:mod:`.frames`), push memprof's saved-tensor pair where needed
(:mod:`.saved`), and in the first grad-enabled forward record each call's
shapes and the module's configuration for the per-module formula
(:mod:`.capture`). In exact mode, hooks on a call's inputs and outputs open
and close its backward frame.

No hook goes inside compiled code: torch.compile would trace memprof's code
into its graph (splitting it) or, for hooks added after compilation, never
run them. The call that enters compiled code (a torch.compile wrapper, or
the nearest hooked ancestor of a module compiled in place) is hooked and
marks where memprof cannot see inside (:mod:`.module_table`).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import nn

from ..errors import is_interrupt
from ..vocabulary import Phase
from ..units import format_bytes
from . import timeline as _timeline
from .ledger import BUFFERS, TAGS, Frame, storage_of
from .moves import set_tag
from .frame_stack import pop_frame
from .hook_objects import hook_object
from .module_table import attribute_tensors, tensors_in_args, unique_params
from .saved_hooks import under_checkpoint
from .saved_where import adopt_unseen
from .state import EXACT
from .torch_compat import COMPILER as _COMPILER, graph_task_id as _graph_task_id
from .torch_compat import is_dynamo_compiling as _dynamo_compiling
from .torch_compat import top_saved_hooks as _top_saved_hooks

if TYPE_CHECKING:
    from .engine_watch import EngineWatch
    from .aliases import Args, Kwargs
    from .capture import Capture
    from .dispatch import StorageTracker
    from .frames import Frames
    from .kv_cache import CacheTracker
    from .ledger import Ledger
    from .module_table import ModuleTable
    from .params import ParamTracker
    from .phases import PhaseTracker
    from .saved import SavedTracker
    from .shards import ShardTracker
    from .state import Run
    from .timeline import Timeline
    from .undo import UndoStack

    #: memprof's forward pre-hook and hook of a module (registered with_kwargs).
    _PreHook = Callable[[nn.Module, Args, Kwargs], None]
    _PostHook = Callable[[nn.Module, Args, Kwargs, object], None]

__all__ = ["ModuleTracker"]

_get_ident = threading.get_ident
_grad_enabled = torch.is_grad_enabled
_now = time.perf_counter_ns
_new_object = object.__new__
_weakref = weakref.ref
_PLAIN = torch.Tensor
_FORWARD = Phase.FORWARD
_BACKWARD = Phase.BACKWARD
_KEPT_BY_CHECKPOINT = TAGS.index("kept_by_checkpoint")


class ModuleTracker:
    """The hooks on the model's modules, and what they call at each module call.

    ``at_forward`` is the schedule's say at a forward's start (None without a schedule): False when memprof
    does not record it.
    """

    def __init__(self, run: "Run", ledger: "Ledger", table: "ModuleTable", capture: "Capture", frames: "Frames",
                 timeline: "Timeline", storages: "StorageTracker", params: "ParamTracker", saved: "SavedTracker",
                 phases: "PhaseTracker", kv: "CacheTracker", shards: "ShardTracker | None",
                 stack: "UndoStack") -> None:
        self.run = run
        self.ledger = ledger
        self.table = table
        self.capture = capture
        self.frames = frames
        self.timeline = timeline
        self.storages = storages
        self.params = params
        self.saved = saved
        self.phases = phases
        self.kv = kv
        self.shards = shards
        self.stack = stack
        self.at_forward: "Callable[[], bool] | None" = None
        self.calls = 0  # module forward calls seen
        #: Light mode's hooks on its forward outputs' autograd nodes (engine_watch's docstring says why); None
        #: in exact mode.
        self.engine_watch: "EngineWatch | None" = None
        self.marks: list[tuple[int, int, int]] = []  # per open call: module, calls and unseen saves at entry

    # -- the hooks -----------------------------------------------------------------------------

    def adopt(self, model: nn.Module) -> None:
        """Add the model's modules not in the table yet (all of them at the start) and hook them. Each hook
        goes on the undo stack the moment it is installed, so that a failure half-way removes it."""
        stack = self.stack
        root = self.table.root_ref()
        shards = self.shards
        for index, mod, hooked in self.table.add(model):
            for t in attribute_tensors(mod):
                # A tensor kept as a plain attribute (a mask, a rotary table) is module state like a buffer.
                self.storages.add_tensor(t, BUFFERS)
            if not hooked:
                continue
            is_root = mod is root
            # A torch.compile wrapper of the model that the user calls runs these hooks inside its
            # compiled frame: they do nothing under dynamo's tracing (is_compiling), so the graph stays
            # whole and the forward is reported as unseen rather than split by memprof's code.
            pre_hook, post_hook = _pre_hook(self, index, is_root), _post_hook(self, index, is_root)
            sharded = shards is not None and id(mod) in shards.groups
            # FSDP2 gathers a module's parameters in a pre-hook it puts first: memprof's goes before it, so
            # that the gathering belongs to the forward, and a second one after it finds what was gathered.
            stack.callback(mod.register_forward_pre_hook(hook_object(pre_hook), with_kwargs=True,
                                                         prepend=sharded).remove)
            if sharded:
                assert shards is not None
                stack.callback(mod.register_forward_pre_hook(hook_object(lambda m, _a: shards.unsharded(m))).remove)
                stack.callback(mod.register_forward_hook(hook_object(lambda m, _a, _o: shards.resharded(m))).remove)
            stack.callback(mod.register_forward_hook(hook_object(post_hook), with_kwargs=True, always_call=True).remove)
        for p in unique_params(model):
            self.params.adopt(p)

    def forward_began(self, is_root: bool, grad: bool, args: "Args", kwargs: "Kwargs") -> None:
        """An outermost call of the model: its phase (a forward; with a KV cache, a prefill or a decode), what
        the model gained since the last, and what it was handed.

        A forward is a call of the root, or an outermost call of its submodules with autograd on
        (model.encoder(x), then model.decoder(h); a ModuleDict's members). A submodule run under no_grad
        outside the model's forward (a frozen encoder, a probe) is not one."""
        run, phases, kv = self.run, self.phases, self.kv
        # Inference with a KV cache: a phase per prefill and decode call (memprof.collect.kv_cache).
        kind = kv.before_call(args, kwargs) if is_root and not run.calls else None
        if kind is not None:
            phases.begin(kind)
            kv.relabel_prefills()
        elif run.phase is not Phase.FORWARD and (is_root or grad):
            phases.begin(Phase.FORWARD)
        params = self.params
        if params.changed or params.pending:
            self.sync()
        params.resync_storages()
        capture = self.capture
        if grad and not capture.on and not capture.done and run.phase is Phase.FORWARD:
            # The first grad-enabled forward gives the formula its shapes, also when a no_grad call of the
            # model began this forward.
            capture.begin()
        storages = self.storages
        try:
            storages.mark_inputs(args, made_in_block_too=is_root)
            storages.mark_inputs(kwargs, made_in_block_too=is_root)
        except Exception as exc:  # what the user's objects raise when read: the step runs as without memprof
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            run.note(f"an input of the model could not be read ({type(exc).__name__}: {str(exc)[:80]}): what it "
                     "holds is not counted among inputs")
        storages.note_autocast()

    def kept_by_checkpoint(self, args: "Args", kwargs: "Kwargs") -> None:
        """A module ran inside a checkpointed region: its inputs, if they outlive the forward, are what
        the region keeps instead of its saves (inside the region inputs are intermediates, freed after
        the forward, so only the region's own inputs stay counted). The post-hook tells: inside
        torch.utils.checkpoint's region its own pair is on the stack (or beneath memprof's chain), and with
        memprof's own pair on top, or none, it cannot be."""
        for t in tensors_in_args(args, kwargs):
            entry = self.storages.entry_of(t)
            if entry is not None:
                set_tag(self.ledger, entry, _KEPT_BY_CHECKPOINT)

    def children_skipped(self, index: int, unseen: int) -> None:
        """A call of a module with hooked children ran none of their hooks: compiled code ran it (a
        torch.compile wrapper of the model calls it from compiled code, which skips hooks added after
        compilation), or its forward called them through .forward(). What it saved out of dispatch's
        sight is an activation, not an input; its later calls are treated the same way."""
        adopt_unseen(self.ledger, self.run, self.table, self.table.unseen_saves[unseen:])
        self.table.skipped(index)

    def foreign_call(self, index: int) -> None:
        """A call in another thread than the profile's, without memprof's per-thread hooks: the call is seen,
        what it does is not."""
        self.run.foreign_threads.add(_get_ident())
        self.table.info[index].calls += 1

    def forward_after_unseen_backward(self) -> None:
        """A forward outside autograd's engine while the backward phase is still open: that backward ended
        where memprof could not queue its end (compiled autograd runs it as a graph, and nothing queued there
        runs at its end), so it ends here, before this forward (a block recomputing in backward is inside the
        engine)."""
        self.phases.backward_done()

    def compiled_call_ended(self, output: object) -> None:
        """The call that entered compiled code returned: in exact mode what it returns was allocated out of
        dispatch's sight."""
        self.table.compiled_depth -= 1
        if self.run.mode == EXACT:
            for t in tensors_in_args((output,), None):
                self.storages.register_output(t)

    def close_frames_from(self, frame: Frame) -> None:
        """The call's forward frame closes with the frames left open inside it (backward frames)."""
        for f in pop_frame(self.ledger, frame):
            self.frames.close_frame(f)

    def unhookable(self, index: int, exc: Exception) -> None:
        """A call whose inputs or outputs memprof cannot read or hook for its backward frame (a subclass whose
        ``requires_grad`` raises): the call runs as without memprof, and the note says what is missing."""
        self.run.note(f"module {self.table.path(index)}: a tensor it took or returned could not be read "
                      f"({type(exc).__name__}: {str(exc)[:80]}), so its per-module backward figures are not measured")

    # -- a model that changes ------------------------------------------------------------------

    def registration_hook(self, module: nn.Module, name: str, value: object) -> None:
        # Global: fires for every module in the process. Only the model's matter; what changed
        # is adopted at the next point where the model is not running (a forward's start, a step).
        if self.run.active and id(module) in self.table.index and value is not None:
            self.params.changed = True

    def sync(self) -> None:
        """Adopt parameters and modules the model gained since the last look (``params.changed``), and lazy
        parameters that took their shapes (``params.pending``); a note says from which step. Callers check
        both first: this runs at every forward and optimizer step."""
        params = self.params
        model = self.table.root_ref()
        if model is None:
            return
        before_params, before_mods = len(params.refs), len(self.table.info)
        if params.pending:
            pending = [r() for r in params.pending]
            params.pending = []
            for p in pending:
                if p is not None:
                    params.adopt(p)
        if params.changed:
            params.changed = False
            self.adopt(model)
        new_params = [p for p in (r() for r in params.refs[before_params:]) if p is not None]
        new_mods = len(self.table.info) - before_mods
        phases = self.phases
        run = self.run
        if new_params and run.ops == phases.phase_ops_start:
            phases.phase_start = self.ledger.totals.copy()  # the phase has just begun: it starts with them
        if new_params or new_mods:
            nbytes = sum(self.ledger.size_of(st.nbytes()) for st in map(storage_of, new_params) if st is not None)
            what = [f"{len(new_params)} parameter(s) ({format_bytes(nbytes)})"] if new_params else []
            if new_mods:
                what.append(f"{new_mods} module(s)")
            run.changes.append(f"step {run.step}: " + " and ".join(what))


# ---------------------------------------------------------------------- the hooks of one module
#
# Every module call of the model runs both, so their common path makes no Python call it can do without:
# the ledger's frame push and pop, the timeline's sample, the saved-tensor pair's check and the walk over
# plain-tensor arguments are written out here rather than called (each call is a Python frame, which costs
# more than the few lines it saves), and the closures the backward frames hook on tensors are made once
# per module, not per call. The methods they stand for (frame_stack.push_frame and pop_frame, Timeline.sample,
# SavedTracker.cover and uncover, Frames.close_frame) still do the same for everyone else. What happens on a
# rare path (a call in another thread, a backward that ended unseen, compiled code returning, frames left open
# inside a call, a checkpointed region's inputs, the schedule's say at a forward) is a method of the tracker,
# called only there.


def _pre_hook(tracker: ModuleTracker, index: int, is_root: bool) -> "_PreHook":
    run, table, led, saved, frames = tracker.run, tracker.table, tracker.ledger, tracker.saved, tracker.frames
    calls, marks, stack, timeline = run.calls, tracker.marks, led.frames, tracker.timeline
    tensor_hooks, info = frames.tensor_hooks, table.info[index]
    path = info.path or "<model>"
    exit_hook = frames.exit_hook(index) if run.backward_frames else None  # made once: exact mode uses it
    def pre_hook(module: nn.Module, args: "Args", kwargs: "Kwargs") -> None:
        at_forward = tracker.at_forward
        if at_forward is not None and (is_root or not calls) and not at_forward():
            return None  # a schedule that does not record this forward (windows.Windows.at_forward)
        if not run.active or _dynamo_compiling() or _COMPILER._is_compiling_flag:  # is_compiling(), one frame
            # Under dynamo's tracing (a model compiled inside the block) memprof's code must not
            # enter the graph: the compiled call is then measured from outside, as compiled code.
            return None
        if _get_ident() != run.thread and _graph_task_id() == -1:
            tracker.foreign_call(index)
            return None
        if led.released:
            led.settle()  # what torch released since: the frames and samples read the totals
        in_backward = run.phase is _BACKWARD
        if in_backward and (is_root or not calls) and _graph_task_id() == -1:
            tracker.forward_after_unseen_backward()
            in_backward = False
        grad = _grad_enabled()
        if (is_root or not calls) and not in_backward:
            tracker.forward_began(is_root, grad, args, kwargs)
        info.calls += 1
        if grad:
            # In backward too: a block checkpointed the reentrant way recomputes its forward there. The common
            # case (memprof's own pair already innermost: a parent pushed it) needs no push.
            top = _top_saved_hooks(False)
            if top is None or top[0] is not saved.hooks.own_pack:
                saved.cover(index)
        if index in table.brackets:
            table.compiled_depth += 1
            table.compiled_calls += 1
        if tracker.capture.on and not in_backward:
            tracker.capture.call_began(index, args, kwargs)
        calls.append(index)
        n = tracker.calls = tracker.calls + 1
        marks.append((index, n, len(table.unseen_saves)))
        total = led.total
        frame = _new_object(Frame)  # frame_stack.push_frame, written out
        frame.module, frame.entry, frame.max, frame.backward = index, total, total, False
        stack.append(frame)
        led.top = frame
        led.module_of_new = index
        if run.timeline and not in_backward:  # a checkpointed module recomputing records no exit either
            samples = timeline.samples
            if len(samples) < _timeline._MAX_SAMPLES:  # Timeline.sample, written out
                timeline.seq += 1
                samples.append((timeline.seq, run.step, run.phase, path, tuple(led.totals), _now(), "enter"))
            else:  # the cap, and its note
                timeline.sample(path, "enter")
        if run.backward_frames and grad and not in_backward:
            plain = not kwargs  # the common case, positional plain tensors, without walking nested containers
            if plain:
                for a in args:
                    if type(a) is not _PLAIN:
                        plain = False
                        break
            try:
                # Plain: every argument is a tensor (its type() above), which mypy cannot follow.
                inputs: "Sequence[torch.Tensor]" = args if plain else tensors_in_args(  # type: ignore[assignment]
                    args, kwargs)
                for a in inputs:
                    if a.requires_grad:
                        # A tensor hook, not a pre-hook on a.grad_fn: torch.autograd.grad(out, [a])
                        # captures a's gradient without running a.grad_fn, and only tensor hooks fire then.
                        key = (id(a), index)  # Frames.hook_tensor, written out: once per tensor and module
                        known = tensor_hooks.get(key)
                        if known is None or known[0]() is not a:
                            # (torch's Tensor.register_hook is untyped.)
                            tensor_hooks[key] = (_weakref(a), a.register_hook(exit_hook))  # type: ignore[no-untyped-call]
            except Exception as exc:  # an input that cannot be read or hooked: the step runs as without memprof
                if is_interrupt(exc):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                tracker.unhookable(index, exc)
        return None
    return pre_hook


def _post_hook(tracker: ModuleTracker, index: int, is_root: bool) -> "_PostHook":
    run, table, led, saved = tracker.run, tracker.table, tracker.ledger, tracker.saved
    calls, marks, stack, frames, timeline = run.calls, tracker.marks, led.frames, tracker.frames, tracker.timeline
    scoped, kv, info, path = saved.scoped, tracker.kv, table.info[index], table.info[index].path or "<model>"
    enter_hook = frames.enter_hook(index) if run.backward_frames else None  # made once: exact mode uses it
    def post_hook(module: nn.Module, args: "Args", kwargs: "Kwargs", output: object) -> None:
        if not run.active or _dynamo_compiling() or _COMPILER._is_compiling_flag or (  # is_compiling(), one frame
                _get_ident() != run.thread and _graph_task_id() == -1):
            return None
        if led.released:
            led.settle()  # what torch released since: the frames and samples read the totals
        if scoped and scoped[-1] == index:  # this call pushed memprof's saved-tensor pair
            saved.uncover(index)
        if index in table.brackets and table.compiled_depth > 0:
            tracker.compiled_call_ended(output)
        frame = stack[-1] if stack else None  # the call's forward frame closes (with any left open inside it)
        if frame is not None and frame.module == index:
            if frame.backward:
                tracker.close_frames_from(frame)
            else:  # frame_stack.pop_frame and Frames.close_frame, written out for the common case: the frame on top
                stack.pop()
                high = frame.max
                if stack:
                    parent = led.top = stack[-1]
                    led.module_of_new = parent.module
                    if high > parent.max:
                        parent.max = high
                else:
                    led.top, led.module_of_new = None, -1
                if run.mode == EXACT:  # op-level memory is not seen in light mode
                    entry, total = frame.entry, led.total
                    rise = high - entry  # what the call added at its worst
                    scratch = high - (total if total > entry else entry)  # needed but released by its end
                    peak, tmp = info.fwd_peak, info.fwd_tmp
                    info.fwd_peak = rise if peak is None or rise > peak else peak
                    if tmp is None or scratch > tmp:  # tmp is never below 0
                        info.fwd_tmp = scratch if scratch > 0 else 0
        if calls and calls[-1] == index:
            calls.pop()
        if marks and marks[-1][0] == index:
            _index, count, unseen = marks.pop()
            if count == tracker.calls and index in table.parents and run.phase is _FORWARD:
                tracker.children_skipped(index, unseen)
        if is_root and tracker.params.pending:
            tracker.sync()  # lazy modules took their shapes in this forward
        if not is_root and kv.active is not None:
            kv.layer_done(args, kwargs)
        if not calls:
            table.unseen_saves.clear()
            if tracker.engine_watch is not None:  # light mode: its queued gradients need a hook in each backward
                tracker.engine_watch.hook_output(output)
            if is_root:
                kv.after_call(args, kwargs, output)  # and a prefill's or a decode's phase ends with its call
        if tracker.capture.on:
            tracker.capture.call_ended(index, module, output, args, kwargs)
        if run.phase is _FORWARD and run.mode == EXACT:
            top = _top_saved_hooks(False)
            if top is not None and top[0] is not saved.hooks.own_pack and under_checkpoint():
                tracker.kept_by_checkpoint(args, kwargs)
        if run.timeline and run.phase is not _BACKWARD:  # a checkpointed module recomputing: no exit either
            samples = timeline.samples
            if len(samples) < _timeline._MAX_SAMPLES:  # Timeline.sample, written out
                timeline.seq += 1
                samples.append((timeline.seq, run.step, run.phase, path, tuple(led.totals), _now(), "exit"))
            else:  # the cap, and its note
                timeline.sample(path, "exit")
        if enter_hook is not None and run.backward_frames and _grad_enabled() and run.phase is _FORWARD:
            try:
                for t in (output,) if type(output) is _PLAIN else tensors_in_args((output,), None):
                    if t.requires_grad:
                        if t.grad_fn is not None:  # a pre-hook on the node: Frames.enter_hook says why
                            frames.node_hooks.append(t.grad_fn.register_prehook(enter_hook))
                        else:
                            frames.hook_tensor(t, index, enter_hook)
            except Exception as exc:  # as in the pre-hook
                if is_interrupt(exc):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                tracker.unhookable(index, exc)
        return None
    return post_hook
