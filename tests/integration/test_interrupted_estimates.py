"""An estimate the user's Ctrl-C cuts short, wherever it lands, leaves nothing that changes the next one.

A real Ctrl-C lands at a random instant (tests/integration/test_signal_storm.py runs 300 of them); here the instant is
chosen: the estimate is run under ``sys.setprofile``, and at its N-th Python call the profile function sets SIGINT
pending (``_thread.interrupt_main``, as the signal's arrival does), so the handler runs at that function's first
bytecode, through whatever memprof has installed (:mod:`memprof.simulate.held_signals`), as a real signal's would.
After each interruption, once the ``except`` that caught it has ended (its traceback, and every frame it held, gone),
the thread's torch state is as before and the next estimate gives the uninterrupted one's figures.
"""

from __future__ import annotations

import _thread
import contextlib
import gc
import signal
import sys
from types import CodeType, FrameType
from typing import Callable

import pytest
import torch
from torch.utils import _python_dispatch as _pd

import memprof
from memprof.simulate.stages import NothingLeftBehind
from tests.models import MLP
from tests.signals import Preempted, SwallowsInCopy, preempted, preemption_handler


def _estimate(model: torch.nn.Module, x: torch.Tensor) -> memprof.Estimate:
    return memprof.estimate(model, torch.optim.AdamW, inputs=x, steps=1)


def _thread_state() -> tuple[object, ...]:
    """What torch keeps per thread that an interrupted simulation could leave changed."""
    return (str(torch._C._dispatch_tls_local_include_set()), str(torch._C._dispatch_tls_local_exclude_set()),
            torch._C._meta_in_tls_dispatch_include(), str(torch._C._get_torch_function_state()),
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
            torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack(),
            torch._C._autograd._top_saved_tensors_default_hooks(False), signal.getsignal(signal.SIGINT),
            # torch's Python-level "a dispatch mode is in" flags (process-wide: read by torch.compile, FakeTensor),
            # which a mode's __exit__ puts back and a raw pop of the stack does not.
            _pd._is_in_torch_dispatch_mode, _pd._is_in_non_infra_torch_dispatch_mode,
            _pd._is_in_any_mode_without_ignore_compile_internals)


def _calls(run: Callable[[], object]) -> list[tuple[CodeType, CodeType, int]]:
    """Each Python call ``run`` makes, in order: the function called, its caller and the caller's line."""
    calls: list[tuple[CodeType, CodeType, int]] = []

    def note(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_back is not None:
            calls.append((frame.f_code, frame.f_back.f_code, frame.f_back.f_lineno))

    sys.setprofile(note)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def _interrupted_at(run: Callable[[], object], n: int) -> "bool | None":
    """Run ``run`` with a SIGINT arriving as its ``n``-th Python call starts: whether KeyboardInterrupt reached here;
    None where the run made fewer calls (no SIGINT was sent: finalisers run at other times from run to run)."""
    seen = 0

    def count(frame: FrameType, event: str, arg: object) -> None:
        nonlocal seen
        if event == "call":
            seen += 1
            if seen == n:
                sys.setprofile(None)
                _thread.interrupt_main(signal.SIGINT)

    try:
        sys.setprofile(count)
        run()
    except KeyboardInterrupt:
        return True
    finally:
        sys.setprofile(None)
    return False if seen >= n else None


def test_an_interrupt_at_any_point_of_an_estimate_leaves_the_next_one_unchanged():
    model, x = MLP(), torch.randn(4, 32)
    run = lambda: _estimate(model, x)  # noqa: E731
    run()  # torch's fake-tensor dispatch cache filled: the path a later estimate takes
    expected, before = run(), _thread_state()
    calls = _calls(run)
    # Where an interrupt cuts a `with` short: the first call of each site that enters a generator-based context
    # manager's __enter__ or __exit__ (torch's fake kernels enter one per op, in twin making and in the step); and
    # every call at an even spread over the whole estimate.
    sites: dict[tuple[CodeType, CodeType, int], int] = {}
    for n, site in enumerate(calls, 1):
        if site[0].co_filename == contextlib.__file__ and site[0].co_name in ("__enter__", "__exit__"):
            sites.setdefault(site, n)
    assert len(sites) > 10
    points = sorted({*sites.values(), *range(1, len(calls), len(calls) // 120)})
    reached = sent = 0
    for n in points:
        got_there = _interrupted_at(run, n)
        sent += got_there is not None
        reached += bool(got_there)
        where = f"interrupted at call {n}, {calls[n - 1][0].co_qualname} from {calls[n - 1][1].co_qualname}"
        assert _thread_state() == before, where
        got = run()
        assert (got.trace, got.notes) == (expected.trace, expected.notes), where
    gc.collect()  # what the interrupted estimates' frames held in reference cycles is gone, its finalisers run
    assert _thread_state() == before
    # Every interrupt reached the caller, those landing in a finaliser too (where Python itself would report and
    # drop it: memprof/swallowed.py raises it again). A run can make fewer calls than the one counted (finalisers
    # run at other times), so the last points may never send theirs: few.
    assert reached == sent >= len(points) - 5


@contextlib.contextmanager
def _keys_kept():
    """As torch's fake kernels' context manager (``in_kernel_invocation_manager``): the thread's dispatch keys as
    they are on entry, put back whole at the exit."""
    with torch._C._PreserveDispatchKeyGuard():
        yield


def _cut_short() -> None:
    # Inside an op's dispatch, where torch excludes autograd, a fake kernel's context manager is entered; the
    # interrupt lands before its `with` registers the exit (at the first line of its __exit__ alike).
    torch._C._dispatch_tls_set_dispatch_key_excluded(torch._C.DispatchKey.AutogradCPU, True)
    keys = _keys_kept()
    keys.__enter__()
    raise KeyboardInterrupt


def test_a_context_manager_an_interrupt_abandoned_is_finished_before_the_thread_is_put_back():
    assert not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradCPU)
    try:
        with NothingLeftBehind():
            _cut_short()
    except KeyboardInterrupt:
        pass
    # The traceback is gone: had the abandoned generator been left to die with it, it would have put back the set
    # it kept, autograd excluded, after the simulation's cleanup; and that cleanup puts back the whole set.
    assert not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradCPU)
    a = torch.ones(2, requires_grad=True)
    assert (a * 2).requires_grad


def test_a_mode_an_interrupt_left_entered_is_taken_off_with_torchs_flags_put_back():
    # The interrupt lands after a dispatch mode's entry and before its `with` registered the exit: the cleanup
    # takes the mode off the stack, and torch's process-wide "a dispatch mode is in" flags, which that mode's
    # exit would have put back, are put back too (torch.compile and FakeTensor read them).
    before = _thread_state()

    class Entered(_pd.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    try:
        with NothingLeftBehind():
            Entered().__enter__()
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert _thread_state() == before


def test_a_signal_while_the_estimate_copies_the_model_comes_out_of_it():
    # The model holds an attribute whose deep copy drops the handler's exception, as copyreg does for every
    # OrderedDict and set a model's copy meets.
    model, x = MLP(), torch.randn(4, 32)
    model.kept = SwallowsInCopy()
    with preemption_handler():
        with pytest.raises(Preempted):  # not dropped inside the copy: raised as the copy ends
            _estimate(model, x)
        assert signal.getsignal(signal.SIGUSR1) is preempted
