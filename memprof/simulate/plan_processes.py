"""A plan's rows searched in several processes, with the answers one process gives.

Rows share simulations only within a *group*: one precision and one family of layouts. The batch lines are
measured once per (checkpointing, precision, family), and a row starts from its own row with checkpointing the other
way and from the family's reference (:class:`memprof.simulate.plan._Grid`); nothing crosses precisions or families.
So the groups are independent searches, and each can run in a process of its own: the same simulations, the same
answers, in the same order.

The processes are forked from this one, which has built the model and the layouts, so nothing is sent to them;
what comes back is each group's rows (records) or the exception its search raised, re-raised here as it was. Each
runs torch on one thread, as torch's DataLoader workers do: GNU OpenMP, which torch's CPU kernels use, is not safe
to use in a child forked after the parent used it. Off Linux (no fork on Windows; on macOS a forked child of a
process that loaded the system's frameworks can crash), or where one process is asked for, every row is searched
here.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
from typing import TYPE_CHECKING, Callable, Sequence

from ..errors import InvalidArgumentError, MemprofError, is_interrupt

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from ..record.plans import PlanRow
    from .layouts import Layout

__all__ = ["searched", "groups_of", "processes_for"]

Config = tuple[bool, str, "Layout"]
Search = Callable[[Sequence[Config]], "list[PlanRow]"]


def groups_of(configs: Sequence[Config]) -> list[list[int]]:
    """The indices of ``configs`` in groups that share no simulation (one precision and family of layouts each),
    each in the grid's order, the groups in the order of their first row."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, (_ckpt, precision, layout) in enumerate(configs):
        groups.setdefault((precision, layout.family or layout.name), []).append(i)
    return list(groups.values())


def processes_for(processes: "int | None", groups: int) -> int:
    """How many processes search ``groups`` groups: ``processes`` (at least 1) or, for None, one per core this
    process may run on; never more than the groups, and 1 off Linux."""
    if processes is not None and (isinstance(processes, bool) or not isinstance(processes, int) or processes < 1):
        raise InvalidArgumentError(f"processes must be a positive int (or None: one per core), got {processes!r}")
    if not sys.platform.startswith("linux") or "fork" not in multiprocessing.get_all_start_methods():
        return 1  # macOS offers fork, but a forked child of a process that loaded its system frameworks can crash
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(groups, processes if processes is not None else cores))


def searched(configs: Sequence[Config], search: Search, processes: "int | None") -> "tuple[list[PlanRow], int]":
    """The rows ``search`` gives for ``configs``, in their order, and how many processes searched them: in one call
    here, or each group of :func:`groups_of` by a forked process, ``processes`` of them at most
    (:func:`processes_for`), the groups dealt out in turn."""
    groups = groups_of(configs)
    n = processes_for(processes, len(groups))
    if n <= 1:
        return search(configs), 1
    shares = [[i for g in groups[w::n] for i in g] for w in range(n)]
    ctx = multiprocessing.get_context("fork")
    started: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
    try:
        for share in shares:
            receive, send = ctx.Pipe(duplex=False)
            worker = ctx.Process(target=_work, args=(search, [configs[i] for i in share], send), daemon=True)
            worker.start()
            send.close()
            started.append((worker, receive))
        found: dict[int, PlanRow] = {}
        for share, (running, receive) in zip(shares, started):
            rows = _received(receive, running)
            found.update(zip(share, rows))
        return [found[i] for i in range(len(configs))], n
    finally:
        for running, receive in started:  # after an error or an interrupt here, no search goes on behind it
            if running.is_alive():
                running.terminate()
            running.join()
            receive.close()


def _work(search: Search, configs: Sequence[Config], send: "Connection") -> None:
    """A forked process's part: its rows, or the exception the search raised, sent back."""
    import torch

    torch.set_num_threads(1)
    try:
        message: tuple[str, object] = ("rows", search(configs))
    except BaseException as exc:  # sent to the parent, which raises it: nothing is swallowed
        message = ("raised", exc)
    try:
        send.send(message)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:  # an exception that does not pickle
        if is_interrupt(exc):
            raise
        send.send(("raised", MemprofError(f"a plan's search failed in a process of its own: {message[1]!r}")))
    finally:
        send.close()


def _received(receive: "Connection", worker: multiprocessing.process.BaseProcess) -> "list[PlanRow]":
    """What ``worker`` sent: its rows; an exception it raised is raised here."""
    try:
        kind, value = receive.recv()
    except EOFError as exc:
        if is_interrupt(exc):
            raise
        worker.join()
        raise MemprofError(f"a process searching a plan's rows ended without an answer (exit code "
                           f"{worker.exitcode}); pass processes=1 (--processes 1) to search every row in this "
                           "process") from None
    if kind == "raised":
        assert isinstance(value, BaseException)
        raise value
    assert isinstance(value, list)
    return value
