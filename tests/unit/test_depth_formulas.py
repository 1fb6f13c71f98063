"""The formulas of an estimate extended in depth: the cuts' extended in a line and held in the trace's facts, which
the predictions read before the records (the cut model's module calls and optimizers)."""

from __future__ import annotations

import dataclasses

from memprof.anatomy.predict import predict_activations, predict_optimizers
from memprof.record.estimate import Estimate
from memprof.simulate.depth_formulas import extended_formulas as _formulas

from factories import adamw_spec, facts, linear_call, trace

# One Linear(8 -> 16) over a batch of 4, fp32: its rule saves its input, 4 x 8 x 4 = 128 B.
CALL = linear_call("fc", 8, 16, 4)
# AdamW over a 16 x 8 weight: exp_avg and exp_avg_sq, 2 x 128 x 4 = 1,024 B, and its fp32 step counter, 4 B.
ADAMW = adamw_spec((16, 8))


def _recorded(**values: object):
    return trace(module_calls=(CALL,), optimizers=(ADAMW,), facts=facts(**values))


def test_the_records_give_the_formulas_where_the_facts_hold_none():
    t = _recorded()
    assert predict_activations(t).saved_bytes == 128
    assert predict_optimizers(t).state_bytes == 1_028


def test_the_facts_formulas_come_before_the_records():
    # An extended estimate's records are the cut model's: the facts hold the whole model's sums.
    t = _recorded(activation_formula=5_000, activation_checkpointed_formula=1_000, optimizer_state_formula=9_000,
                  optimizer_transient_formula=700)
    acts, opts = predict_activations(t), predict_optimizers(t)
    assert (acts.saved_bytes, acts.checkpointed_bytes) == (5_000, 1_000)
    assert (opts.state_bytes, opts.transient_bytes) == (9_000, 700)


def _cuts(*saved: int, states: "tuple[int | None, ...]" = (1_028, 2_052, 3_076)) -> "list[Estimate]":
    # Traces without records (the facts path), each cut's formulas given: 1,024 B of states a block more.
    return [Estimate(trace(facts=facts(activation_formula=a, activation_checkpointed_formula=0,
                                       optimizer_state_formula=s, optimizer_transient_formula=256)),
                     "fp32", "cpu") for a, s in zip(saved, states)]


def test_formulas_that_grow_alike_are_extended_in_a_line():
    cuts = _cuts(300, 400, 500)
    # Extended by 3 blocks: 500 + 3 x 100 = 800 B; states 3,076 + 3 x 1,024 = 6,148 B; temporaries 256 B.
    out, note = _formulas(_extended(cuts[2]), cuts, 3)
    f = out.trace.facts
    assert note is None
    assert (f.activation_formula, f.activation_checkpointed_formula) == (800, 0)
    assert (f.optimizer_state_formula, f.optimizer_transient_formula) == (6_148, 256)
    assert out.trace.module_calls == (CALL,) and out.trace.optimizers == (ADAMW,)  # the per-layer checks read them


def test_a_formula_that_does_not_grow_alike_is_none_and_its_records_are_dropped():
    cuts = _cuts(300, 400, 520, states=(1_028, 2_052, 3_000))
    out, note = _formulas(_extended(cuts[2]), cuts, 3)
    f = out.trace.facts
    assert note is not None and "the per-module rules' activations" in note and "the optimizer's states" in note
    # None: no formula (unknown), never the cut's; the records that would give the cut's are gone.
    assert f.activation_formula is None and f.optimizer_state_formula is None
    assert out.trace.module_calls == () and out.trace.optimizers == ()
    assert predict_activations(out.trace).saved_bytes is None
    assert predict_optimizers(out.trace).state_bytes is None


def test_a_formula_no_cut_has_stays_none_without_a_note():
    cuts = _cuts(300, 400, 500, states=(None, None, None))
    out, note = _formulas(_extended(cuts[2]), cuts, 3)
    assert note is None and out.trace.facts.optimizer_state_formula is None


def _extended(cut: Estimate) -> Estimate:
    """The line-extended estimate as depth.extrapolated hands it over: the last cut's records."""
    return dataclasses.replace(cut, trace=dataclasses.replace(cut.trace, module_calls=(CALL,), optimizers=(ADAMW,)))
