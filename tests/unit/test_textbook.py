"""The textbook beside the formula, on hand-built traces: which regime the literature quotes for a run, every byte
of the difference named, and the lines both tables print for it."""

from __future__ import annotations

from dataclasses import replace

import pytest

import memprof
from memprof import Category as C
from memprof.anatomy import textbook_regime
from memprof.errors import UnknownNameError
from memprof.analyse.reconciler import textbook_at
from memprof.analyse.reconciler.textbook import differences
from memprof.render.text import textbook_lines

from factories import adamw_spec, cpu, facts, linear_call, phase, trace


def _autocast_run(*, autocast="bfloat16", casts=0):
    """Linear(8, 4) under torch.autocast over fp32 parameters, AdamW: 36 parameters, 144 B of fp32 weights.
    ``casts`` is the bytes of autocast's weight casts live at the end of the forward (saved for backward)."""
    f = phase(0, "forward", start=cpu(weights=144, inputs=96), peak=cpu(weights=144, inputs=96, activations=88),
              end=cpu(weights=144, inputs=96, activations=88), tags_end={"autocast_weight_copy": casts})
    b = phase(0, "backward", start=cpu(weights=144, inputs=96, activations=88),
              peak=cpu(weights=144, gradients=144, inputs=96), end=cpu(weights=144, gradients=144, inputs=96))
    o = phase(0, "optimizer", start=cpu(weights=144, gradients=144, inputs=96),
              peak=cpu(weights=144, gradients=144, optimizer_states=296, inputs=96, temporaries=144),
              end=cpu(weights=144, gradients=144, optimizer_states=296, inputs=96))
    return trace(phases=(f, b, o), optimizer="torch.optim.adamw.AdamW", optimizer_implementation="for-loop",
                 param_dtypes=("float32",), autocast_dtype=autocast,
                 facts=facts(num_params=36, num_trainable=36, trainable_tensors=2, weight_bytes=144,
                             trainable_bytes=144),
                 module_calls=(linear_call("<model>", 8, 4, 3),), optimizers=(adamw_spec((4, 8), (4,)),))


def test_the_literature_quotes_hf_mixed_precision_for_an_autocast_run_and_the_regime_itself_otherwise():
    assert textbook_regime("amp") == "mixed"
    assert [textbook_regime(p) for p in ("fp32", "mixed", "bf16", "fp16", "zero")] == \
        ["fp32", "mixed", "bf16", "fp16", "zero"]
    with pytest.raises(UnknownNameError, match="unknown precision 'fp8'; use one of"):
        textbook_regime("fp8")


@pytest.mark.parametrize("at", ["peak", "steady", (0, "forward", "end")])
def test_an_autocast_run_names_the_two_bytes_per_parameter_of_the_textbook_copy(at):
    tb = textbook_at(_autocast_run(), at)
    assert (tb.regime, tb.formula_regime, tb.bytes_per_param, tb.formula_bytes_per_param) == ("mixed", "amp", 18, 16)
    # fp32 weights 4 x 36 = 144 B; HF's mixed precision adds a 16-bit copy, 2 x 36 = 72 B.
    assert (tb.formula[C.WEIGHTS], tb.breakdown[C.WEIGHTS]) == (144, 216)
    assert [(c.category, c.name, c.bytes) for c in tb.causes] == [(C.WEIGHTS, "no persistent 16-bit copy", -72)]
    # Gradients 144 and AdamW's 2 x 144 + two 4-byte steps = 296 are the same on both sides.
    assert (tb.formula_model_states, tb.model_states) == (144 + 144 + 296, 216 + 144 + 296)


def test_the_cause_says_how_many_bytes_of_casts_are_live_at_the_moment():
    run = _autocast_run(casts=64)  # the 4 x 8 weight cast to bf16: 32 x 2 = 64 B, saved for backward
    at_end = textbook_at(run, (0, "forward", "end")).causes[0].sentence
    assert at_end.endswith("; 64 B of such casts are live at this moment")
    assert textbook_at(run, (0, "optimizer", "end")).causes[0].sentence.endswith(
        "; none of those casts is live at this moment")


def test_a_run_in_the_textbook_regime_has_no_difference_to_name():
    fp32 = _autocast_run(autocast=None)
    tb = textbook_at(fp32)
    assert (tb.regime, tb.formula_regime, tb.causes, tb.differs) == ("fp32", "fp32", (), False)
    assert tb.breakdown == tb.formula
    assert textbook_lines(tb) == ["  (textbook model states: 16 bytes/param)"]
    # Asking for HF's regime on an autocast run makes the formula the textbook: the difference is then the
    # measured weights' gap, named by the reconciliation's cause of the same name.
    mixed = memprof.reconcile(_autocast_run(), precision="mixed", at="steady")
    assert (mixed.textbook.causes, mixed.textbook.bytes_per_param, mixed.textbook.formula_bytes_per_param) == ((), 18, 18)
    assert [(c.name, c.bytes) for c in mixed.causes if c.category is C.WEIGHTS] == \
        [("no persistent 16-bit copy", -72)]


def test_a_difference_no_cause_names_is_unexplained_not_dropped():
    formula, book = cpu(weights=144, gradients=144), cpu(weights=216, gradients=72)
    found = differences(formula, book, "fp16", "zero")  # a pair without causes in the table
    assert [(c.category, c.name, c.bytes) for c in found] == [(C.WEIGHTS, "unexplained", -72),
                                                               (C.GRADIENTS, "unexplained", 72)]


def test_the_textbook_lines_give_both_figures_and_the_cause_in_exact_bytes():
    lines = textbook_lines(textbook_at(_autocast_run(), "steady"))
    assert lines[:2] == [
        "  textbook model states: 18 bytes/param = 6 weights + 4 gradients + 8 optimizer states (mixed: HF's mixed "
        "precision, fp32 weights and a 16-bit copy), 656 B",
        "  formula model states: 16 bytes/param = 4 weights + 4 gradients + 8 optimizer states (amp: torch.autocast "
        "over fp32 parameters), 584 B"]
    assert lines[2].startswith("    weights          -72 B (72 B)  no persistent 16-bit copy: HF's mixed precision")
    assert len(lines) == 3


def test_an_optimizer_without_a_bytes_per_param_row_gives_no_figure_rather_than_one_without_its_states():
    # An optimizer class the bytes/param table does not know: its states per parameter are unknown. Counting
    # weights and gradients alone (4 + 4 = 8 in fp32) would print a textbook figure with the states left out.
    fp32 = _autocast_run(autocast=None)
    custom = memprof.reconcile(replace(fp32, optimizer="mypkg.optim.Shampoo"))
    assert (custom.textbook.bytes_per_param, custom.textbook.formula_bytes_per_param) == (None, None)
    assert "textbook model states" not in str(custom)
    # Under autocast the weights' difference is still known to the byte, and still named.
    amp = _autocast_run()
    lines = textbook_lines(textbook_at(replace(amp, optimizer="mypkg.optim.Shampoo"), "steady"))
    # The states come from the recorded optimizer's tensors (2 x 144 + 8 = 296): 216 + 144 + 296 = 656 B.
    assert lines[0] == "  textbook model states (mixed: HF's mixed precision, fp32 weights and a 16-bit copy), 656 B"
    assert lines[2].startswith("    weights          -72 B (72 B)  no persistent 16-bit copy")
