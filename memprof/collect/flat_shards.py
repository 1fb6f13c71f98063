"""FSDP1's flat parameters: its gathered full parameters, its sharded gradients, and what it shards.

FSDP1 (``FullyShardedDataParallel``, torch/distributed/fsdp/_flat_param.py) flattens each wrapped module's
parameters into one ``FlatParameter`` per unit (a ``FlatParamHandle``). Its storages are made once, at
construction, before any profile:

- ``_local_shard``: the rank's padded shard, the parameter's data between uses (a weight, as the parameter);
- ``_full_param_padded``: the all-gather's output, the whole flat parameter padded to a multiple of the shard
  group's size, resized to its full size before each unshard and back to 0 bytes after (``_alloc_storage`` /
  ``_free_storage`` in torch/distributed/utils.py, ``UntypedStorage.resize_``, which no dispatch mode sees: the
  ledger follows it, memprof.collect.shards.ResizeWatch). It holds the full parameters while they are unsharded:
  **weights**, as FSDP2's gathered parameters are;
- ``_full_prec_full_param_padded``: the same in the parameters' own dtype under mixed precision, when FSDP1
  gathers them at full precision (``summon_full_params``): **weights**;
- ``_mp_shard``: the shard cast to ``MixedPrecision.param_dtype`` before the all-gather, freed after it: the
  all-gather's input, **communication**, as FSDP2's copy-in buffer is.

The gradient autograd accumulates into the unsharded flat parameter is the parameter's ``.grad`` (a gradient);
FSDP1's post-backward hook reduce-scatters it into a new shard kept as ``_saved_grad_shard`` until its final
backward callback makes it ``.grad``: a **gradient** from the collective that made it on (it is registered after
each collective). That callback runs after memprof's own: the backward phase waits for it.

FSDP1's internals are private; where they are not as this module expects, memprof says so in a note and counts
what it sees (the gathered parameters then as whatever the collective's rule makes them).
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import is_interrupt
from ..units import round_half_away
from .hook_objects import hook_object
from .ledger import COMMUNICATION, WEIGHTS
from .moves import move

if TYPE_CHECKING:
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    from ..record.parts import RankInfo
    from .params import ParamTracker
    from .state import Run
    from .undo import UndoStack

__all__ = ["FlatShardTracker", "flat_handles", "flat_sharding"]

# The flat parameter's storages, and what each holds while it has bytes.
_STORAGES = (("_full_param_padded", WEIGHTS), ("_full_prec_full_param_padded", WEIGHTS), ("_mp_shard", COMMUNICATION))


def flat_sharding(model: nn.Module, run: "Run", params: "ParamTracker", rank: "RankInfo",
                  stack: "UndoStack") -> "FlatShardTracker | None":
    """FSDP1's flat parameters of ``model`` followed for this profile, or None (with a note) when its internals
    cannot be read. Its hooks are removed by the profile's undo stack."""
    run.backward_waits = True  # FSDP1 makes its sharded gradients .grad in a backward callback of its own
    handles = flat_handles(model)
    if handles is None:
        run.notes.append(
            "FSDP1's internals are not the ones this memprof knows (torch " + torch.__version__ + "): its gathered "
            "full parameters are counted as the collectives' buffers, not weights, and the trace has no sharded bytes")
        return None
    tracker = FlatShardTracker(run, params, handles, rank)
    for module, handle in handles:
        # FSDP1 makes a unit's storages at the root's first forward (_lazy_init), and gathers the unit inside its
        # own forward, before it calls the module it wraps: a pre-hook of that module finds them made and in use.
        inner = getattr(module, "_fsdp_wrapped_module", None)
        if isinstance(inner, nn.Module):
            hook = hook_object(functools.partial(_weigh, tracker, handle))
            stack.callback(inner.register_forward_pre_hook(hook).remove)
    tracker.start()
    stack.callback(tracker.close)  # after the hooks are gone: the record keeps the sizes, not FSDP1's objects
    return tracker


def flat_handles(model: nn.Module) -> "list[tuple[nn.Module, FlatParamHandle]] | None":
    """Every FSDP1 unit of ``model`` and its ``FlatParamHandle`` (a unit without parameters has none, and is
    left out); None when FSDP1's internals cannot be read (a torch whose FSDP1 differs)."""
    out = []
    for m in model.modules():
        if type(m).__name__ != "FullyShardedDataParallel":
            continue
        try:
            # FSDP1's FlatParamHandle, which nn.Module's type lacks (its __getattr__ says a tensor or a module).
            handle: "FlatParamHandle | None" = m._handle  # type: ignore[assignment]
            if handle is not None:
                flat = handle.flat_param
                flat._numels, flat._shard_param_infos, handle.world_size, handle.uses_sharded_strategy  # noqa: B018
                out.append((m, handle))
        except Exception as failure:
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            return None
    return out


class FlatShardTracker:
    """FSDP1's flat parameters of one profiled model. ``rank`` is the rank's record, with the sharded and
    unsharded bytes once the profile has closed (:meth:`close`)."""

    def __init__(self, run: "Run", params: "ParamTracker", handles: "list[tuple[nn.Module, FlatParamHandle]]",
                 rank: "RankInfo") -> None:
        self.run = run
        self.params = params
        self.rank = rank
        self.handles = [h for _, h in handles]  # FSDP1's own objects, dropped when the profile ends
        # FSDP1 marks a unit's gathered flat parameter as used on the compute stream before it frees it
        # (_free_unsharded_flat_param: record_stream), and with limit_all_gathers its rate limiter lets two such
        # frees be in flight before the next all-gather waits for the oldest (_runtime_utils.py, _unshard);
        # without it the CPU may run ahead of every unit.
        self.limit = 2 if all(getattr(m, "limit_all_gathers", True) for m, _ in handles) else max(2, len(handles))
        #: Storage key of each gathered flat parameter -> how many of its frees may await events at once
        #: (:class:`memprof.collect.streams.StreamUse`'s ``held``).
        self.gathered: dict[int, int] = {}
        self.known: set[int] = set()  # id() of the handles whose storages are registered
        # The parameters FSDP1 flattened, counted whole (a flat parameter's numel is this rank's shard).
        self.elements = sum(sum(h.flat_param._numels) for h in self.handles)
        self.trainable = sum(sum(h.flat_param._numels) for h in self.handles if h.flat_param.requires_grad)
        self.flat_ids = {id(h.flat_param) for h in self.handles}
        self.shapes: dict[int, tuple[int, ...]] = {}
        for h in self.handles:
            flat = h.flat_param
            self.shapes[id(flat)] = (sum(flat._numels),)
            # use_orig_params=True: the original parameters, views of the flat one
            for p, shape in zip(getattr(flat, "_params", None) or (), flat._shapes):
                self.shapes[id(p)] = tuple(shape)
        self.flat_ids.update(self.shapes)

    def whole_shapes(self) -> "dict[int, tuple[int, ...]]":
        """By id, the shape of each parameter FSDP1 holds a shard of, whole: a flat parameter's, its parameters'
        elements (``use_orig_params=False``); an original parameter's, its own (``use_orig_params=True``, where it
        is a view of its part of the shard). Read when the profile began: valid after it closed."""
        return self.shapes

    def counts(self, params: "list[nn.Parameter]") -> "tuple[int, int]":
        """The model's parameters and trainable ones, in elements, counted whole: FSDP1's flat parameters by the
        parameters they hold, the others (modules FSDP1 ignores) as they are."""
        rest = [p for p in params if id(p) not in self.flat_ids]
        return (self.elements + sum(p.numel() for p in rest),
                self.trainable + sum(p.numel() for p in rest if p.requires_grad))

    def start(self) -> None:
        """The storages of the units FSDP1 has initialised already (a model that ran before the profile)."""
        for handle in self.handles:
            self.register(handle)

    def register(self, handle: "FlatParamHandle") -> None:
        """A unit's gathered storages, registered under what they hold (0 bytes while resharded: the ledger
        follows their resizes from then on; made in this phase, they held it at its peaks too)."""
        if id(handle) in self.known or not self.run.active:
            return
        flat = handle.flat_param
        if not hasattr(flat, "_local_shard"):  # not initialised yet (FSDP1's _lazy_init)
            return
        self.known.add(id(handle))
        for name, cat in _STORAGES:
            t = getattr(flat, name, None)
            if not isinstance(t, torch.Tensor):
                continue
            if cat == WEIGHTS:
                self.params.weigh(t)
                self.gathered[t.untyped_storage()._cdata] = self.limit
            else:
                entry = self.params.storages.add_tensor(t, cat)
                if entry is not None and entry.cat != cat:
                    move(self.params.ledger, entry, cat, retro=True)

    def new_grads(self) -> None:
        """After each collective: the sharded gradients FSDP1 has kept so far (``_saved_grad_shard``, its
        reduce-scatter's output) are gradients."""
        for handle in self.handles:
            g = getattr(handle.flat_param, "_saved_grad_shard", None)
            if isinstance(g, torch.Tensor):
                self.params.add_grad(g, retro=True, follow=False)

    def close(self) -> None:
        sharded, unsharded, padding, even = self.sizes()
        self.rank = dataclasses.replace(self.rank, sharded_bytes=sharded, unsharded_bytes=unsharded,
                                        padding_bytes=padding, even_bytes=even)
        self.handles = []
        self.known = set()

    def sizes(self) -> "tuple[int, int, int, int]":
        """(sharded bytes with padding, unsharded bytes, padding bytes, bytes of an even split) over every flat
        parameter: its local shard, padded to a multiple of its shard group's size, and what it gathers."""
        sharded = unsharded = padding = 0
        even = Fraction(0)
        for handle in self.handles:
            flat = handle.flat_param
            local = getattr(flat, "_local_shard", flat)
            size = local.element_size()
            # The parameters' own elements: the flat parameter also holds padding, between parameters for alignment
            # (use_orig_params=True) and at its end up to a multiple of the shard group's size.
            whole = sum(flat._numels)
            sharded += local.numel() * size
            if not handle.uses_sharded_strategy:  # NO_SHARD: every rank holds it whole, gathers nothing
                padding += (local.numel() - whole) * size
                unsharded += local.numel() * size
                even += whole * size
                continue
            # (numel_in_shard is None only outside the shard: torch types it for both.)
            real = sum(info.numel_in_shard or 0 for info in flat._shard_param_infos if info.in_shard)
            padding += (local.numel() - real) * size
            even += Fraction(whole * size, handle.world_size)
            gathered = getattr(flat, "_full_param_padded", None)
            if isinstance(gathered, torch.Tensor):  # in MixedPrecision.param_dtype, when there is one
                unsharded += gathered.numel() * gathered.element_size()
        return sharded, unsharded, padding, round_half_away(even)



def _weigh(tracker: FlatShardTracker, handle: "FlatParamHandle", _module: nn.Module, _args: object) -> None:
    """A forward pre-hook of the module an FSDP1 unit wraps: the unit's storages, registered once they exist."""
    tracker.register(handle)
