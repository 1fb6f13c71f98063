"""Renderers on hand-built records, compared with their whole expected output (trailing blanks aside):
what a user reads when a figure was not measured, when a path is long, when a formula is an upper bound."""

from __future__ import annotations

import textwrap

import memprof
from memprof.render.text import reconciliation_text, report_text

from factories import adamw_spec, bd, cpu, facts, full_trace, linear_call, module, phase, trace


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()]


def _expected(text: str) -> list[str]:
    return _lines(textwrap.dedent(text).strip("\n"))


def _light_trace():
    def light(**kw):  # light mode on CPU: temporaries and the total are not measured
        return bd(None, **{"weights": 0, "buffers": 0, "gradients": 0, "optimizer_states": 0, "activations": 0,
                           "inputs": 0, **kw})

    f = phase(0, "forward", start=light(weights=4096), peak=light(weights=4096, activations=2048),
              end=light(weights=4096, activations=2048))
    return trace(mode="light", phases=(f,), modules=(
        module("<model>", "Net", parameters=4096, activations=None, gradients=None),
        module("encoder.layers.11.attention.output.dense", "Linear", parameters=4096, activations=None,
               gradients=None)), notes=("light mode on CPU: temporaries are not measured",))


def test_the_report_says_not_measured_and_clips_long_paths_in_the_middle():
    # A forward only: no backward column; the saved bytes were not measured, which is not "none saved".
    assert _lines(report_text(_light_trace())) == _expected("""
    memprof report: 1 step(s), mode light, device cpu, torch 2.13.0

    Peak not measured (categories at the highest measured level, step 0, forward)
      weights                    4.0 KiB
      buffers                        0 B
      gradients                      0 B
      optimizer_states               0 B
      activations                2.0 KiB
      inputs                         0 B
      temporaries           not measured
      allocator_overhead    not measured  (no accelerator allocator)
      outside_torch         not measured  (no accelerator driver)
      total                 not measured

    Phases (bytes at the peak of each phase)
      step  phase                start          peak           end   largest at peak
         0  forward       not measured  not measured  not measured   weights 4.0 KiB

    Top modules by saved activations
      module                        type                     params     saved act      peak fwd
      encoder.layers.11…dense       Linear                  4.0 KiB  not measured  not measured

    Notes
      - light mode on CPU: temporaries are not measured
    """)


def _linear_adamw_run():
    # Linear(8, 4), batch 3, fp32 AdamW (for-loop): 144 B of weights, 144 of gradients, 296 of state.
    f = phase(0, "forward", start=cpu(weights=144, inputs=96), peak=cpu(weights=144, inputs=96, temporaries=48),
              end=cpu(weights=144, inputs=96, temporaries=48))
    b = phase(0, "backward", start=cpu(weights=144, inputs=96, temporaries=48),
              peak=cpu(weights=144, gradients=144, inputs=96, temporaries=48),
              end=cpu(weights=144, gradients=144, inputs=96))
    o = phase(0, "optimizer", start=cpu(weights=144, gradients=144, inputs=96),
              peak=cpu(weights=144, gradients=144, optimizer_states=296, inputs=96, temporaries=144),
              end=cpu(weights=144, gradients=144, optimizer_states=296, inputs=96))
    return trace(phases=(f, b, o), optimizer="torch.optim.adamw.AdamW", optimizer_implementation="for-loop",
                 param_dtypes=("float32",),
                 facts=facts(num_params=36, num_trainable=36, trainable_tensors=2, weight_bytes=144,
                             trainable_bytes=144, activation_inputs_saved=96),
                 module_calls=(linear_call("<model>", 8, 4, 3),), optimizers=(adamw_spec((4, 8), (4,)),))


def test_the_reconciliation_names_each_gap_and_gives_levers():
    # The for-loop step's bound is 3 x the largest parameter (the 4 x 8 fp32 weight, 128 B) = 384 B.
    assert _lines(reconciliation_text(memprof.reconcile(_linear_adamw_run()))) == _expected("""
    memprof reconciliation at the peak (step 0, optimizer) (fp32, adamw)
      category                   formula      measured          gap    gap %
      weights                      144 B         144 B          0 B    +0.0%
      buffers                        0 B           0 B          0 B
      gradients                    144 B         144 B          0 B    +0.0%
      optimizer_states             296 B         296 B          0 B    +0.0%
      activations                    0 B           0 B          0 B
      inputs                  no formula          96 B
      temporaries                  384 B         144 B       -240 B   -62.5%
      total                        968 B         824 B       -144 B   -14.9%
      (textbook model states: 16 bytes/param)

    Why the measurement differs
      temporaries      -      240 B  for-loop step is below its bound: the for-loop step's formula is an upper bound (a few times the largest parameter); this step needed less
      inputs           +       96 B  no formula: the batch and targets handed to the model and the loss; the textbook's model-state and activation formulas leave them out

    Advice
      - largest category: optimizer_states, 296 B (36% of the total)
      - fused=True in the optimizer removes the for-loop step's temporaries (384 B predicted)
      - bf16 parameters (weights, gradients and torch optimizer state at 2 B/element): saves about 292 B
      - ZeRO stage 1 over 8 ranks shards optimizer state: saves 259 B per rank
      - 8-bit AdamW (bitsandbytes) keeps 2 B/param of optimizer state instead of 8.2: saves about 224 B
    """)


def test_the_report_is_at_most_80_lines_whatever_the_run_holds():
    from memprof import Phase
    from memprof.record.stats import STAT_KEYS, PhaseStats, Stat

    kinds = ["forward", "backward", "other", "optimizer"]
    phases = tuple(phase(s, kinds[k % 4], occurrence=k // 4, start=cpu(weights=10), peak=cpu(weights=10 + k),
                         end=cpu(weights=10)) for s in range(100) for k in range(12))
    stats = tuple(PhaseStats(Phase.FORWARD, occ, 1000, tuple((key, Stat(1, 2, 3)) for key in STAT_KEYS),
                             tuple((key, Stat(1, 2, 3)) for key in STAT_KEYS)) for occ in range(30))
    mods = tuple(module(f"layers.{i}.sub", "Linear", parameters=64, activations=i) for i in range(500))
    t = trace(phases=phases, modules=mods, notes=tuple(f"note {i}\nwith a second line" for i in range(30)),
              error="RuntimeError: out of memory\nat line 2", live_at_error=cpu(weights=10, temporaries=5),
              live_modules_at_error=tuple((f"m{i}", i) for i in range(20)), num_steps=10_000, phase_stats=stats,
              schedule="schedule(wait=0, warmup=0, active=1, repeat=0, skip_first=0)",
              recorded_steps=tuple((i, i) for i in range(0, 200, 2)))
    lines = report_text(t).splitlines()
    assert len(lines) <= 80, len(lines)
    assert "... 24 more in report.trace.notes" in lines[-1]


def test_the_peak_header_names_the_occurrence_and_the_module_as_the_tables_do():
    # Gradient accumulation: the second micro-batch's backward (backward #1) holds the run's peak,
    # 100 + 100 + 400 = 600 B, inside the ReLU at path "1" of an nn.Sequential.
    f0 = phase(1, "forward", start=cpu(weights=100), peak=cpu(weights=100, activations=300),
               end=cpu(weights=100, activations=300))
    b0 = phase(1, "backward", start=cpu(weights=100, activations=300),
               peak=cpu(weights=100, gradients=100, activations=300), end=cpu(weights=100, gradients=100))
    f1 = phase(1, "forward", occurrence=1, start=cpu(weights=100, gradients=100),
               peak=cpu(weights=100, gradients=100, activations=300), end=cpu(weights=100, gradients=100, activations=300))
    b1 = phase(1, "backward", occurrence=1, start=cpu(weights=100, gradients=100, activations=300),
               peak=cpu(weights=100, gradients=100, activations=300, temporaries=100),
               end=cpu(weights=100, gradients=100))
    t = trace(phases=(f0, b0, f1, b1), peak_module="1",
              modules=(module("<model>", "Sequential", parameters=100), module("0", "Linear", parameters=100),
                       module("1", "ReLU", activations=300)))
    assert t.peak_record() is t.phases[3] and t.peak.total == 600
    lines = _lines(report_text(t))
    assert lines[2] == "Peak 600 B (step 1, backward #1, in 1 (ReLU))"
    assert lines[19] == "     1  backward #1          500 B         600 B         200 B   activations 300 B"
    # A module the record does not list is named by its path alone.
    assert _lines(report_text(trace(phases=(f0,), peak_module="x")))[2] == "Peak 400 B (step 1, forward, in x)"


def test_a_run_without_backward_ranks_modules_by_their_forward_peak():
    # Inference: nothing saved for a backward, none ran. The table leaves out the saved bytes (all 0 B)
    # and the backward peaks (none), and says why.
    f = phase(0, "forward", start=cpu(weights=2704), peak=cpu(weights=2704, temporaries=1024), end=cpu(weights=2704))
    t = trace(phases=(f,), modules=(
        module("<model>", "Sequential", parameters=2704, activations=0, gradients=None, peak_forward=2048),
        module("0", "Linear", parameters=2176, activations=0, gradients=None, peak_forward=1024),
        module("1", "ReLU", activations=0, gradients=None, peak_forward=1024),
        module("2", "Linear", parameters=528, activations=0, gradients=None, peak_forward=128)))
    text = report_text(t)
    assert _lines(text)[-5:] == _expected("""
    Top modules by peak forward (no backward ran: nothing was saved for one)
      module                        type                     params      peak fwd
      0                             Linear                  2.1 KiB       1.0 KiB
      1                             ReLU                        0 B       1.0 KiB
      2                             Linear                    528 B         128 B
    """)
    html = memprof.Report(t)._repr_html_()
    assert "Top modules by peak forward" in html and "saved act" not in html and "peak bwd" not in html
    # A forward under autograd whose backward never came still saved tensors: they are shown.
    saved = trace(phases=(f,), modules=(module("0", "Linear", parameters=2176, activations=512, peak_forward=1024),))
    assert _lines(report_text(saved))[-3:] == _expected("""
    Top modules by saved activations
      module                        type                     params     saved act      peak fwd
      0                             Linear                  2.1 KiB         512 B       1.0 KiB
    """)


def test_a_run_of_five_steps_kept_one_shows_its_statistics_and_notes_on_one_line():
    # full_trace: the optimizer's peak, 144 + 144 + 296 + 144 = 728 B (296 / 728 = 40.7 %); five steps ran,
    # step 0 is kept in full, and the forward's statistics cover all five (its total was not summarised).
    assert _lines(report_text(full_trace())) == _expected("""
    memprof report: 5 step(s), mode exact, device cpu, torch 2.13.0

    Peak 728 B (step 0, optimizer)
      weights                      144 B   19.8%
      buffers                        0 B    0.0%
      gradients                    144 B   19.8%
      optimizer_states             296 B   40.7%
      activations                    0 B    0.0%
      inputs                         0 B    0.0%
      temporaries                  144 B   19.8%
      allocator_overhead    not measured  (no accelerator allocator)
      outside_torch         not measured  (no accelerator driver)
      total                        728 B

    Phases of steps 0 of 5 (bytes at each phase's peak)
      step  phase                start          peak           end   largest at peak
         0  forward              144 B         288 B         240 B   weights 144 B
         0  backward             240 B         336 B         288 B   weights 144 B
         0  optimizer            288 B         728 B         584 B   optimizer_states 296 B

    All 5 steps per phase (total at each phase's peak)
      phase              count           min        median           max
      forward                5  not measured  not measured  not measured

    Top modules by saved activations
      module                        type                     params     saved act      peak fwd      peak bwd
      fc                            Linear                    144 B          96 B         288 B         432 B

    Notes
      - a note with é and a newline in it
    """)
