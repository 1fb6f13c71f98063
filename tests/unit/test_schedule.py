"""memprof.schedule() (memprof.collect.schedule): which steps a schedule skips, waits, warms up, records and ends
a window on, as exact lists over the steps of a run, and every schedule that cannot work refused."""

from __future__ import annotations

import pytest

from memprof.collect.schedule import ACTIVE, DONE, SKIP, WAIT, WARMUP, Schedule, schedule
from memprof.errors import InvalidArgumentError


def test_the_schedule_reads_like_torch_profilers():
    plan = schedule(skip_first=1, wait=1, warmup=1, active=2, repeat=2)
    assert [plan(i) for i in range(11)] == [SKIP, WAIT, WARMUP, ACTIVE, ACTIVE, WAIT, WARMUP, ACTIVE, ACTIVE, DONE,
                                            DONE]
    forever = schedule(wait=1, active=1)
    assert [forever(i) for i in range(5)] == [WAIT, ACTIVE, WAIT, ACTIVE, WAIT]


@pytest.mark.parametrize("kwargs, problem", [
    ({"wait": -1}, "negative"), ({"active": 0}, "records nothing"), ({"repeat": 1.5}, "must be an int"),
    ({"skip_first": True}, "must be an int"),
])
def test_a_schedule_that_cannot_work_is_refused(kwargs, problem):
    with pytest.raises(InvalidArgumentError, match=problem):
        schedule(**kwargs)


def _steps(plan, predicate, n=14):
    return [i for i in range(n) if predicate(plan, i)]


def test_each_knob_moves_exactly_the_steps_it_names():
    # The default records every step, one-step windows, forever.
    assert _steps(schedule(), lambda p, i: p.records(i), 5) == [0, 1, 2, 3, 4]
    # wait=2: each cycle is 2 waits then 1 recorded step (steps 2, 5, 8, ...).
    assert _steps(schedule(wait=2), lambda p, i: p.records(i), 9) == [2, 5, 8]
    # warmup=1 after wait=1: hooks are on in the warmup step (watched) but it is not recorded.
    plan = schedule(wait=1, warmup=1, active=1)
    assert _steps(plan, lambda p, i: p.watches(i), 9) == [1, 2, 4, 5, 7, 8]
    assert _steps(plan, lambda p, i: p.records(i), 9) == [2, 5, 8]
    # active=3, repeat=2: two windows of three steps, then nothing.
    plan = schedule(active=3, repeat=2)
    assert _steps(plan, lambda p, i: p.records(i), 9) == [0, 1, 2, 3, 4, 5]
    assert [plan(i) for i in (5, 6, 100)] == [ACTIVE, DONE, DONE]
    # skip_first=3 shifts the whole plan by three steps.
    assert _steps(schedule(skip_first=3, wait=1), lambda p, i: p.records(i), 9) == [4, 6, 8]


def test_a_window_ends_at_the_last_active_step_of_its_cycle():
    plan = schedule(skip_first=2, wait=1, warmup=1, active=2, repeat=2)
    # Steps 0-1 skipped; cycles of 4 from step 2: wait 2, warmup 3, active 4-5; wait 6, warmup 7, active 8-9.
    assert [plan(i) for i in range(12)] == [SKIP, SKIP, WAIT, WARMUP, ACTIVE, ACTIVE, WAIT, WARMUP, ACTIVE, ACTIVE,
                                            DONE, DONE]
    assert _steps(plan, lambda p, i: p.records(i)) == [4, 5, 8, 9]
    assert _steps(plan, lambda p, i: p.watches(i)) == [3, 4, 5, 7, 8, 9]
    assert _steps(plan, lambda p, i: p.ends_window(i)) == [5, 9]
    assert plan.describe() == "schedule(wait=1, warmup=1, active=2, repeat=2, skip_first=2)"
    assert plan == Schedule(wait=1, warmup=1, active=2, repeat=2, skip_first=2)


def test_the_refusals_quote_the_value_and_give_the_fix():
    cases = [
        (dict(wait=-1), "schedule(wait=-1) is negative; give 0 or more steps"),
        (dict(active=0), "schedule(active=0) records nothing; give active=1 or more (the steps each window records)"),
        (dict(repeat=1.5), "schedule(repeat=...) must be an int number of steps, got 1.5"),
        (dict(skip_first=True), "schedule(skip_first=...) must be an int number of steps, got True"),
        # A long value is cut to 30 characters: 27 of its repr and an ellipsis.
        (dict(warmup="x" * 40),
         "schedule(warmup=...) must be an int number of steps, got 'xxxxxxxxxxxxxxxxxxxxxxxxxx..."),
    ]
    for kwargs, message in cases:
        with pytest.raises(InvalidArgumentError) as info:
            schedule(**kwargs)
        assert str(info.value) == message
    with pytest.raises(InvalidArgumentError, match=r"schedule\(active=0\) records nothing"):
        Schedule(active=0)  # the class built directly is checked too
