"""One rank of a data-parallel job, from a one-process simulation: ``estimate(world_size=N, parallel=...)``.

The simulation runs one rank's batch on shape-only tensors (memprof.simulation): its activations and
temporaries are that rank's. What the parallel layout changes is the model states and the collective
buffers, and those follow from the parameters' shapes, the optimizer's state tensors and the layout's
rules, for rank 0 (the rank that holds the most rows when a dimension does not divide):

- ``ddp``: everything whole; DDP's buckets copy every gradient (Li et al. 2020, "PyTorch Distributed",
  §3.2.3).
- ``zero1`` / ``zero2`` / ``zero3``: ZeRO's partitions of the flattened states (Rajbhandari et al. 2020,
  §5, Table I): optimizer states; also gradients; also parameters. Each rank holds ``ceil(Ψ / N)``.
- ``fsdp``: FSDP2's ``fully_shard`` per parameter: dim 0 padded to a multiple of ``N``, every rank storing
  ``ceil(rows / N)`` rows (torch/distributed/fsdp/_fully_shard/_fsdp_param.py); optimizer state is made
  like the real rows of the local shard. Units are the usual wrapping: each block of a repeated stack
  (the children of a ModuleList of one class) and the root for the rest. While a unit runs its full
  parameters are gathered (weights) through one flat all-gather buffer (communication); in backward its
  full gradients wait for one flat reduce-scatter buffer. The root's parameters stay gathered from its
  forward to its backward (FSDP2 does not reshard the root after forward).

Moments are transformed phase by phase: at a forward's or backward's peak the largest unit is gathered,
with FSDP2's buffers for it (it keeps the previous all-gather's buffer until the next one is copied out,
so two buffers); at phase ends nothing is, except the root after a forward. Phase ends are exact
(tests hold them to real ranks); peaks are an upper bound for the unit running then.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from .categories import Category, Phase
from .errors import InvalidArgumentError, UnknownNameError
from .records import Breakdown, RankInfo
from .reconciler.sharding import STAGES

__all__ = ["PARALLEL", "check_parallel", "RankLayout"]

#: The layouts ``estimate(parallel=...)`` simulates.
PARALLEL = ("ddp", "fsdp", "zero1", "zero2", "zero3")

W, G, O, T, COMM = (Category.WEIGHTS, Category.GRADIENTS, Category.OPTIMIZER_STATES, Category.TEMPORARIES,
                    Category.COMMUNICATION)


def check_parallel(world_size: Any, parallel: Any) -> "tuple[int, str | None]":
    """The world size and layout of an estimate, checked: a positive int, and one of :data:`PARALLEL`
    (needed as soon as there is more than one rank)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"world_size must be a positive int (the number of ranks), got {world_size!r}")
    if parallel is None:
        if world_size > 1:
            raise InvalidArgumentError(
                f"world_size={world_size} needs parallel=: how the ranks share the model, one of "
                + ", ".join(PARALLEL))
        return world_size, None
    name = parallel.strip().lower() if isinstance(parallel, str) else parallel
    if name not in PARALLEL:
        raise UnknownNameError(f"unknown parallel layout {parallel!r}; use one of " + ", ".join(PARALLEL))
    return world_size, name


@dataclasses.dataclass(frozen=True)
class _Param:
    numel: int
    rows: int  # dim 0 (1 for a scalar)
    itemsize: int
    trainable: bool
    state_like: int  # optimizer state bytes in tensors shaped like the parameter
    state_whole: int  # optimizer state bytes in other tensors (scalars such as Adam's step)
    unit: int  # the FSDP unit it belongs to (0: the root)


class RankLayout:
    """Rank 0's model states and collective buffers under a layout, from the simulated model and optimizer."""

    def __init__(self, model: nn.Module, optimizer: "torch.optim.Optimizer | None", world_size: int,
                 parallel: str, rounding: int) -> None:
        self.n, self.parallel, self.stage, self.r = world_size, parallel, STAGES[parallel], rounding
        units = _units(model)
        state = optimizer.state if optimizer is not None else {}
        self.params: list[_Param] = []
        seen: set[int] = set()
        for p in model.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            like = whole = 0
            for t in (state.get(p) or {}).values():
                if isinstance(t, torch.Tensor):
                    nbytes = t.numel() * t.element_size()
                    if t.shape == p.shape:
                        like += nbytes
                    else:
                        whole += nbytes
            self.params.append(_Param(p.numel(), p.shape[0] if p.dim() else 1, p.element_size(), p.requires_grad,
                                      like, whole, units.get(id(p), 0)))

    # -- sizes ----------------------------------------------------------------------------------

    def rnd(self, nbytes: "int | Fraction") -> int:
        n = int(-(-Fraction(nbytes) // 1))  # whole bytes, rounded up
        return n if self.r <= 1 or n == 0 else -(-n // self.r) * self.r

    def _rows0(self, p: _Param) -> int:
        return -(-p.rows // self.n)  # rank 0's rows: ceil(rows / N)

    def full(self, cat: Category) -> int:
        """What one process holds of a model state with nothing sharded (as the simulation counted it)."""
        if cat is W:
            return sum(self.rnd(p.numel * p.itemsize) for p in self.params)
        if cat is G:
            return sum(self.rnd(p.numel * p.itemsize) for p in self.params if p.trainable)
        return sum(self.rnd(p.state_like) + (self.rnd(p.state_whole) if p.state_whole else 0) for p in self.params)

    def shard(self, cat: Category) -> int:
        """Rank 0's bytes of a model state under the layout."""
        sharded = {W: self.stage >= 3, G: self.stage >= 2, O: self.stage >= 1}[cat]
        if not sharded:
            return self.full(cat)
        ps = [p for p in self.params if cat is W or p.trainable]
        if self.parallel == "fsdp":
            if cat is O:
                return sum(self.rnd(Fraction(p.state_like * min(self._rows0(p), p.rows), p.rows))
                           + (self.rnd(p.state_whole) if p.state_whole else 0) for p in self.params)
            return sum(self.rnd(self._rows0(p) * (p.numel // max(p.rows, 1)) * p.itemsize) for p in ps)
        # ZeRO: the flattened states split evenly; each rank holds ceil(total / N).
        if cat is O:
            like = sum(p.state_like for p in self.params)
            return self.rnd(-(-like // self.n)) + sum(self.rnd(p.state_whole) for p in self.params if p.state_whole)
        return self.rnd(-(-sum(p.numel * p.itemsize for p in ps) // self.n))

    def gathered(self, unit: "int | None") -> int:
        """The full (padded) parameters of one unit, gathered into one storage per parameter."""
        ps = [p for p in self.params if unit is None or p.unit == unit]
        if self.parallel == "fsdp":
            return sum(self.rnd(self._rows0(p) * self.n * (p.numel // max(p.rows, 1)) * p.itemsize) for p in ps)
        return sum(self.rnd(p.numel * p.itemsize) for p in ps)

    def unit_bytes(self) -> "tuple[int, int]":
        """(the root unit's gathered bytes, the largest other unit's)."""
        units = {p.unit for p in self.params}
        root = self.gathered(0) if 0 in units else 0
        return root, max([self.gathered(u) for u in units if u != 0] or [0])

    def rank_info(self) -> RankInfo:
        info = RankInfo(rank=0, world_size=self.n, backend=None, layout=self.parallel,
                        bucket_view=False if self.parallel == "ddp" else None)
        if self.parallel != "fsdp":
            return info
        padded = self.shard(W)
        real = sum(self.rnd(min(self._rows0(p), p.rows) * (p.numel // max(p.rows, 1)) * p.itemsize)
                   for p in self.params)
        return dataclasses.replace(info, sharded_bytes=padded, padding_bytes=padded - real,
                                   unsharded_bytes=self.gathered(None))

    # -- the trace ------------------------------------------------------------------------------

    def apply(self, trace: Any) -> Any:
        """``trace`` (one process, nothing sharded) as rank 0 of the layout would hold it."""
        full = {c: self.full(c) for c in (W, G, O)}
        shard = {c: self.shard(c) for c in (W, G, O)}
        root, unit = self.unit_bytes()
        gathers = self.stage >= 3
        first_backward = next((i for i, p in enumerate(trace.phases) if p.phase is Phase.BACKWARD), None)

        def moment(b: Breakdown, phase: Phase, where: str, index: int) -> Breakdown:
            v = {c: b[c] for c in Category}
            for c in (W, G, O):
                if v[c] is not None and full[c]:
                    v[c] = shard[c] if v[c] == full[c] else int(Fraction(v[c] * shard[c], full[c]))
            if self.stage >= 1 and phase is Phase.OPTIMIZER and v[T] and full[O]:
                v[T] = int(Fraction(v[T] * shard[O], full[O]))  # the step works on the rank's shard only
            comm = 0
            if self.parallel == "ddp":
                # The buckets exist once the first backward has run (they are the gradients' copies).
                comm = full[G] if first_backward is not None and index >= first_backward else 0
            elif gathers and phase in (Phase.FORWARD, Phase.BACKWARD):
                if where == "peak":
                    # The block running is gathered (the root stays so throughout); FSDP2 keeps the previous
                    # all-gather's buffer until the next one is copied out, so two buffers of a block's size. In
                    # backward the block's full gradients, copied into the reduce-scatter buffer, take the place
                    # of the second buffer, so the same bound holds.
                    v[W] = (v[W] or 0) + root + unit
                    comm = 2 * unit
                elif phase is Phase.FORWARD and where == "end":
                    v[W] = (v[W] or 0) + root
            v[COMM] = comm if self.parallel in ("ddp", "fsdp", "zero3") else None
            return Breakdown.from_mapping(v)

        steps = []
        index = 0
        best: "tuple[int, Breakdown, int, Phase] | None" = None
        for step in trace.steps:
            phases = []
            for rec in step.phases:
                new = dataclasses.replace(rec, start=moment(rec.start, rec.phase, "start", index),
                                          peak=moment(rec.peak, rec.phase, "peak", index),
                                          end=moment(rec.end, rec.phase, "end", index))
                phases.append(new)
                total = new.peak.total or 0
                if best is None or total > best[0]:
                    best = (total, new.peak, step.index, rec.phase)
                index += 1
            steps.append(dataclasses.replace(step, phases=tuple(phases)))
        out = dataclasses.replace(trace, steps=tuple(steps), distributed=self.rank_info())
        if best is not None:
            out = dataclasses.replace(out, peak=best[1], peak_step=best[2], peak_phase=best[3])
        return out

    def notes(self) -> list[str]:
        n = self.n
        out = [f"one rank of {n} under {self.parallel}: the simulated batch is this rank's; model states and "
               "collective buffers are rank 0's as the layout shards them (rank 0 holds the most rows)"]
        if self.stage >= 3:
            out.append("gathered parameters at each forward and backward peak: the root's (kept from its forward to "
                       "its backward) and the largest wrapped block's, with two collective buffers of that block's "
                       "size (FSDP2 keeps the previous all-gather's until the next is copied out; in backward the "
                       "reduce-scatter's). A bound for the block running at the peak; the ends of phases are exact")
        if self.parallel in ("zero1", "zero2"):
            out.append("DeepSpeed's reduce and all-gather buckets (reduce_bucket_size, allgather_bucket_size) depend "
                       "on its config: communication is not estimated")
        return out


def _units(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> FSDP unit: each child of a ModuleList/Sequential of 2+ modules of one class with
    parameters is a unit of its own (a transformer's blocks); the rest is the root's (unit 0)."""
    units: dict[int, int] = {}
    n = 0
    for m in model.modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        kids = [c for c in m.children() if any(True for _ in c.parameters())]
        if len(kids) < 2 or len({type(c) for c in kids}) != 1:
            continue
        for c in kids:
            if any(id(p) in units for p in c.parameters()):
                continue  # inside a unit already found (a stack within a block)
            n += 1
            for p in c.parameters():
                units.setdefault(id(p), n)
    return units
