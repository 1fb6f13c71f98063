"""Sharded parameters: FSDP2's unsharded copies, its gradients, and storages resized outside dispatch.

FSDP2 (``fully_shard``, torch/distributed/fsdp/_fully_shard/_fsdp_param.py) keeps each parameter as a
DTensor over a padded local shard. Before a module's forward (and again in backward) it all-gathers the
full parameters into storages it made once and resizes them back to 0 bytes afterwards, with
``UntypedStorage.resize_``, which no dispatch mode sees. So memprof:

- follows storage resizes while it profiles, by wrapping ``torch.UntypedStorage.resize_`` (torch's own
  ``torch/distributed/_tools/mem_tracker.py`` does the same, for the same reason) and restoring it after;
- counts the gathered full parameters as **weights** while they are unsharded (0 bytes while sharded);
- counts the gradients autograd accumulates into them (before the reduce-scatter) and the sharded
  gradients FSDP stores on the DTensors as **gradients**, whatever collective buffer they live in;
- records the sharded bytes (local shards with their padding) and the unsharded bytes for the trace.

The all-gather and reduce-scatter staging buffers are communication by the collectives' rule
(memprof.collect.dispatch). FSDP's internals are private: where they are not as expected, memprof says
so in a note and counts what it can see (the unsharded copies are then temporaries).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from fractions import Fraction
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ..errors import is_interrupt
from ..units import round_half_away
from .ranks import is_fsdp2_module, shards_of

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    from ..record.parts import RankInfo
    from .ledger import Ledger
    from .params import ParamTracker
    from .state import Run
    from .undo import UndoStack

__all__ = ["ShardTracker", "ResizeWatch", "fsdp2_params", "sharding"]


def sharding(model: nn.Module, rank: "RankInfo | None", ledger: "Ledger", run: "Run", params: "ParamTracker",
             stack: "UndoStack") -> "ShardTracker | None":
    """Follow resized storages for this profile, and FSDP2's parameters when the model is sharded with it
    (the rank's record then carries the sharded and unsharded bytes). Undone by the profile's undo stack."""
    watch = ResizeWatch(ledger)
    watch.install()
    stack.callback(watch.uninstall)
    if rank is not None and rank.layout == "ddp":
        # DDP's Reducer copies its buckets into .grad in a backward callback it queues when the last bucket is
        # ready (torch/csrc/distributed/c10d/reducer.cpp, finalize_backward), after memprof's: those copies are
        # backward's, not a second backward phase.
        run.backward_waits = True
    if rank is None or rank.layout != "fsdp2":
        return None
    groups = fsdp2_params(model)
    if groups is None:
        run.notes.append(
            "FSDP2's internals are not the ones this memprof knows (torch " + torch.__version__ + "): its gathered "
            "full parameters are counted as temporaries, not weights, and the trace has no sharded bytes")
        return None
    tracker = ShardTracker(run, params, stack, groups, rank)
    run.backward_waits = True  # FSDP2's last reduce-scatter runs in a backward callback of its own
    stack.callback(tracker.close)  # runs after the hooks are gone: the record keeps the sizes, not FSDP's objects
    return tracker


def fsdp2_params(model: nn.Module) -> "dict[int, list[FSDPParam]] | None":
    """id(module) -> the FSDPParams of each ``fully_shard``-ed module of ``model``; None when FSDP2's
    internals cannot be read (a torch whose FSDP2 differs)."""
    groups: "dict[int, list[FSDPParam]]" = {}
    for m in model.modules():
        if not is_fsdp2_module(m):
            continue
        try:
            # An FSDP2 module's (is_fsdp2_module), which nn.Module's type lacks.
            group = m._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
            params = list(group.fsdp_params) if group is not None else []
            for fp in params:
                fp.sharded_param, fp.padded_sharded_param_size  # noqa: B018 - the attributes used below
        except Exception as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            return None
        groups[id(m)] = params
    return groups


class ShardTracker:
    """FSDP2's parameters of one profiled model. ``rank`` is the rank's record, with the sharded and
    unsharded bytes once the profile has closed."""

    def __init__(self, run: "Run", params: "ParamTracker", stack: "UndoStack", groups: "dict[int, list[FSDPParam]]",
                 rank: "RankInfo") -> None:
        self.run = run
        self.params = params
        self.stack = stack
        self.rank = rank
        # Strong references to FSDP's own bookkeeping objects, dropped when the profile ends.
        self.groups = groups
        self.fsdp_params = [fp for ps in groups.values() for fp in ps]
        self.hooked: set[int] = set()  # id() of unsharded parameters carrying memprof's gradient hook
        # Per FSDP parameter, weak references to the gradient tensors the last collective found stored: the
        # pass after each collective then registers only what changed since (a sharded gradient is a DTensor,
        # whose registration unwraps it: done for every parameter after every collective, it cost a 405B
        # pipeline simulation most of its time).
        self.stored: "dict[int, tuple[_Ref, _Ref]]" = {}

    def close(self) -> None:
        sharded, unsharded, padding, even = self.sizes()
        self.rank = dataclasses.replace(self.rank, sharded_bytes=sharded, unsharded_bytes=unsharded,
                                        padding_bytes=padding, even_bytes=even)
        self.groups = {}
        self.fsdp_params = []

    # -- what the trace records -------------------------------------------------------------

    def sizes(self) -> "tuple[int, int, int, int]":
        """(sharded bytes with padding, unsharded bytes, padding bytes, bytes of an even split) over every
        FSDP2 parameter."""
        sharded = unsharded = padding = 0
        even = Fraction(0)
        world = self.rank.world_size
        for fp in self.fsdp_params:
            local = fp.sharded_param.to_local() if hasattr(fp.sharded_param, "to_local") else fp.sharded_param
            size = local.element_size()
            padded = math.prod(fp.padded_sharded_param_size) * size
            sharded += padded
            padding += padded - local.numel() * size
            even += Fraction(fp.sharded_param.numel() * size, shards_of(fp.sharded_param))
            # Gathered into storages of world size x the padded shard, in the dtype of the all-gather.
            gathered = list(getattr(fp, "all_gather_outputs", ()) or ())
            if gathered:
                unsharded += sum(t.numel() * t.element_size() for t in gathered)
            else:  # never gathered in the block: what it would gather
                dtype = getattr(fp, "param_dtype", None) or local.dtype
                unsharded += padded // size * world * torch.empty((), dtype=dtype).element_size()
        return sharded, unsharded, padding, round_half_away(even)

    # -- following FSDP -------------------------------------------------------------------------

    def unsharded(self, module: nn.Module) -> None:
        """After FSDP's pre-forward of ``module`` (its parameters are gathered): they are weights."""
        if not self.run.active:
            return
        for fp in self.groups.get(id(module), ()):
            self._weigh(fp)

    def resharded(self, module: nn.Module) -> None:
        """After FSDP's post-forward of ``module``: with ``reshard_after_forward`` an int, what it keeps until
        backward (a larger shard of each parameter) is weights too."""
        if not self.run.active:
            return
        for fp in self.groups.get(id(module), ()):
            kept = getattr(fp, "_sharded_post_forward_param_data", None)
            if isinstance(kept, torch.Tensor):
                self.params.weigh(kept)

    def _weigh(self, fp: "FSDPParam") -> None:
        tensors = (list(getattr(fp, "all_gather_outputs", ()) or ())
                   + list(getattr(fp, "_unsharded_inner_tensors", ()) or ()))
        param = getattr(fp, "_unsharded_param", None)
        if not tensors and param is not None:
            tensors = [param]
        for t in tensors:
            self.params.weigh(t)
        if param is not None and param.requires_grad and id(param) not in self.hooked:
            self.hooked.add(id(param))
            self.stack.callback(param.register_post_accumulate_grad_hook(self._grad_hook).remove)

    def _grad_hook(self, param: torch.Tensor) -> None:
        # A gradient accumulated into an unsharded parameter, before FSDP reduce-scatters it.
        if self.run.active and param.grad is not None:
            self.params.add_grad(param.grad, retro=True, follow=False)

    def grads(self) -> None:
        """The sharded gradients FSDP has stored so far, every one (at backward's end)."""
        self.stored.clear()
        self.new_grads()

    def new_grads(self) -> None:
        """The sharded gradients FSDP stored since the last collective (after each collective: a
        reduce-scatter stores a group's); a gradient tensor already registered after an earlier one is
        skipped."""
        params, stored = self.params, self.stored
        for i, fp in enumerate(self.fsdp_params):
            g = fp.sharded_param.grad
            acc = getattr(fp, "unsharded_accumulated_grad", None)  # no gradient sync: kept unsharded
            if g is None and acc is None:
                continue
            seen = stored.get(i)
            if seen is not None and seen[0]() is g and seen[1]() is acc:
                continue
            if g is not None:
                params.add_grad(g, retro=True)
            if acc is not None:
                params.add_grad(acc, retro=True, follow=False)
            stored[i] = (_ref(g), _ref(acc))


#: A weak reference to a gradient, or a stand-in that gives None.
_Ref = Callable[[], "torch.Tensor | None"]


def _ref(t: "torch.Tensor | None") -> _Ref:
    """A weak reference to ``t`` (never keeping a gradient alive), or a callable giving None."""
    return weakref.ref(t) if t is not None else _none


def _none() -> None:
    return None


#: ``UntypedStorage.resize_``, torch's or memprof's wrapper of it.
_Resize = Callable[[torch.UntypedStorage, int], object]


class ResizeWatch:
    """Follows ``UntypedStorage.resize_`` on storages the ledger knows, while a profile runs.

    One wrapper serves every profile running at once (in several threads): installed by the first, put back
    by the last, so profiles that end in any order leave torch's method as it was."""

    _active: "list[ResizeWatch]" = []
    _original: "_Resize | None" = None
    _wrapper: "_Resize | None" = None
    _had_own = False

    def __init__(self, ledger: "Ledger") -> None:
        self.ledger: "Ledger | None" = ledger

    def install(self) -> None:
        cls = ResizeWatch
        if cls._wrapper is None or torch.UntypedStorage.__dict__.get("resize_") is not cls._wrapper:
            original = torch.UntypedStorage.resize_
            active = cls._active

            def resize_(storage: torch.UntypedStorage, size: int) -> object:
                out = original(storage, size)
                for watch in active:
                    led = watch.ledger
                    if led is not None and not led.closed:
                        if led.released:
                            led.settle()
                        entry = led.entries.get(storage._cdata)
                        if entry is not None:
                            led.resize(entry, storage.nbytes())
                return out

            resize_.__doc__ = getattr(original, "__doc__", None)
            # Whether the class itself defined it (someone wrapped it before) or inherited torch's C method.
            cls._had_own = "resize_" in torch.UntypedStorage.__dict__
            cls._original, cls._wrapper = original, resize_
            # A wrapper in place of torch's C method, typed as a method of the storage class.
            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        cls._active.append(self)

    def uninstall(self) -> None:
        cls = ResizeWatch
        self.ledger = None
        if self in cls._active:
            cls._active.remove(self)
        if cls._active or cls._wrapper is None:
            return
        if torch.UntypedStorage.__dict__.get("resize_") is cls._wrapper:
            if cls._had_own:
                torch.UntypedStorage.resize_ = cls._original  # type: ignore[method-assign, assignment]  # putting back what was there
            else:
                del torch.UntypedStorage.resize_  # the class is as torch made it again
            cls._wrapper = None
        # Else someone wrapped it on top of memprof's: theirs calls ours, which does nothing with no profile.
