"""Collectives on real gloo ranks, each let go by gloo before its caller goes on, as the simulation's fake
process group completes each at once.

gloo's worker thread drops its references to a collective's tensors a moment after the collective completes;
where the caller has dropped its own first, the storage is freed on that thread at a time the machine's load
decides (ProcessGroupGloo's worker resets its work in progress after marking it complete). A real rank's phase
may then end, or peak, holding a collective's buffer or not: full suite runs saw rank 0's backward peak differ in
gradients from its simulation, and its forward end hold an 8,840-byte gather buffer the simulation had freed;
each test passed alone. A worker calls :func:`settle_collectives` before it builds its model.

Functional collectives (``torch.ops._c10d_functional``: funcol, DTensor's redistributions, the autograd
all-to-all whose backward collective autograd's C++ issues) are settled by :class:`LetGoByGloo`, a dispatch mode
below memprof's. Full suite runs saw the expert-parallel test's rank 1 end its backward holding a 6,144-byte
all-to-all buffer its simulation had freed (the buffer and a 6,912-byte temporary freed on gloo's thread). Here gloo
holds a tensor through its TensorImpl (the work keeps the caller's ``at::Tensor``), not through a new view of its
storage, so the settling watches the tensors' use counts, not their storages'."""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _uses(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


#: How long a collective's tensors may stay held after it completed before settling gives up (a hang is worse than
#: a failure that says what held on).
LET_GO_WITHIN_S = 60.0


def _wait_until(settled: Callable[[], bool], held: Callable[[], str]) -> None:
    """Returns once ``settled()``; raises, saying ``held()``, after :data:`LET_GO_WITHIN_S` seconds."""
    deadline = time.monotonic() + LET_GO_WITHIN_S
    while not settled():
        if time.monotonic() > deadline:
            raise RuntimeError(f"a collective completed, but {held()} {LET_GO_WITHIN_S:.0f} s later")
        time.sleep(0)


def let_go_by_gloo(collective: Callable[..., Any]) -> Callable[..., Any]:
    """``collective`` (an all-gather or reduce-scatter into one output) waited for, returning once gloo holds none
    of its tensors; an asynchronous call returns a finished stand-in for the work, which FSDP2 does not wait on (it
    waits only on a dist.Work)."""

    def call(output, input, *args, async_op=False, **kwargs):
        before = (_uses(output), _uses(input))
        work = collective(output, input, *args, async_op=True, **kwargs)
        work.wait()
        del work
        _wait_until(lambda: (_uses(output), _uses(input)) == before,
                    lambda: f"{collective.__name__}'s storages still held: {(_uses(output), _uses(input))} "
                            f"(before it: {before})")
        return object() if async_op else None

    return call


class LetGoByGloo(TorchDispatchMode):
    """Every functional collective (an op of ``_c10d_functional`` that runs on a process group) waited for where it
    is issued, returning once gloo holds none of its tensors: each input's TensorImpl use count back to what it was
    before the op, each output that is not an input held only by the op's result.

    Entered before memprof's profile, so below memprof's mode: memprof sees the op and its output as it would
    without this mode, and sees neither the early ``wait_tensor`` nor anything this mode does. The caller's own
    ``wait_tensor`` later finds no work left to wait for, as under the simulation's fake process group, which
    completes each collective at once. Waiting at issue rather than at the caller's wait keeps an input the
    caller drops between the two from being freed on gloo's thread."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "_c10d_functional" or not any(a.name == "group_name" for a in func._schema.arguments):
            return func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        before = [t._use_count() for t in inputs]
        out = func(*args, **kwargs)
        fresh = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and not any(t is i for i in inputs)]
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                torch.ops._c10d_functional.wait_tensor(t)
        _wait_until(lambda: [t._use_count() for t in inputs] == before and all(t._use_count() == 1 for t in fresh),
                    lambda: f"{func}'s tensors were still held: inputs {[t._use_count() for t in inputs]} (before it: "
                            f"{before}), outputs {[t._use_count() for t in fresh]} (1 each once let go)")
        return out


def settle_collectives() -> None:
    """In this (spawned) process: FSDP2's all-gather and reduce-scatter settled as :func:`let_go_by_gloo` does, and
    every functional collective as :class:`LetGoByGloo` does (the mode entered for the rest of the process, under
    any profile the process opens later)."""
    dist.all_gather_single = let_go_by_gloo(dist.all_gather_single)
    dist.reduce_scatter_single = let_go_by_gloo(dist.reduce_scatter_single)
    LetGoByGloo().__enter__()


#: How long a rank waits on its peers (the store's rendezvous, each collective) before it raises. torch's default is
#: 30 minutes: a rank whose peer died or never joined would hold the suite that long, and CI's whole run is bounded.
#: Five minutes is many times the slowest rank's step under a loaded machine.
RANK_TIMEOUT = datetime.timedelta(minutes=5)


def join_gloo(rank: int, world: int, store: str) -> None:
    """This spawned process joins a gloo group of ``world`` ranks as ``rank``, through the file ``store`` (a path
    in the test's own temporary folder). A file, not a TCP port: a port picked free and closed before rank 0 binds
    it can be taken meanwhile by another test's ranks on the other xdist worker, whose rendezvous the ranks would
    then join."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=RANK_TIMEOUT)
