"""How the carry collector folds each optimizer phase's kind into spans of steps, and the one note it writes."""

from __future__ import annotations

from memprof.collect.carry_spans import CARRIED, MEASURED, NOT_MEASURED, PARTLY, StepSpans


def _spans(*phases):
    spans = StepSpans()  # the carry collector's span bookkeeping, alone
    for step, kind in phases:
        spans.add(step, kind)
    return spans


def test_one_optimizer_makes_one_span_per_run_of_a_kind():
    c = _spans((0, MEASURED), (1, MEASURED), (2, CARRIED), (3, CARRIED), (4, MEASURED), (5, CARRIED))
    assert c.record() == ((0, 1, MEASURED), (2, 3, CARRIED), (4, 4, MEASURED), (5, 5, CARRIED))
    assert c.notes()[0].startswith("optimizer step measured at steps 0-1 and 4, carried at steps 2-3 and 5:")


def test_two_optimizers_one_measured_one_carried_make_the_step_partly_carried():
    c = _spans((0, MEASURED), (0, MEASURED), (1, CARRIED), (1, MEASURED), (2, CARRIED), (2, MEASURED),
               (3, CARRIED), (3, CARRIED))
    assert c.record() == ((0, 0, MEASURED), (1, 2, PARTLY), (3, 3, CARRIED))


def test_a_step_not_measured_stays_so_whatever_else_ran_in_it():
    c = _spans((0, CARRIED), (1, NOT_MEASURED), (1, MEASURED), (2, CARRIED))
    assert c.record() == ((0, 0, CARRIED), (1, 1, NOT_MEASURED), (2, 2, CARRIED))


def test_nothing_carried_says_nothing():
    assert _spans((0, MEASURED), (1, MEASURED)).notes() == []
