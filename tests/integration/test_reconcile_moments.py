"""reconcile(at=...) takes any moment Report.breakdown names: (step, phase, "start"|"peak"|"end"[, occurrence])."""

from __future__ import annotations

import pytest
import torch

from memprof import Category as C
from memprof.errors import InvalidArgumentError, NotMeasuredError, UnknownNameError
from memprof.demo import TinyGPT, synthetic_tokens

from training import profile_training


@pytest.fixture(scope="module")
def report():
    torch.manual_seed(0)
    model = TinyGPT(vocab=100, hidden=64, layers=2, heads=2, max_seq=32, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters())
    return profile_training(model, opt, lambda i: synthetic_tokens(4, 32, 100, seed=i), loss=TinyGPT.loss)


def test_the_end_of_forward_is_held_against_the_activation_formula(report):
    rec = report.reconcile(at=(-1, "forward", "end"))
    # The measured side is exactly what Report.breakdown reads for that moment.
    assert rec.row("activations").measured == report.breakdown(-1, "forward", "end")[C.ACTIVATIONS]
    assert rec.where == "end of forward (step 1)"
    # Inside forward the activation formula applies; in the optimizer step no graph is alive.
    assert rec.row("activations").formula > 0
    assert report.reconcile(at=(-1, "optimizer", "end")).row("activations").formula == 0


def test_nothing_is_saved_when_a_forward_begins(report):
    rec = report.reconcile(at=(1, "forward", "start"))
    assert rec.row("activations").formula == 0
    assert not any(c.name == "unexplained" and c.category.value == "activations" for c in rec.explanations)


def test_every_moment_of_a_phase_and_its_occurrence(report):
    for moment in ("start", "peak", "end"):
        rec = report.reconcile(at=(0, "backward", moment, 0))
        assert rec.row("weights").measured == report.breakdown(0, "backward", moment)[C.WEIGHTS]


@pytest.mark.parametrize("bad, error, words", [
    ((0, "forward"), InvalidArgumentError, "3 or 4 values"),
    ((9, "forward", "end"), InvalidArgumentError, "out of range"),
    ((-5, "forward", "end"), InvalidArgumentError, "out of range"),
    ((0, "fwd", "end"), UnknownNameError, "unknown phase"),
    ((0, "forward", "middle"), InvalidArgumentError, "peak, start or end"),
    ((0, "forward", "end", 3), NotMeasuredError, "occurrence 3"),
    ("middle", InvalidArgumentError, "a phase's moment"),
])
def test_a_moment_that_does_not_exist_names_the_fix(report, bad, error, words):
    with pytest.raises(error, match=words):
        report.reconcile(at=bad)
