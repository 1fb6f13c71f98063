"""One rank of a data-parallel job, in a one-process simulation: ``estimate(world_size=N, parallel=...)``.

The simulation runs one rank's batch on shape-only tensors (memprof.simulate.estimate): its activations and
temporaries are that rank's. The layout changes the model states and adds collective buffers; memprof
plays the layout's memory moves on the simulated run as they happen, in the ledger (the shape-only
tensors hold no data, so the ledger's sizes are the rank's), for rank 0 (the rank that holds the most rows
when a dimension does not divide):

- ``ddp``: everything whole; DDP's buckets hold a copy of every gradient from construction on (Li et al.
  2020, "PyTorch Distributed", §3.2.3).
- ``zero1`` / ``zero2`` / ``zero3``: ZeRO's flat partitions (Rajbhandari et al. 2020, §5, Table I): the
  optimizer states; also the gradients (reduced as backward makes them); also the parameters, gathered
  per block. Each rank holds ``ceil(bytes / N)`` of each flat buffer.
- ``fsdp``: FSDP2's ``fully_shard`` per parameter (torch/distributed/fsdp/_fully_shard/_fsdp_param.py):
  dim 0 padded to a multiple of ``N``, ``ceil(rows / N)`` rows on every rank, optimizer state made like the
  real rows of the local shard.

For ``fsdp`` and ``zero3`` the units are the usual wrapping: each block of a repeated stack (children of
one class in a container), and the root for the rest. A unit's parameters are gathered before its forward
(an all-gather buffer of the unit, kept until the next unit's is copied out, as FSDP2 does) and freed after
it, except the root's, kept until the end of backward; backward gathers a unit again when the gradient of
its output arrives, and once all its gradients exist reduce-scatters them (a buffer of the unit's full
gradients, kept until the next reduce-scatter) into the rank's shard. The optimizer step's temporaries
work on the shards: they are scaled by the rank's share of the state.
"""

from __future__ import annotations

import dataclasses
import numbers
from fractions import Fraction
from typing import TYPE_CHECKING, Callable, Mapping

import torch
from torch import nn

from ..vocabulary import Category
from ..errors import InvalidArgumentError, UnknownNameError, is_interrupt
from ..record.layout import MeshLayout, ParamGroup
from ..record.parts import MAX_WORLD, RankInfo
from ..anatomy.zero import STAGES
from ..collect.module_table import tensors_in_args
from ..collect.torch_compat import graph_task_id as _graph_task_id, queue_backward_callback
from ..units import round_half_away

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle
    from ..collect.simulated import SimulatedProfile
    from ..record.trace import Trace

__all__ = ["PARALLEL", "ON_FAKE_RANKS", "check_parallel", "LayoutPlan", "RankLayout", "unit_blocks", "uneven_shard"]

#: The layouts ``estimate(parallel=...)`` simulates by playing their moves on the run (and a plan compares by
#: default).
PARALLEL = ("ddp", "fsdp", "zero1", "zero2", "zero3")
#: The layouts ``parallel=`` also takes that run torch's own code on the fake process group, as a parallelize
#: function of memprof's (``fsdp1``: memprof.simulate.fsdp1.fsdp1_parallelize).
ON_FAKE_RANKS = ("fsdp1",)


def check_parallel(world_size: object, parallel: object, parallelize: bool = False) -> "tuple[int, str | None]":
    """The world size and layout of an estimate, checked: a positive int, and one of :data:`PARALLEL`
    (needed as soon as there is more than one rank, unless the user's own ``parallelize`` function says how the
    ranks share the model, which excludes a layout)."""
    if (isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral)
            or not 1 <= int(world_size) <= MAX_WORLD):
        raise InvalidArgumentError(f"world_size must be a positive int (the number of ranks, at most {MAX_WORLD:,}), "
                                   f"got {world_size!r}")
    world_size = int(world_size)
    if parallelize:
        if parallel is not None:
            raise InvalidArgumentError(f"parallel={parallel!r} and parallelize= both say how the ranks share the "
                                       "model: give one (parallelize runs your own function)")
        return world_size, None
    if parallel is None:
        if world_size > 1:
            raise InvalidArgumentError(
                f"world_size={world_size} needs parallel=: how the ranks share the model, one of "
                + ", ".join(PARALLEL + ON_FAKE_RANKS)
                + " (or parallelize=fn, your own function of the model and a device mesh)")
        return world_size, None
    name = parallel.strip().lower() if isinstance(parallel, str) else parallel
    if name not in PARALLEL + ON_FAKE_RANKS:
        raise UnknownNameError(f"unknown parallel layout {parallel!r}; use one of "
                               + ", ".join(PARALLEL + ON_FAKE_RANKS))
    return world_size, name


@dataclasses.dataclass(eq=False)
class _Param:
    ref: nn.Parameter
    rows: int  # dim 0 (1 for a scalar)
    unit: int  # the unit it belongs to (0: the root)
    shard: int = 0  # rank 0's stored bytes of it (with padding)
    real: int = 0  # of which real rows
    full: int = 0  # gathered bytes (padded to the world size)
    rows0: int = 0  # rank 0's rows (FSDP)
    grad_shard: int = 0  # rank 0's bytes of its gradient

    @property
    def whole(self) -> int:
        """Its bytes, unsharded and unpadded."""
        return self.ref.numel() * self.ref.element_size()


class LayoutPlan:
    """What rank 0 of ``world_size`` holds under a layout: the units, and each parameter's shard, gathered and
    gradient bytes; after the run, the rank's record of it."""

    def __init__(self, model: nn.Module, world_size: int, parallel: str) -> None:
        self.n, self.parallel, self.stage = world_size, parallel, STAGES[parallel]
        self.unit_modules, units = _units(model)
        self.units: dict[int, list[_Param]] = {}
        self.by_id: dict[int, _Param] = {}
        for p in model.parameters():
            if id(p) in self.by_id:
                continue
            info = _Param(p, p.shape[0] if p.dim() else 1, units.get(id(p), 0))
            self.by_id[id(p)] = info
            self.units.setdefault(info.unit, []).append(info)
        self._sizes()

    def _sizes(self) -> None:
        n = self.n
        if self.parallel == "fsdp":
            for info in self.by_id.values():
                p, rows = info.ref, info.rows
                per_row = p.numel() // rows * p.element_size() if rows else 0
                info.rows0 = -(-rows // n)  # ceil(rows / N): every rank stores that many
                info.shard = info.grad_shard = info.rows0 * per_row
                info.real, info.full = min(info.rows0, rows) * per_row, info.rows0 * n * per_row
            return
        # ZeRO: one flat buffer per dtype, ceil(elements / N) of it on each rank; its first parameter's entry
        # carries it, the others none.
        params = list(self.by_id.values())
        for info in params:
            info.full = info.whole
        for field, members in (("shard", params), ("grad_shard", [i for i in params if i.ref.requires_grad])):
            for flat in _flat_shares(members, n).items():
                setattr(flat[0], field, flat[1])
        for info in params:
            info.real = info.shard

    # -- after the run --------------------------------------------------------------------------

    def finish(self, trace: Trace) -> Trace:
        """The rank's record of the replica's ``trace`` (:func:`memprof.simulate.rank_records.rank_records`), its
        rank information, and its weights at rest."""
        from .rank_records import rank_records

        share = self._state_share(trace.optimizer_implementation == "for-loop")
        out = rank_records(trace, share if self.stage >= 1 else None, buckets=self.parallel in ("zero1", "zero2"))
        # Between steps the rank keeps its shards: what its reconciliation takes for the parameters at rest.
        facts = trace.facts
        if self.stage >= 3:
            facts = dataclasses.replace(facts, weight_bytes=sum(i.shard for i in self.by_id.values()),
                                        trainable_bytes=sum(i.shard for i in self.by_id.values()
                                                            if i.ref.requires_grad))
        return dataclasses.replace(out, distributed=self.rank_info(), facts=facts)

    def _state_share(self, one_at_a_time: bool) -> "Fraction | None":
        """The rank's part of the optimizer step's temporaries. A for-each step's are all the parameters' at once:
        the rank's share of all of them; a for-loop step's are the largest parameter's: its shard's part."""
        if self.parallel != "fsdp":
            return Fraction(1, self.n)
        params = [i for i in self.by_id.values() if i.ref.requires_grad] or list(self.by_id.values())
        if one_at_a_time:  # the largest shard's temporaries, where the simulation had the largest parameter's
            whole = max(i.whole for i in params)
            return Fraction(max(i.real for i in params), whole) if whole else None
        whole = sum(i.whole for i in params)
        return Fraction(sum(i.real for i in params), whole) if whole else None

    def rank_info(self) -> RankInfo:
        info = RankInfo(rank=0, world_size=self.n, backend=None, layout=self.parallel,
                        bucket_view=False if self.parallel == "ddp" else None)
        if self.stage < 3:
            return info
        sharded = sum(i.shard for i in self.by_id.values())
        real = sum(i.real for i in self.by_id.values())
        even = sum(Fraction(i.whole, self.n) for i in self.by_id.values())
        return dataclasses.replace(info, sharded_bytes=sharded, padding_bytes=sharded - real,
                                   unsharded_bytes=sum(i.full for i in self.by_id.values()),
                                   even_bytes=round_half_away(even), layout_detail=self._layout())

    def _layout(self) -> MeshLayout:
        """The layout the per-rank formula reads: every parameter cut over one data-parallel dimension, the units
        gathered one at a time in the parameters' own dtype."""
        infos = list(self.by_id.values())
        group = ParamGroup(("dp_shard",), (), sum(i.ref.numel() for i in infos),
                           sum(i.ref.numel() for i in infos if i.ref.requires_grad), sum(i.whole for i in infos))
        largest = max((sum(i.full for i in unit) for unit in self.units.values()), default=0)
        return MeshLayout((("dp_shard", self.n),), (group,), units=len(self.units) or None,
                          largest_unit_bytes=largest or None)

    def notes(self) -> list[str]:
        out = [f"one rank of {self.n} under {self.parallel}: the simulated batch is this rank's; model states and "
               "collective buffers are rank 0's as the layout shards them (rank 0 holds the most rows)"]
        if self.stage >= 3:
            blocks = [m for m, _ in self.unit_modules]
            kinds = sorted({type(m).__name__ for m in blocks})
            root = sum(i.ref.numel() for i in self.units.get(0, []))
            out.append(f"units gathered one at a time: {len(blocks)} block(s) ({', '.join(kinds) or 'none'}), and the "
                       f"root for the other {root:,} parameters (kept gathered from its forward to the end of "
                       "backward); each all-gather and reduce-scatter buffer is kept until the next, as FSDP2 does")
        if self.parallel in ("zero1", "zero2"):
            out.append("DeepSpeed's reduce and all-gather buckets (reduce_bucket_size, allgather_bucket_size) depend "
                       "on its config: communication is not estimated")
        return out




class RankLayout:
    """Plays one layout's memory moves on a simulated run, for rank 0 of ``world_size``, on the ledger of the
    profile it is attached to (:meth:`attach`)."""

    def __init__(self, model: nn.Module, optimizer: "torch.optim.Optimizer | None", world_size: int,
                 parallel: str) -> None:
        plan = self.plan = LayoutPlan(model, world_size, parallel)
        # The plan's tables, which every move reads.
        self.n, self.parallel, self.stage = plan.n, plan.parallel, plan.stage
        self.unit_modules, self.units, self.by_id = plan.unit_modules, plan.units, plan.by_id
        self.optimizer = optimizer
        self.model = model
        self.profile: "SimulatedProfile | None" = None
        self.handles: list[RemovableHandle] = []
        self.gathered: set[int] = set()
        self.pending: dict[int, set[int]] = {}  # unit -> ids of its trainable parameters without a gradient yet
        # The last all-gather and reduce-scatter buffers, as FSDP2 keeps them, DDP's buckets, and a unit's all-gather
        # gathered ahead ("prefetch": the unit, its buffer).
        self.kept: dict[str, "torch.Tensor | tuple[int, torch.Tensor]"] = {}
        self.flushing = False
        self.reduced: set[int] = set()
        self.order: list[int] = []  # the units in the order the last forward gathered them

    # -- installing ----------------------------------------------------------------------------

    def attach(self, profile: "SimulatedProfile") -> None:
        """After the profiler started (and registered the weights): shard them, install the moves. What it
        installed is removed by :meth:`detach`, or at once if installing fails half-way."""
        self.profile = profile
        try:
            self._install(profile)
        except BaseException:
            self.detach()
            raise

    def _install(self, c: "SimulatedProfile") -> None:
        c.collectives_end_in_backward()  # the last reduce-scatter and resharding belong to backward
        if self.stage >= 3:
            for info in self.by_id.values():
                self._resize(info.ref, info.shard)
        if self.parallel == "ddp":
            grads = sum(i.whole for i in self.by_id.values() if i.ref.requires_grad)
            self.kept["buckets"] = self._buffer(grads)
        c.restart()  # the run starts from here: what the profiler saw of the whole model is not this rank's
        if self.stage >= 3:
            for module, unit in self.unit_modules:
                self.handles.append(module.register_forward_pre_hook(self._pre_forward(unit)))
                self.handles.append(module.register_forward_hook(self._post_forward(unit)))
            self.handles.append(self.model.register_forward_pre_hook(self._pre_forward(0)))
            self.handles.append(self.model.register_forward_hook(self._post_forward(0)))
        if self.stage >= 2:
            for info in self.by_id.values():
                if info.ref.requires_grad:
                    # torch's Tensor.register_post_accumulate_grad_hook is untyped.
                    self.handles.append(info.ref.register_post_accumulate_grad_hook(self._grad_done))  # type: ignore[no-untyped-call]
        if self.optimizer is not None and self.stage >= 1:
            self.handles.append(self.optimizer.register_step_post_hook(_StateShards(self).stepped))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.kept = {}
        self.profile = None

    def finish(self, trace: Trace) -> Trace:
        """The rank's record of ``trace`` (:meth:`LayoutPlan.finish`)."""
        return self.plan.finish(trace)

    def notes(self) -> list[str]:
        return self.plan.notes()

    # -- the moves -----------------------------------------------------------------------------

    def _running(self) -> bool:
        """Attached to a profile that records now (not paused, not ended)."""
        return self.profile is not None and self.profile.recording

    def _resize(self, t: torch.Tensor, nbytes: int) -> None:
        assert self.profile is not None
        self.profile.resize(t, nbytes)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A collective's buffer of ``nbytes`` (a shape-only tensor the ledger counts as communication; the
        dispatch mode saw it made, as a temporary, since)."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        assert self.profile is not None
        self.profile.add_buffer(buf, Category.COMMUNICATION)
        return buf

    def _gather(self, unit: int) -> None:
        backward = _graph_task_id() != -1
        if unit in self.gathered:
            if unit == 0 and backward and len(self.order) > 1:
                # The root, gathered since its forward, prefetches the last unit as its backward begins.
                self._prefetch(self.order[-1])
            return
        self.gathered.add(unit)
        params = self.units.get(unit, [])
        if not backward:
            if unit == 0:
                self.order = []  # a new forward: the units' order, which backward prefetches in reverse
            self.order.append(unit)
        prefetched = self.kept.get("prefetch")
        hit = backward and prefetched is not None and prefetched[0] == unit
        del prefetched  # no reference of this frame may keep a buffer alive past its time
        if hit:
            new = self.kept.pop("prefetch")[1]  # gathered ahead while the unit after it ran backward
        else:
            new = self._buffer(sum(i.full for i in params))
        for info in params:
            self._resize(info.ref, info.shard + info.full)  # the shard and the gathered parameter
        if not backward:
            self.kept["all_gather"] = new  # forward: the previous one is freed once this one is copied out
            return
        self.kept.pop("all_gather", None)  # backward keeps none once copied out
        del new
        # FSDP2 prefetches the unit that ran before this one in forward: its all-gather is in flight while this
        # unit's backward runs, and copied out when its own backward begins.
        i = self.order.index(unit) if unit in self.order else -1
        if i > 0:
            self._prefetch(self.order[i - 1])

    def _prefetch(self, unit: int) -> None:
        if unit not in self.gathered and "prefetch" not in self.kept:
            self.kept["prefetch"] = (unit, self._buffer(sum(i.full for i in self.units.get(unit, []))))

    def _reshard(self, unit: int) -> None:
        if unit not in self.gathered:
            return
        self.gathered.discard(unit)
        for info in self.units.get(unit, []):
            self._resize(info.ref, info.shard)

    def _pre_forward(self, unit: int) -> Callable[[nn.Module, tuple[object, ...]], None]:
        frozen = unit != 0 and not any(i.ref.requires_grad for i in self.units.get(unit, []))

        def hook(_module: nn.Module, args: tuple[object, ...]) -> None:
            if not self._running():
                return
            self._gather(unit)
            if frozen and _graph_task_id() == -1:
                # No gradient of its own tells when its backward is over: FSDP2 learns it from the gradient of
                # its inputs, and reshards then.
                for t in tensors_in_args(args, None):
                    if t.requires_grad:  # (torch's Tensor.register_hook is untyped)
                        t.register_hook(  # type: ignore[no-untyped-call]
                            lambda _g: self._reduce_scatter(unit) if unit not in self.reduced else None)
        return hook

    def _post_forward(self, unit: int) -> Callable[[nn.Module, tuple[object, ...], object], None]:
        def hook(_module: nn.Module, _args: tuple[object, ...], output: object) -> None:
            if not self._running():
                return
            if unit != 0 and _graph_task_id() == -1:  # a recomputation in backward keeps them for backward
                self._reshard(unit)
            if unit == 0:  # the root's forward ends: FSDP2 frees the all-gather buffer it kept
                self.kept.pop("all_gather", None)
            # Backward gathers the unit again when the gradient of its output arrives.
            for t in tensors_in_args(output, None):
                if t.requires_grad:
                    t.register_hook(self._backward_pre(unit))  # type: ignore[no-untyped-call]  # torch's is untyped
        return hook

    def _backward_pre(self, unit: int) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            if not self._running():
                return
            if not self.flushing:
                self.flushing = True
                self.reduced = set()
                try:
                    queue_backward_callback(self._backward_done)
                except RuntimeError as failure:
                    if is_interrupt(failure):
                        raise  # a signal handler's exception (errors.is_interrupt) is the user's
                    self.flushing = False
            if unit not in self.pending:
                self.pending[unit] = {id(i.ref) for i in self.units.get(unit, []) if i.ref.requires_grad}
            self._gather(unit)
        return hook

    def _grad_done(self, param: torch.Tensor) -> None:
        if not self._running():
            return
        info = self.by_id.get(id(param))
        if info is None or param.grad is None:
            return
        if self.stage == 2:
            self._resize(param.grad, info.grad_shard)  # reduced into the rank's flat partition as it is made
            return
        waiting = self.pending.get(info.unit)
        if waiting is not None:
            waiting.discard(id(param))
            if not waiting:
                self._reduce_scatter(info.unit)

    def _reduce_scatter(self, unit: int) -> None:
        self.pending.pop(unit, None)
        self.reduced.add(unit)
        self._reshard(unit)  # FSDP2 reshards a unit's parameters before reducing its gradients
        params = [(i, g) for i in self.units.get(unit, []) if i.ref.requires_grad and (g := i.ref.grad) is not None]
        if params:
            # FSDP2 keeps one reduce-scatter input (reduce_scatter_max_input_buffers = 1): the last is freed first.
            self.kept.pop("reduce_scatter", None)
            self.kept["reduce_scatter"] = self._buffer(sum(i.full for i, _ in params))  # the full gradients copied in
            # The output (the rank's shards) is made, then the full gradients go. foreach_reduce means to free them
            # first, and does on some models; on others (a root-only embedding over 7 ranks) they outlive the
            # output's allocation. Counting both for that moment errs high by the shards, never low.
            assert self.profile is not None
            for info, grad in params:
                self.profile.grow(grad, info.grad_shard)
            for info, grad in params:
                self._resize(grad, info.grad_shard)

    def _backward_done(self) -> None:
        self.flushing = False
        if not self._running():
            return
        # Units whose gradients are not all there (unused parameters) and units backward never announced.
        for unit in [u for u in self.units if u not in self.reduced]:
            self._reduce_scatter(unit)
        for unit in list(self.gathered):
            self._reshard(unit)
        for kind in ("reduce_scatter", "all_gather", "prefetch"):
            self.kept.pop(kind, None)


class _StateShards:
    """The optimizer step's part of a layout: after each step, the state the optimizer made like the whole
    parameters is resized to the rank's shard of it (scalars stay whole)."""

    def __init__(self, layout: "RankLayout") -> None:
        self.layout = layout

    def stepped(self, optimizer: torch.optim.Optimizer, *_args_kwargs: object) -> None:
        # The state was made like the whole parameters: the rank keeps its shard of each (scalars stay whole).
        # The state the first step made was a temporary at the step's peak at its whole size: it leaves the
        # temporaries at that size before it shrinks (the profiler's own post-hook, which would move it later,
        # runs after this one and would move only the shard, leaving whole - shard behind in the peak).
        lay = self.layout
        c = lay.profile
        state = optimizer.state
        if c is not None:
            for per_param in state.values():
                for t in per_param.values():
                    if isinstance(t, torch.Tensor):
                        c.claim(t, Category.OPTIMIZER_STATES)
        first: dict[tuple[str, torch.dtype], bool] = {}
        sizes: list[tuple[torch.Tensor, int]] = []
        for info in lay.by_id.values():
            for key, t in (state.get(info.ref) or {}).items():
                if not isinstance(t, torch.Tensor) or key == "step" or t.shape != info.ref.shape:
                    continue
                nbytes = t.numel() * t.element_size()
                if lay.parallel == "fsdp":  # made like the real rows of the local shard
                    rank = nbytes * min(info.rows0, info.rows) // info.rows if info.rows else 0
                else:  # one flat buffer per state and dtype: its first tensor carries ceil(elements / N)
                    group = (key, t.dtype)
                    rank = (0 if first.get(group)
                            else -(-self._state_numel(state, key, t.dtype) // lay.n) * t.element_size())
                    first[group] = True
                sizes.append((t, rank))
        stream = c.open_stream() if c is not None else None
        mark = len(stream[0]) if stream is not None else None
        # Shrinks before growths (ZeRO's first tensor of a flat group carries the group's share, more than its own
        # size): growing first would make a moment the rank never has, above the step's real peak.
        for t, rank in sorted(sizes, key=lambda tr: tr[1] - tr[0].numel() * tr[0].element_size()):
            lay._resize(t, rank)
        if stream is not None and mark is not None:  # the allocator replays the step as the rank makes it, as finish()
            from ..anatomy.optimizers import param_group_implementations
            from .alloc_stream import rank_step

            events, phase_start, rounding = stream
            share = lay.plan._state_share(set(param_group_implementations(optimizer)) == {"for-loop"})
            rank_step(events, phase_start, mark, share, rounding)

    def _state_numel(self, state: "Mapping[torch.Tensor, dict[str, object]]", key: str, dtype: torch.dtype) -> int:
        return sum(t.numel() for info in self.layout.by_id.values() for k, t in (state.get(info.ref) or {}).items()
                   if k == key and isinstance(t, torch.Tensor) and t.dtype == dtype)


def uneven_shard(blocks: "list[nn.Module]", world_size: int, parallel: "str | None") -> "str | None":
    """Why a ZeRO rank's flat shards are no line in the depth of a stack whose unit is ``blocks``, or None. A rank
    holds ceil(elements / N) of each flat buffer (:func:`_flat_shares`); where a unit adds ``e`` elements that
    ``N`` does not divide, that is no line in the units, though three cuts can fall on one by chance (a block of
    4,531 elements on 7 ranks: 1,438, 2,085, 2,732 elements at 2, 3, 4 blocks, a line of 647, which says 10,496 at
    16 where the shard holds 10,500). Checked for the parameters' and the trainable parameters' elements, by
    dtype and in all (the twin may cast them to one dtype)."""
    if parallel not in ("zero1", "zero2", "zero3"):
        return None
    params = list({id(p): p for b in blocks for p in b.parameters()}.values())
    counts: dict[str, int] = {}
    for trainable in (False, True):
        for p in params:
            if trainable and not p.requires_grad:
                continue
            for key in (str(p.dtype), "all"):
                label = f"{'trainable ' if trainable else ''}{key}"
                counts[label] = counts.get(label, 0) + p.numel()
    bad = next(((label, e) for label, e in counts.items() if e % world_size), None)
    if bad is None:
        return None
    return (f"a {parallel} rank holds ceil(elements / {world_size}) of each flat buffer, and a block of the stack adds "
            f"{bad[1]:,} elements ({bad[0]}), which {world_size} ranks do not divide: the shard is no line in depth")


def _flat_shares(members: "list[_Param]", n: int) -> "dict[_Param, int]":
    """ZeRO's flat partitions: for each dtype, the first parameter of it and rank 0's bytes of the flat buffer
    (ceil(elements / N) elements)."""
    groups: dict[torch.dtype, list[_Param]] = {}
    for info in members:
        groups.setdefault(info.ref.dtype, []).append(info)
    return {ps[0]: -(-sum(i.ref.numel() for i in ps) // n) * ps[0].ref.element_size() for ps in groups.values()}


def unit_blocks(model: nn.Module) -> "list[tuple[nn.Module, int]]":
    """The blocks FSDP is usually wrapped around, numbered from 1 (:func:`_units`)."""
    return _units(model)[0]


def _units(model: nn.Module) -> "tuple[list[tuple[nn.Module, int]], dict[int, int]]":
    """The blocks FSDP is usually wrapped around and, for each parameter in one, its unit (0: the root).

    A block is one of two or more children of one class, with parameters, in the same container (a
    transformer's layers): looked for outermost first, among modules with children of their own, then, if
    there are none anywhere, among leaf modules (a stack of Linears)."""
    for leaves in (False, True):
        blocks: list[nn.Module] = []
        taken: set[int] = set()
        for parent in model.modules():
            groups: dict[type, list[nn.Module]] = {}
            for child in parent.children():
                if id(child) in taken or not any(True for _ in child.parameters()):
                    continue
                if not leaves and not any(True for _ in child.children()):
                    continue
                groups.setdefault(type(child), []).append(child)
            for kids in groups.values():
                if len(kids) < 2:
                    continue
                for kid in kids:
                    if any(id(m) in taken for m in kid.modules()):
                        continue
                    blocks.append(kid)
                    taken.update(id(m) for m in kid.modules())
            # Modules inside a block are the block's: nothing nested is wrapped again.
        if blocks:
            units: dict[int, int] = {}
            out = []
            for i, block in enumerate(blocks, start=1):
                out.append((block, i))
                for p in block.parameters():
                    units.setdefault(id(p), i)
            return out, units
    return [], {}
