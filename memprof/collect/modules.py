"""Module calls: forward and backward frames per module, and what each call was handed.

Every module of the model gets a forward pre-hook and an always-called
post-hook. They begin forwards (an outermost grad-enabled call), keep the
stack of module calls (which module saved or made a storage), open a ledger
frame per call (its peak and scratch memory), push memprof's saved-tensor
pair where needed, and in the first grad-enabled forward record each call's
shapes and the module's configuration for the per-module formula. In exact
mode, hooks on a call's inputs and outputs open and close its backward frame.

No hook goes inside compiled code: torch.compile would trace memprof's code
into its graph (splitting it) or, for hooks added after compilation, never
run them. The call that enters compiled code (a torch.compile wrapper, or
the nearest hooked ancestor of a module compiled in place) is hooked and
marks where memprof cannot see inside.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..vocabulary import Phase
from ..record.specs import ModuleCall, TensorSpec, plain_config
from ..record.trace import parent_path
from .ledger import BUFFERS, TAGS, Frame
from .saved_hooks import under_checkpoint

_KEPT_BY_CHECKPOINT = TAGS.index("kept_by_checkpoint")

if TYPE_CHECKING:
    from .profiler import Profiler

__all__ = ["ModuleTracker", "ModuleInfo", "is_compile_wrapper", "unique_params", "tensors_in_args"]

_get_ident = threading.get_ident
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)
_TAG = {name: i for i, name in enumerate(TAGS)}


class ModuleInfo:
    """What the profile learns about one module: its calls, saved bytes and peaks."""

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


class ModuleTracker:
    """The model's modules, their hooks and frames."""

    def __init__(self, prof: "Profiler", model: nn.Module) -> None:
        self.prof = prof
        self.ledger = prof.ledger
        self.root_ref = weakref.ref(model)
        self.info: list[ModuleInfo] = []
        self.refs: list[weakref.ref] = []
        self.index: dict[int, int] = {}  # id(module) -> its row in the tables
        self.params: list[list[weakref.ref]] = []  # each module's parameters (its own and its children's)
        # The tag a storage saved while this module is innermost gets when no op rule named it.
        self.saved_tag: list[int] = []
        self.brackets: set[int] = set()  # modules whose calls run compiled code memprof cannot see into
        self.compiled_paths: list[str] = []
        self.unhooked: set[int] = set()  # modules inside compiled code: no hooks, no per-module figures
        self.parents: set[int] = set()  # modules with hooked children
        self.stack: list[int] = []  # forward calls in progress, innermost last
        self.bw_frames: dict[int, Frame] = {}
        self.tensor_hooks: dict[tuple[int, int], tuple[weakref.ref, Any]] = {}
        self.node_hooks: list[Any] = []
        self.foreign_threads: set[int] = set()
        self.compiled_calls = 0
        self.compiled_depth = 0
        self.calls = 0  # module forward calls seen
        self.marks: list[tuple[int, int, int]] = []  # per open call: module, calls and unseen saves at entry
        self.unseen_saves: list[int] = []  # unknown storages saved as inputs in the current outermost call
        self.skipped_paths: list[str] = []  # modules whose calls ran none of their children's hooks
        # The first grad-enabled forward's calls, for the per-module formula.
        self.capture = False
        self.captured = False
        self.pending: dict[int, tuple[TensorSpec, ...]] = {}
        self.module_calls: list[tuple[int, ModuleCall]] = []

    # -- the table and the hooks -------------------------------------------------------

    def adopt(self, model: nn.Module) -> None:
        """Add the model's modules not in the table yet (all of them at the start) and hook them."""
        prof = self.prof
        stack = prof.stack
        assert stack is not None
        from ..anatomy.activations import saved_bytes_rule

        inside: list[str] = []  # path prefixes of compiled code
        rows: dict[str, int] = {}
        root = self.root_ref()
        for path, mod in model.named_modules():
            compiled_here = any(path == p or path.startswith(p + ".") for p in inside)
            known = self.index.get(id(mod))
            if known is not None and self.refs[known]() is mod:
                rows[path] = known
                if not compiled_here and getattr(mod, "_compiled_call_impl", None) is not None:
                    inside.append(path)
                elif not compiled_here and is_compile_wrapper(mod):
                    inside.append(f"{path}._orig_mod" if path else "_orig_mod")
                continue
            index = len(self.info)
            rows[path] = index
            self.info.append(ModuleInfo(path or "", type(mod).__name__))
            self.refs.append(weakref.ref(mod))
            self.index[id(mod)] = index
            self.params.append([weakref.ref(p) for p in unique_params(mod)])
            for t in attribute_tensors(mod):
                # A tensor kept as a plain attribute (a mask, a rotary table) is module state like a buffer.
                prof.storages.add_tensor(t, BUFFERS)
            if any(True for _ in mod.children()):
                self.saved_tag.append(_TAG["saved_in_container_code"])
            elif saved_bytes_rule(mod) is None:
                self.saved_tag.append(_TAG["saved_in_module_without_rule"])
            else:
                self.saved_tag.append(-1)
            if compiled_here:
                self.unhooked.add(index)
                continue
            if getattr(mod, "_compiled_call_impl", None) is not None:
                # Compiled in place: its own hooks would run inside the compiled code.
                self.unhooked.add(index)
                inside.append(path)
                parent = parent_path(path)
                if parent in rows:
                    self.brackets.add(rows[parent])
                self.compiled_paths.append(path or "<model>")
                continue
            if is_compile_wrapper(mod):
                inside.append(f"{path}._orig_mod" if path else "_orig_mod")
                self.brackets.add(index)
                self.compiled_paths.append(path or "<model>")
            if path and parent_path(path) in rows:
                self.parents.add(rows[parent_path(path)])
            is_root = mod is root
            # A torch.compile wrapper of the model that the user calls runs these hooks inside its
            # compiled frame: they do nothing under dynamo's tracing (is_compiling), so the graph stays
            # whole and the forward is reported as unseen rather than split by memprof's code.
            pre_hook, post_hook = self._pre_hook(index, is_root), self._post_hook(index, is_root)
            shards = prof.shards
            sharded = shards is not None and id(mod) in shards.groups
            # FSDP2 gathers a module's parameters in a pre-hook it puts first: memprof's goes before it, so
            # that the gathering belongs to the forward, and a second one after it finds what was gathered.
            stack.callback(mod.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=sharded).remove)
            if sharded:
                stack.callback(mod.register_forward_pre_hook(lambda m, _a: shards.unsharded(m)).remove)
                stack.callback(mod.register_forward_hook(lambda m, _a, _o: shards.resharded(m)).remove)
            stack.callback(mod.register_forward_hook(post_hook, with_kwargs=True, always_call=True).remove)
        for p in unique_params(model):
            prof.params.adopt(p)

    def _pre_hook(self, index: int, is_root: bool):
        prof = self.prof

        def pre_hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            windows = prof.windows
            if windows is not None and (is_root or not self.stack) and not _is_compiling() and (
                    prof.active or windows.paused) and _get_ident() == prof.thread and (
                    prof.phases.current is not Phase.BACKWARD) and _graph_task_id() == -1:
                # A schedule: a forward is where a step that ended closes, and memprof pauses or resumes.
                if not windows.at_forward():
                    return None
            if not prof.active or _is_compiling():
                # Under dynamo's tracing (a model compiled inside the block) memprof's code must not
                # enter the graph: the compiled call is then measured from outside, as compiled code.
                return None
            if _get_ident() != prof.thread and _graph_task_id() == -1:
                # Another thread, without memprof's per-thread hooks: the call is seen, what it does is not.
                self.foreign_threads.add(_get_ident())
                self.info[index].calls += 1
                return None
            phases = prof.phases
            info = self.info[index]
            in_backward = phases.current is Phase.BACKWARD
            grad = torch.is_grad_enabled()
            # A forward is a call of the root, or an outermost call of its submodules with autograd on
            # (model.encoder(x), then model.decoder(h); a ModuleDict's members). A submodule run under
            # no_grad outside the model's forward (a frozen encoder, a probe) is not one.
            if (is_root or not self.stack) and not in_backward:
                # Inference with a KV cache: a phase per prefill and decode call (memprof.collect.kv_cache).
                kind = prof.kv.before_call(args, kwargs) if is_root and not self.stack else None
                if kind is not None:
                    phases.begin(kind)
                    prof.kv.relabel_prefills()
                elif phases.current is not Phase.FORWARD and (is_root or grad):
                    phases.begin(Phase.FORWARD)
                if prof.params.changed or prof.params.pending:
                    prof.params.sync()
                prof.params.resync_storages()
                if grad and not self.capture and not self.captured and phases.current is Phase.FORWARD:
                    # The first grad-enabled forward gives the formula its shapes, also when a no_grad
                    # call of the model began this forward.
                    self.capture = True
                    self.pending = {}
                prof.storages.mark_inputs(args, made_in_block_too=is_root)
                prof.storages.mark_inputs(kwargs, made_in_block_too=is_root)
                prof.storages.note_autocast()
            info.calls += 1
            if grad:
                # In backward too: a block checkpointed the reentrant way recomputes its forward there.
                prof.saved.cover(index)
            if index in self.brackets:
                self.compiled_depth += 1
                self.compiled_calls += 1
            if self.capture and not in_backward:
                self.pending[index] = tuple(TensorSpec.of(t) for t in tensors_in_args(args, kwargs)
                                            if t.is_floating_point() or not t.is_complex())
            self.stack.append(index)
            self.calls += 1
            self.marks.append((index, self.calls, len(self.unseen_saves)))
            self.ledger.push_frame(index, backward=False)
            if prof.timeline and not in_backward:  # a checkpointed module recomputing records no exit either
                phases.sample(info.path or "<model>", "enter")
            if prof.backward_frames and grad and not in_backward:
                hook = None
                for a in tensors_in_args(args, kwargs):
                    if a.requires_grad:
                        # A tensor hook, not a pre-hook on a.grad_fn: torch.autograd.grad(out, [a])
                        # captures a's gradient without running a.grad_fn, and only tensor hooks fire then.
                        hook = hook or self._bw_exit(index)
                        self.hook_tensor(a, index, hook)
            return None

        return pre_hook

    def _post_hook(self, index: int, is_root: bool):
        prof = self.prof

        def post_hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if not prof.active or _is_compiling() or (_get_ident() != prof.thread and _graph_task_id() == -1):
                return None
            phases = prof.phases
            prof.saved.uncover(index)
            if index in self.brackets and self.compiled_depth > 0:
                self.compiled_depth -= 1
                if prof.mode == "full":
                    # What compiled code returns was allocated out of dispatch's sight.
                    for t in tensors_in_args((output,), None):
                        prof.storages.register_output(t)
            led = self.ledger
            frame = led.frames[-1] if led.frames and led.frames[-1].module == index else None
            if frame is not None:
                for f in led.pop_frame(frame):
                    self.close_frame(f)
            if self.stack and self.stack[-1] == index:
                self.stack.pop()
            if self.marks and self.marks[-1][0] == index:
                _index, calls, unseen = self.marks.pop()
                if calls == self.calls and index in self.parents and phases.current is Phase.FORWARD:
                    self.children_skipped(index, unseen)
            if not self.stack:
                self.unseen_saves.clear()
            if is_root and prof.params.pending:
                prof.params.sync()  # lazy modules took their shapes in this forward
            if not is_root and prof.kv.active is not None:
                prof.kv.layer_done(args, kwargs)
            if is_root and not self.stack:
                prof.kv.after_call(args, kwargs, output)
                if phases.current in (Phase.PREFILL, Phase.DECODE):
                    if phases.merging():
                        phases.mark_end()  # the merged phase ends where its last call does
                    else:
                        # The call is over: its end is the cache as the call left it; what the decoding loop
                        # does until the next call (sampling, the growing ids) is "other".
                        phases.begin(Phase.OTHER)
            inputs = self.pending.pop(index, None) if self.capture else None
            if inputs is not None:
                self.record_call(index, module, inputs, output, args, kwargs)
            if phases.current is Phase.FORWARD and prof.mode == "full" and under_checkpoint():
                self.kept_by_checkpoint(args, kwargs)
            if phases.current is Phase.BACKWARD:
                return None  # a checkpointed module recomputing: no backward hooks for the recompute
            if prof.timeline:
                phases.sample(self.info[index].path or "<model>", "exit")
            if prof.backward_frames and torch.is_grad_enabled() and phases.current is Phase.FORWARD:
                hook = None
                for t in tensors_in_args((output,), None):
                    if t.requires_grad:
                        hook = hook or self._bw_enter(index)
                        if t.grad_fn is not None:
                            # A pre-hook on the node fires when the engine runs it, once every gradient
                            # flowing into it is complete: when a tensor hook on t would, at a ninth of
                            # the cost (2 us against 19). They differ when torch.autograd.grad stops at t
                            # (the node never runs); then the module has no backward in that pass.
                            # Removed when the step ends (its backward has run) or with the profile.
                            self.node_hooks.append(t.grad_fn.register_prehook(hook))
                        else:
                            self.hook_tensor(t, index, hook)
            return None

        return post_hook

    def record_call(self, index: int, module: nn.Module, inputs: tuple[TensorSpec, ...], output: Any,
                    args: Any, kwargs: Any) -> None:
        """The call's shapes and the module's configuration: what the per-module formula will need."""
        outs = [TensorSpec.of(t) for t in tensors_in_args((output,), None)]
        own = list(module.named_parameters(recurse=False))
        checkpointed = under_checkpoint()
        grad = any(t.requires_grad for t in tensors_in_args(args, kwargs)) or any(p.requires_grad for _n, p in own)
        self.module_calls.append((index, ModuleCall(
            path=self.info[index].path or "<model>",
            classes=class_names(type(module)),
            config=plain_config(vars(module)),
            params=tuple((name, bool(p.requires_grad)) for name, p in own),
            inputs=inputs,
            output=outs[0] if outs else None,
            grad=grad and torch.is_grad_enabled(),
            leaf=not any(True for _ in module.children()),
            checkpointed=checkpointed,
        )))

    def kept_by_checkpoint(self, args: Any, kwargs: Any) -> None:
        """A module ran inside a checkpointed region: its inputs, if they outlive the forward, are what
        the region keeps instead of its saves (inside the region inputs are intermediates, freed after
        the forward, so only the region's own inputs stay counted)."""
        for t in tensors_in_args(args, kwargs):
            entry = self.prof.storages.entry_of(t)
            if entry is not None:
                self.ledger.set_tag(entry, _KEPT_BY_CHECKPOINT)

    def phase_began(self, phase: Phase) -> None:
        """Capturing the formula's shapes ends with the forward that began it."""
        if self.capture:
            self.capture = False
            self.captured = True
        if phase is Phase.FORWARD and not self.captured and torch.is_grad_enabled():
            self.capture = True
            self.pending = {}

    def saved_in(self, index: int, nbytes: int, step: int) -> None:
        """``nbytes`` were saved while module ``index`` ran its forward in ``step``."""
        info = self.info[index]
        if info.act_step != step:
            info.act_step = step
            info.act_bytes = 0
        info.act_bytes += nbytes

    def children_skipped(self, index: int, unseen: int) -> None:
        """A call of a module with hooked children ran none of their hooks: compiled code ran it (a
        torch.compile wrapper of the model calls it from compiled code, which skips hooks added after
        compilation), or its forward called them through .forward(). What it saved out of dispatch's
        sight is an activation, not an input; its later calls are treated the same way."""
        self.prof.saved.adopt_unseen(self.unseen_saves[unseen:])
        if index not in self.brackets:
            self.brackets.add(index)
            self.skipped_paths.append(self.info[index].path or "<model>")

    # -- tensor and node hooks ---------------------------------------------------------------

    def hook_tensor(self, t: torch.Tensor, index: int, hook: Any) -> None:
        """A tensor hook for module ``index``, once per tensor (a parameter handed to a submodule
        every forward keeps one hook, not one per call); every one is removed with the profile."""
        key = (id(t), index)
        known = self.tensor_hooks.get(key)
        if known is not None and known[0]() is t:
            return
        self.tensor_hooks[key] = (weakref.ref(t), t.register_hook(hook))

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

    # -- backward frames ---------------------------------------------------------------------

    def close_frame(self, frame: Frame) -> None:
        if self.prof.mode != "full":
            return  # op-level memory is not seen in light mode
        info = self.info[frame.module]
        total = self.ledger.total
        rise = frame.max - frame.entry  # what the call added at its worst
        scratch = max(0, frame.max - max(total, frame.entry))  # what it needed but released by its end
        if frame.backward:
            info.bwd_peak = rise if info.bwd_peak is None else max(info.bwd_peak, rise)
            info.bwd_tmp = scratch if info.bwd_tmp is None else max(info.bwd_tmp, scratch)
        else:
            info.fwd_peak = rise if info.fwd_peak is None else max(info.fwd_peak, rise)
            info.fwd_tmp = scratch if info.fwd_tmp is None else max(info.fwd_tmp, scratch)

    def close_backward_frames(self) -> None:
        led = self.ledger
        for f in list(led.frames):
            if f.backward:
                for g in led.pop_frame(f):
                    self.close_frame(g)
                break
        self.bw_frames.clear()

    def _bw_enter(self, index: int):
        prof = self.prof

        def enter(_grad: Any) -> None:
            if not prof.active or _is_compiling():
                return
            if prof.phases.current is not Phase.BACKWARD:
                prof.phases.backward_started()
            if index in self.bw_frames:
                return
            led = self.ledger
            top = led.top
            if top is not None and top.backward and self.is_ancestor(index, top.module):
                # A parent's output gradient can arrive after its last child's (same tensor,
                # hooks in registration order): keep the child innermost.
                self.bw_frames[index] = led.push_frame_below(index, True, top)
            else:
                self.bw_frames[index] = led.push_frame(index, backward=True)
            if prof.timeline:
                prof.phases.sample(self.info[index].path or "<model>", "enter")

        return enter

    def _bw_exit(self, index: int):
        prof = self.prof

        def exit_(_grads: Any) -> None:
            if not prof.active or _is_compiling():
                return
            frame = self.bw_frames.pop(index, None)
            # Only this module's frame ends: a successor's gradient is often this
            # module's output gradient, which also starts the successor's frame.
            if frame is not None and self.ledger.remove_frame(frame):
                self.close_frame(frame)
                if prof.timeline:
                    prof.phases.sample(self.info[index].path or "<model>", "exit")

        return exit_

    def is_ancestor(self, parent: int, child: int) -> bool:
        p = self.info[parent].path
        c = self.info[child].path
        return p == "" or c.startswith(p + ".")


# ---------------------------------------------------------------------- helpers


def class_names(cls: type, base: type = nn.Module) -> tuple[str, ...]:
    """``module.QualName`` of a class and its bases, most specific first, up to ``base`` (excluded); then
    the transformers layers it is a copy of (:func:`memprof.anatomy.hf_rules.computes_like`), so that
    the formula finds their rule."""
    names = tuple(f"{k.__module__}.{k.__qualname__}" for k in cls.__mro__
                  if isinstance(k, type) and issubclass(k, base) and k is not base)
    if cls.__module__.startswith("transformers."):
        from ..anatomy.hf_rules import computes_like

        names += tuple(n for n in computes_like(cls) if n not in names)
    return names


def is_compile_wrapper(mod: nn.Module) -> bool:
    """The module torch.compile(model) returns (torch._dynamo.eval_frame.OptimizedModule)."""
    return type(mod).__name__ == "OptimizedModule" and isinstance(getattr(mod, "_orig_mod", None), nn.Module)


def unique_params(model: nn.Module) -> Any:
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def attribute_tensors(mod: nn.Module) -> list[torch.Tensor]:
    """Tensors a module keeps as plain attributes, not registered as parameters or buffers."""
    return [v for v in vars(mod).values() if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)]


def tensors_in_args(args: Any, kwargs: Any) -> list[torch.Tensor]:
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
