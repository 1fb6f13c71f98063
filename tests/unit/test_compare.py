"""diff() (memprof.analyse.compare) and its text (memprof.render.text.diff_text) on hand-built traces:
every row and delta, the phases matched by (step, phase, occurrence), those found in one run only,
the notes, and the whole text a user reads."""

from __future__ import annotations

import textwrap

import pytest

from memprof import Category, Phase
from memprof.analyse.compare import CategoryDelta, PhaseDelta, diff
from memprof.errors import InvalidArgumentError
from memprof.render.text import diff_text

from factories import bd, cpu, phase, trace


def _a():
    """Batch 8: 4 KiB of weights; the backward holds the peak, 4096 + 4096 gradients + 1024 + 512 = 9,728 B."""
    f = phase(0, "forward", start=cpu(weights=4096),
              peak=cpu(weights=4096, activations=2048, inputs=512, temporaries=256),  # 6,912 B
              end=cpu(weights=4096, activations=2048, inputs=512))
    b = phase(0, "backward", start=cpu(weights=4096, activations=2048, inputs=512),
              peak=cpu(weights=4096, gradients=4096, activations=1024, inputs=512),  # 9,728 B
              end=cpu(weights=4096, gradients=4096, inputs=512))
    o = phase(0, "other", start=cpu(weights=4096, gradients=4096, inputs=512),
              peak=cpu(weights=4096, gradients=4096, inputs=512), end=cpu(weights=4096, inputs=512))
    return trace(phases=(f, b, o), num_steps=1)


def _b():
    """Batch 16 with a second micro-batch and an optimizer step: 8 KiB of state born in it; the optimizer
    holds the peak, 4096 + 4096 + 8192 + 1024 = 17,408 B."""
    f = phase(0, "forward", start=cpu(weights=4096), peak=cpu(weights=4096, activations=4096, inputs=1024),  # 9,216
              end=cpu(weights=4096, activations=4096, inputs=1024))
    b = phase(0, "backward", start=cpu(weights=4096, activations=4096, inputs=1024),
              peak=cpu(weights=4096, gradients=4096, activations=2048, inputs=1024),  # 11,264 B
              end=cpu(weights=4096, gradients=4096, inputs=1024))
    f1 = phase(0, "forward", occurrence=1, start=cpu(weights=4096, gradients=4096, inputs=1024),
               peak=cpu(weights=4096, gradients=4096, activations=4096, inputs=1024),
               end=cpu(weights=4096, gradients=4096, activations=4096, inputs=1024))
    o = phase(0, "optimizer", start=cpu(weights=4096, gradients=4096, inputs=1024),
              peak=cpu(weights=4096, gradients=4096, optimizer_states=8192, inputs=1024),
              end=cpu(weights=4096, gradients=4096, optimizer_states=8192, inputs=1024))
    return trace(phases=(f, b, f1, o), num_steps=1)


def test_every_category_at_the_peaks_with_its_delta_b_minus_a():
    d = diff(_a(), _b())
    assert d.at == "peak" and d.labels == ("a", "b") and d.notes == ()
    C = Category
    assert d.categories == (
        CategoryDelta(C.WEIGHTS, 4096, 4096, 0, 0.0),
        CategoryDelta(C.BUFFERS, 0, 0, 0, 0.0),
        CategoryDelta(C.GRADIENTS, 4096, 4096, 0, 0.0),
        CategoryDelta(C.OPTIMIZER_STATES, 0, 8192, 8192, None),  # from nothing: no finite percentage
        CategoryDelta(C.ACTIVATIONS, 1024, 0, -1024, -100.0),
        CategoryDelta(C.INPUTS, 512, 1024, 512, 100.0),
        CategoryDelta(C.KV_CACHE, None, None, None, None),  # not measured in either: no delta, never 0
        CategoryDelta(C.COMMUNICATION, None, None, None, None),
        CategoryDelta(C.TEMPORARIES, 0, 0, 0, 0.0),
        CategoryDelta(C.ALLOCATOR_OVERHEAD, None, None, None, None),
        CategoryDelta(C.OUTSIDE_TORCH, None, None, None, None),
    )
    # 17,408 - 9,728 = 7,680 B; 7,680 / 9,728 = 78.947... %
    assert d.total == CategoryDelta(None, 9728, 17408, 7680, pytest.approx(100 * 7680 / 9728))
    assert d["total"] is d.total and d["inputs"] is d.categories[5] and d[C.INPUTS].name == "inputs"
    assert d.grew() == [(C.OPTIMIZER_STATES, 8192), (C.INPUTS, 512)]
    assert d.shrank() == [(C.ACTIVATIONS, -1024)]
    assert d.grew("4 KiB") == [(C.OPTIMIZER_STATES, 8192)]  # more than 4,096 bytes
    assert d.grew(512) == [(C.OPTIMIZER_STATES, 8192)]  # strictly more than the tolerance: 512 is not
    # rel=1.5: more than 1.5 x a's figure; inputs grew by 100 % of 512, state from 0.
    assert d.grew(rel=1.5) == [(C.OPTIMIZER_STATES, 8192)]
    assert not d.unchanged


def test_phases_are_matched_by_step_phase_and_occurrence_and_the_rest_named():
    d = diff(_a(), _b())
    F, B = Phase.FORWARD, Phase.BACKWARD
    # forward 6,912 -> 9,216 (+2,304, +33.3 %); backward 9,728 -> 11,264 (+1,536, +15.8 %).
    assert d.phases == (PhaseDelta(0, F, 0, 6912, 9216, 2304, pytest.approx(100 * 2304 / 6912)),
                        PhaseDelta(0, B, 0, 9728, 11264, 1536, pytest.approx(100 * 1536 / 9728)))
    assert d.only_in_a == ((0, Phase.OTHER, 0),)
    assert d.only_in_b == ((0, F, 1), (0, Phase.OPTIMIZER, 0))


def test_the_text_shows_every_row_and_the_unmatched_phases():
    # 6,912 B = 6.75 KiB and 2,304 B = 2.25 KiB are shown to one decimal, rounded half to even.
    assert diff_text(diff(_a(), _b())) == textwrap.dedent("""\
        memprof diff: a -> b (breakdown at the peak)
          category                         a             b         delta        %
          weights                    4.0 KiB       4.0 KiB           0 B     0.0%  same
          buffers                        0 B           0 B           0 B     0.0%  same
          gradients                  4.0 KiB       4.0 KiB           0 B     0.0%  same
          optimizer_states               0 B       8.0 KiB      +8.0 KiB      new  grew
          activations                1.0 KiB           0 B      -1.0 KiB  -100.0%  shrank
          inputs                       512 B       1.0 KiB        +512 B  +100.0%  grew
          kv_cache              not measured  not measured
          communication         not measured  not measured
          temporaries                    0 B           0 B           0 B     0.0%  same
          allocator_overhead    not measured  not measured
          outside_torch         not measured  not measured
          -----------------------------------------------------------------------
          total                      9.5 KiB      17.0 KiB      +7.5 KiB   +78.9%  grew

        Phases (peak total of each phase, matched by step, phase and occurrence)
          step  phase                    a             b         delta        %
             0  forward            6.8 KiB       9.0 KiB      +2.2 KiB   +33.3%  grew
             0  backward           9.5 KiB      11.0 KiB      +1.5 KiB   +15.8%  grew
        Only in a: step 0 other
        Only in b: step 0 forward #1, step 0 optimizer""")


def test_a_long_list_of_phases_is_cut_with_a_count():
    lines = diff_text(diff(_a(), _b()), max_phases=1).splitlines()
    assert lines[-4:] == ["     0  forward            6.8 KiB       9.0 KiB      +2.2 KiB   +33.3%  grew",
                          "  … 1 more (diff.phases_frame() has all)",
                          "Only in a: step 0 other",
                          "Only in b: step 0 forward #1, step 0 optimizer"]


def _light_gpu_run_that_failed():
    def light(**kw):  # light mode: temporaries and the total not measured
        return bd(None, **{"weights": 0, "buffers": 0, "gradients": 0, "optimizer_states": 0, "activations": 0,
                           "inputs": 0, **kw})

    f = phase(0, "forward", start=light(weights=4096), peak=light(weights=4096, activations=2048, inputs=512),
              end=light(weights=4096, activations=2048, inputs=512))
    return trace(mode="light", phases=(f,), num_steps=1, device="cuda", error="RuntimeError('boom')",
                 torch_version="2.12.0")


def test_runs_measured_differently_compare_what_both_measured_and_say_why():
    d = diff(_a(), _light_gpu_run_that_failed(), at="end", labels=("cpu", "gpu"))
    assert d.at == "end"
    # a's end: 4096 weights + 512 inputs = 4,608 B; b's total was not measured: no delta, never 0.
    assert d.total == CategoryDelta(None, 4608, None, None, None)
    assert d[Category.TEMPORARIES] == CategoryDelta(Category.TEMPORARIES, 0, None, None, None)
    assert d[Category.ACTIVATIONS] == CategoryDelta(Category.ACTIVATIONS, 0, 2048, 2048, None)
    assert d.phases == (PhaseDelta(0, Phase.FORWARD, 0, 6912, None, None, None),)
    assert d.grew() == [(Category.ACTIVATIONS, 2048)]
    assert diff_text(d) == textwrap.dedent("""\
        memprof diff: cpu -> gpu (breakdown at the end)
          category                       cpu           gpu         delta        %
          weights                    4.0 KiB       4.0 KiB           0 B     0.0%  same
          buffers                        0 B           0 B           0 B     0.0%  same
          gradients                      0 B           0 B           0 B     0.0%  same
          optimizer_states               0 B           0 B           0 B     0.0%  same
          activations                    0 B       2.0 KiB      +2.0 KiB      new  grew
          inputs                       512 B         512 B           0 B     0.0%  same
          kv_cache              not measured  not measured
          communication         not measured  not measured
          temporaries                    0 B  not measured
          allocator_overhead    not measured  not measured
          outside_torch         not measured  not measured
          -----------------------------------------------------------------------
          total                      4.5 KiB  not measured

        Phases (peak total of each phase, matched by step, phase and occurrence)
          step  phase                  cpu           gpu         delta        %
             0  forward            6.8 KiB  not measured
        Only in cpu: step 0 backward, step 0 other

        Notes
          - cpu was measured in exact mode and gpu in light mode; categories such as temporaries are measured differently
          - cpu ran on cpu (cpu) and gpu on cuda (cuda); allocator figures are not comparable
          - torch versions differ (2.13.0 vs 2.12.0); saved tensors and temporaries can change between versions
          - gpu ended with an error (RuntimeError('boom')); its figures are partial""")


def test_a_run_against_itself_is_unchanged():
    d = diff(_a(), _a())
    assert d.unchanged and d.grew() == [] and d.shrank() == []
    assert d.total == CategoryDelta(None, 9728, 9728, 0, 0.0)
    assert "grew" not in diff_text(d) and "shrank" not in diff_text(d)


def test_bad_arguments_name_what_diff_takes():
    cases = [(lambda: diff(_a(), _b(), at="middle"), "at must be peak, start or end (one of peak, start, end), got 'middle'"),
             (lambda: diff(_a(), _b(), labels=("a",)), "labels must be a tuple of two strings, got ('a',)"),
             (lambda: diff(_a(), 3), "diff() compares memprof Reports, Traces or saved trace files; b is a int"),
             (lambda: diff(_a(), _b()).grew(tolerance=-1),
              "tolerance must be bytes >= 0 (a number or a size like '1 MiB'), got -1")]
    for call, message in cases:
        with pytest.raises(InvalidArgumentError) as info:
            call()
        assert str(info.value) == message
