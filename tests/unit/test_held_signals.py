"""Signals held during a simulation (memprof/simulate/held_signals.py): the handlers the user installed are back
when the simulation ends, also when a signal's exception lands inside memprof's own putting back."""

from __future__ import annotations

import signal

import pytest

from memprof.simulate import held_signals
from tests.signals import Preempted, SwallowsInCopy, preempted, preemption_handler


@pytest.fixture
def user_handler():
    with preemption_handler():
        yield


def test_the_users_handler_is_back_after_the_last_mode_is_left(user_handler):
    held_signals.enter()
    assert signal.getsignal(signal.SIGUSR1) is not preempted  # wrapped while a simulation runs
    held_signals.enter()
    held_signals.leave()
    assert signal.getsignal(signal.SIGUSR1) is not preempted  # one mode is still entered
    held_signals.leave()
    assert signal.getsignal(signal.SIGUSR1) is preempted and held_signals.entered() == 0


def test_an_interrupt_landing_as_the_handlers_are_put_back_leaves_them_to_leave_to(user_handler, monkeypatch):
    # A Ctrl-C lands as leave() calls its putting back (Python runs a handler when a function is called): the
    # exception propagates, and the simulation's cleanup, leave_to(0), must still put the user's handler back.
    native = held_signals._put_back
    calls = []

    def interrupted(wrapped):
        calls.append(len(wrapped))
        if len(calls) == 1:
            raise Preempted  # before anything was put back
        native(wrapped)

    monkeypatch.setattr(held_signals, "_put_back", interrupted)
    held_signals.enter()
    with pytest.raises(Preempted):
        held_signals.leave()
    held_signals.leave_to(0)
    assert signal.getsignal(signal.SIGUSR1) is preempted and held_signals.entered() == 0
    assert calls[1] == calls[0] >= 1  # the second attempt was given every wrapped handler again


def test_signals_noted_during_a_call_are_each_raised_once_after_it_even_when_one_raises(monkeypatch):
    raised = []

    def fake_raise(signum):
        raised.append(signum)
        if signum == signal.SIGUSR1:
            raise Preempted

    monkeypatch.setattr(signal, "raise_signal", fake_raise)
    monkeypatch.setattr(held_signals._State, "pending", [])
    held_signals.hold()
    held_signals._State.pending += [signal.SIGUSR1, signal.SIGUSR2, signal.SIGUSR1]
    with pytest.raises(Preempted):
        held_signals.release()
    assert raised == [signal.SIGUSR1] and held_signals._State.pending == [signal.SIGUSR2]  # kept, not dropped
    held_signals.hold()
    held_signals.release()
    assert raised == [signal.SIGUSR1, signal.SIGUSR2] and held_signals._State.pending == []


def test_a_signal_during_a_held_deep_copy_is_handled_when_the_copy_ends(user_handler):
    import copy

    before = SwallowsInCopy.copies  # (other tests copy it too)
    with pytest.raises(Preempted):
        held_signals.deepcopy_held([SwallowsInCopy()], {})
    assert SwallowsInCopy.copies == before + 1  # the copy ran to its end, then the handler
    assert signal.getsignal(signal.SIGUSR1) is preempted and held_signals.entered() == 0
    assert held_signals._State.depth == 0 and held_signals._State.pending == []
    copy.deepcopy([SwallowsInCopy()])  # unheld, the same copy drops the handler's exception: nothing raised
    assert SwallowsInCopy.copies == before + 2


def test_a_held_deep_copy_inside_a_held_call_leaves_the_signal_to_that_call(user_handler):
    # A copy made while a simulated torch call runs: its signals stay noted until that outermost call ends.
    held_signals.enter()
    try:
        held_signals.hold()
        held_signals.deepcopy_held([SwallowsInCopy()], {})
        assert held_signals._State.pending == [signal.SIGUSR1] and held_signals.entered() == 1
        with pytest.raises(Preempted):
            held_signals.release()
    finally:
        held_signals.leave_to(0)
    assert signal.getsignal(signal.SIGUSR1) is preempted and held_signals._State.depth == 0


def test_signals_a_raisingpreempted_left_noted_run_when_the_last_mode_is_left(user_handler):
    # The release stops at the first handler that raises; what is left noted used to wait for the first torch call
    # of a later, unrelated simulation, and interrupt it.
    ran = []
    previous = signal.signal(signal.SIGUSR2, lambda s, f: ran.append(s))
    try:
        held_signals.enter()
        held_signals.hold()
        held_signals._State.pending += [signal.SIGUSR1, signal.SIGUSR2]
        with pytest.raises(Preempted):
            held_signals.release()
        assert held_signals._State.pending == [signal.SIGUSR2]
        held_signals.leave()
        assert held_signals._State.pending == [] and ran == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGUSR1) is preempted
    finally:
        held_signals.leave_to(0)
        signal.signal(signal.SIGUSR2, previous)


def test_a_held_copy_in_another_thread_leaves_the_main_threads_state_alone(user_handler):
    import threading

    held_signals.enter()
    held_signals.hold()
    try:
        done = []
        worker = threading.Thread(target=lambda: done.append(held_signals.deepcopy_held([1, {2}], {})), daemon=True)
        worker.start()
        worker.join(5)
        assert done == [[1, {2}]] and not worker.is_alive()
        assert held_signals._State.depth == 1 and held_signals.entered() == 1
        held_signals.release()
    finally:
        held_signals.leave_to(0)
