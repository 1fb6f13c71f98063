"""Independent simulations run in processes forked from this one, each answer sent back as a record.

A plan's groups of rows (:mod:`memprof.simulate.plan_processes`) and a pipeline's rank classes
(:func:`memprof.simulate.stages.simulate`) share nothing while they are simulated: each can run in a process of its
own, with the answers one process gives, in the same order. The processes are forked from this one, which has
built the model, so nothing is sent to them; what comes back is each part's result (records, which pickle) or the
exception it raised, raised here from the traceback it had there, and the warnings it issued, issued here
(:mod:`memprof.simulate.forked_answers`). The signal handlers the caller installed are not run in them. Each runs
torch on one thread, as torch's DataLoader workers do: GNU OpenMP, which torch's CPU kernels use, is not
safe to use in a child forked after the parent used it. Off Linux (no fork on Windows; on macOS a forked child of a
process that loaded the system's frameworks can crash), where one process is asked for, or inside a process this
module forked (its parts are already spread over the cores), every part runs here.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar, cast

from ..errors import InvalidArgumentError, MemprofError, is_interrupt
from .forked_answers import answer, delivered

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

__all__ = ["forked", "processes_for"]

T = TypeVar("T")

#: Set in a process this module forked: a part that would fork again runs in it instead.
_IN_CHILD = False


def processes_for(processes: "int | None", parts: int) -> int:
    """How many processes run ``parts`` independent parts: ``processes`` (at least 1) or, for None, one per part,
    at most twice the cores this process may run on; never more than the parts, and 1 off Linux or inside a forked
    part. One per part, not per core: the parts are whole searches of unequal cost (a plan's group of FSDP2 rows
    with its policy simulates 3 to 4 times slower than a group of ZeRO rows), and dealt to one process per core
    the cores wait on the process dealt the costlier pair (the 20-row Llama-3-8B plan's three groups, 24, 24 and
    21 s of CPU, took 48 s on two cores so); with a process each the system keeps every core busy to the end.
    Twice the cores at most keeps the copies of the model's simulation state in memory bounded."""
    if processes is not None and (isinstance(processes, bool) or not isinstance(processes, int) or processes < 1):
        raise InvalidArgumentError(f"processes must be a positive int (or None: one per part, at most twice the "
                                   f"cores), got {processes!r}")
    if _IN_CHILD or not sys.platform.startswith("linux") or "fork" not in multiprocessing.get_all_start_methods():
        return 1  # macOS offers fork, but a forked child of a process that loaded its system frameworks can crash
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(parts, processes if processes is not None else 2 * cores))


def forked(calls: "Sequence[Callable[[], T]]", n: int, what: str) -> "list[T]":
    """Each of ``calls``' results, in their order: here for ``n`` <= 1, else by ``n`` forked processes, the calls
    dealt out in turn (process ``w`` runs calls ``w``, ``w + n``, ...). ``what`` names the parts in the error of a
    process that ended without an answer. An exception a call raised is raised here; the processes still running
    then (or after an interrupt here) are ended, so no simulation goes on behind it."""
    if n <= 1:
        return [call() for call in calls]
    shares = [list(range(w, len(calls), n)) for w in range(n)]
    ctx = multiprocessing.get_context("fork")
    started: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
    try:
        for share in shares:
            receive, send = ctx.Pipe(duplex=False)
            worker = ctx.Process(target=_work, args=([calls[i] for i in share], send), daemon=True)
            worker.start()
            send.close()
            started.append((worker, receive))
        found: dict[int, T] = {}
        waiting = {receive: (share, running) for share, (running, receive) in zip(shares, started)}
        while waiting:  # each answer as it comes: a part that failed is raised at once, not after the others
            for ready in wait(list(waiting)):
                share, running = waiting.pop(cast("Connection", ready))
                found.update(zip(share, cast("list[T]", _received(cast("Connection", ready), running, what))))
        return [found[i] for i in range(len(calls))]
    finally:
        _ended(started)


def _ended(started: "list[tuple[multiprocessing.process.BaseProcess, Connection]]") -> None:
    """Every process of ``started`` ended and reaped, its pipe closed. One still running (an exception or an
    interrupt here) is asked to end (SIGTERM), then killed after :data:`_GRACE` seconds: a simulation holds signals
    until the op under way returns (:mod:`memprof.simulate.held_signals`), which for a deep model's backward takes
    minutes, and the caller's Ctrl-C must not wait on it."""
    for running, _receive in started:
        if running.is_alive():
            running.terminate()
    for running, receive in started:
        running.join(_GRACE)
        if running.is_alive():
            running.kill()
            running.join()
        receive.close()


#: Seconds a process asked to end (SIGTERM) has before it is killed.
_GRACE = 2.0


def _work(calls: "Sequence[Callable[[], object]]", send: "Connection") -> None:
    """A forked process's part: its calls' answer (:func:`memprof.simulate.forked_answers.answer`), sent back."""
    import torch

    global _IN_CHILD
    _IN_CHILD = True
    _own_signals()
    torch.set_num_threads(1)
    try:
        send.send_bytes(answer(calls))
    finally:
        send.close()


def _own_signals() -> None:
    """The signal handlers the caller installed are the caller's: a preemption handler that saves a checkpoint
    must not run in a process the user does not know of, nor keep it from ending when it is asked to. Each is
    Python's default again here (Ctrl-C raises KeyboardInterrupt, SIGTERM ends the process)."""
    for s in signal.valid_signals():
        try:
            handler = signal.getsignal(s)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError) as exc:  # a signal no handler may take
            if is_interrupt(exc):
                raise


def _received(receive: "Connection", worker: multiprocessing.process.BaseProcess, what: str) -> list[object]:
    """What ``worker`` sent: its results; an exception it raised is raised here."""
    try:
        got = receive.recv_bytes()
    except EOFError as exc:
        if is_interrupt(exc):
            raise
        worker.join()
        raise MemprofError(f"a process simulating {what} ended without an answer (exit code {worker.exitcode}); "
                           "pass processes=1 (--processes 1) to simulate them all in this process") from None
    return delivered(got)
