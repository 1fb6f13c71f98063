"""Interrupts a finaliser swallowed during a public call are raised again (memprof/swallowed.py): an estimate whose
forward drops an object whose ``__del__`` gets the Ctrl-C, or the user's preemption handler's exception, raises it
instead of returning as if uninterrupted; anything else a finaliser raises goes to the hook that was installed."""

from __future__ import annotations

import signal
import sys
import threading

import pytest
import torch
from torch import nn

import memprof
from memprof import swallowed
from tests import signals
from tests.signals import Preempted, preempted


class _Signalled:
    """Sends a signal to this process from its finaliser: the handler runs inside ``__del__``."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        signal.raise_signal(self.signum)


class _Raising:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __del__(self) -> None:
        raise self.exc


class DropsInForward(nn.Module):
    """A model whose forward drops an object between two torch calls: its finaliser runs there, outside any torch
    call, where the simulation's wrapped handler calls the user's at once."""

    def __init__(self, dropped) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)
        self.dropped = dropped

    def forward(self, x):
        h = self.a(x)
        if not REACHED:
            self.dropped()  # made and dropped at once
        out = self.b(h)
        REACHED.append(True)  # (the estimate runs a copy of the model: a module-level list, not an attribute)
        return out


#: Forwards that went past the torch call after the drop.
REACHED: "list[bool]" = []


@pytest.fixture(autouse=True)
def _reached():
    REACHED.clear()


@pytest.fixture
def unraisables(monkeypatch):
    """The unraisables that reach the hook installed before memprof's call."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    return seen


@pytest.fixture
def preemption_handler():
    with signals.preemption_handler():
        yield


def _estimate(model):
    return memprof.estimate(model, torch.optim.AdamW, inputs=torch.randn(4, 8))


def test_a_preemption_handlers_exception_inside_a_finaliser_comes_out_of_the_estimate(preemption_handler,
                                                                                    unraisables):
    before = sys.unraisablehook
    model = DropsInForward(lambda: _Signalled(signal.SIGUSR1))
    with pytest.raises(Preempted):
        _estimate(model)
    assert REACHED == []  # raised at the end of the next torch call (b's linear), not at the estimate's end
    assert unraisables == []  # kept, not printed
    assert sys.unraisablehook is before and swallowed.KEPT == []
    assert signal.getsignal(signal.SIGUSR1) is preempted


def test_a_keyboard_interrupt_raised_inside_a_finaliser_comes_out_of_the_estimate(unraisables):
    model = DropsInForward(lambda: _Raising(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        _estimate(model)
    assert unraisables == [] and swallowed.KEPT == []


def test_what_no_signal_handler_raises_goes_to_the_installed_hook(unraisables):
    # asyncio's CancelledError and GeneratorExit are not Exceptions, yet no handler raises them: a finaliser's own.
    import asyncio

    cancelled, closing = asyncio.CancelledError(), GeneratorExit()
    est = _estimate(DropsInForward(lambda: (_Raising(cancelled), _Raising(closing))))
    assert est.peak.total > 0 and {id(e) for e in unraisables} == {id(cancelled), id(closing)} and len(unraisables) == 2


def test_a_finalisers_own_failure_goes_to_the_installed_hook_and_the_estimate_goes_on(unraisables):
    failure = ValueError("a finaliser's bug")
    model = DropsInForward(lambda: _Raising(failure))
    est = _estimate(model)
    assert est.peak.total > 0
    assert unraisables == [failure]  # exactly once, the object itself


def _drops(exc):
    def call():
        _Raising(exc)
        assert swallowed.KEPT  # kept until the call ends
    return call


def _fails_after(drop, failure):
    def call():
        drop()
        raise failure
    return call


def test_an_interrupt_swallowed_after_the_last_torch_call_is_raised_when_the_call_returns(unraisables):
    with pytest.raises(KeyboardInterrupt):
        swallowed.guarded(_drops(KeyboardInterrupt()))
    assert unraisables == [] and swallowed.KEPT == []


def test_a_swallowed_interrupt_replaces_a_failure_and_is_not_raised_twice_over_an_interrupt(unraisables):
    with pytest.raises(KeyboardInterrupt) as raised:
        swallowed.guarded(_fails_after(_drops(KeyboardInterrupt()), ValueError("the call failed")))
    assert isinstance(raised.value.__context__, ValueError)  # the failure is kept as its context
    propagating = KeyboardInterrupt("the one propagating")
    with pytest.raises(KeyboardInterrupt) as raised:
        swallowed.guarded(_fails_after(_drops(KeyboardInterrupt()), propagating))
    assert raised.value is propagating and swallowed.KEPT == []


def test_nested_calls_put_the_hook_back_once_and_a_hook_installed_meanwhile_stays(unraisables):
    before = sys.unraisablehook
    seen = []

    def outer():
        swallowed.guarded(lambda: None)
        seen.append(sys.unraisablehook)

    swallowed.guarded(outer)
    assert seen[0] is not before  # the outer call still ran: the hook still memprof's
    assert sys.unraisablehook is before

    def theirs(u):
        return None

    def replaces():
        sys.unraisablehook = theirs

    swallowed.guarded(replaces)
    assert sys.unraisablehook is theirs


def test_an_interrupt_between_the_hooks_installing_and_putting_back_leaves_no_call_without_it(unraisables,
                                                                                            monkeypatch):
    # An interrupt can land at any bytecode, memprof's own included. Landing as the outermost call puts the hook
    # back, it leaves memprof's hook installed: outside a call it hands every unraisable on, and the next call
    # keeps interrupts and puts the hook back.
    before = sys.unraisablehook
    native = swallowed._put_back
    monkeypatch.setattr(swallowed, "_put_back", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        swallowed.guarded(lambda: None)
    monkeypatch.setattr(swallowed, "_put_back", native)
    assert sys.unraisablehook is not before  # left installed
    failure = ValueError("outside any call")
    _Raising(failure)
    _Raising(KeyboardInterrupt())  # outside a call: not memprof's to keep
    assert [type(e) for e in unraisables] == [ValueError, KeyboardInterrupt] and swallowed.KEPT == []
    with pytest.raises(KeyboardInterrupt):
        swallowed.guarded(_drops(KeyboardInterrupt()))
    assert sys.unraisablehook is before


def test_a_hook_installed_during_a_call_that_hands_on_reaches_the_original_once(unraisables):
    # A library initialised during a call installs a hook that hands on to the one it found: memprof's. The next
    # call installs memprof's over it; forwarding went round between the two until Python's recursion limit.
    handed = []

    def install_theirs():
        found = sys.unraisablehook

        def theirs(u):
            handed.append(u.exc_value)
            found(u)

        sys.unraisablehook = theirs

    swallowed.guarded(install_theirs)
    for call in (lambda: None, lambda: _Raising(ValueError("inside a call"))):
        swallowed.guarded(call)
    failure = ValueError("after both calls")
    _Raising(failure)
    assert [str(e) for e in handed] == ["inside a call", "after both calls"]
    assert [str(e) for e in unraisables] == ["inside a call", "after both calls"]  # the original's, once each


def test_a_hook_a_nested_call_finds_is_not_what_the_outer_call_puts_back(unraisables):
    before = sys.unraisablehook

    def temporary(u):
        return None

    def outer():
        mine = sys.unraisablehook
        sys.unraisablehook = temporary  # the user's code swaps the hook around a nested memprof call
        try:
            swallowed.guarded(lambda: None)
        finally:
            sys.unraisablehook = mine

    swallowed.guarded(outer)
    assert sys.unraisablehook is before


def test_an_interrupt_a_call_left_kept_is_not_raised_by_the_next_call(unraisables):
    # A second Ctrl-C landing as a call puts the hook back leaves the first kept: the next call is not its place.
    swallowed.KEPT.append(KeyboardInterrupt("left by an earlier call"))
    assert swallowed.guarded(lambda: 7) == 7
    assert swallowed.KEPT == []


def test_an_unraisable_raised_while_the_users_hook_runs_reaches_the_users_hook(monkeypatch):
    seen = []

    def users(u):
        seen.append(str(u.exc_value))
        if len(seen) == 1:
            _Raising(ValueError("inner, while the user's hook runs"))

    def call():
        _Raising(ValueError("outer"))  # dropped at once, inside the call

    monkeypatch.setattr(sys, "unraisablehook", users)
    swallowed.guarded(call)
    assert seen == ["outer", "inner, while the user's hook runs"]  # as without memprof


def test_a_thread_handing_an_unraisable_on_leaves_the_main_threads_interrupts_kept(monkeypatch):
    # One count of "forwarding" shared by every thread made the main thread's swallowed Ctrl-C go unkept while a
    # worker's unraisable was in the user's hook, and could stay set for good.
    import threading

    entered, leave, seen = threading.Event(), threading.Event(), []

    def slow(u):
        seen.append(str(u.exc_value))
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            leave.wait(5)

    monkeypatch.setattr(sys, "unraisablehook", slow)

    def call():
        worker = threading.Thread(target=lambda: _Raising(ValueError("the worker's")), daemon=True)
        worker.start()
        assert entered.wait(5)
        _Raising(KeyboardInterrupt())  # the main thread's, while the worker's is in the user's hook
        leave.set()
        worker.join(5)

    with pytest.raises(KeyboardInterrupt):
        swallowed.guarded(call)
    assert seen == ["the worker's"] and sys.unraisablehook is slow


def test_another_thread_changes_nothing(unraisables):
    before = sys.unraisablehook
    hooks = []
    worker = threading.Thread(target=lambda: swallowed.guarded(lambda: hooks.append(sys.unraisablehook)))
    worker.start()
    worker.join()
    assert hooks == [before]
