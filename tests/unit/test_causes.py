"""Every named cause of the reconciler on hand-built traces: each function of the CAUSES table fires
with exactly the bytes its rule gives, and stays silent when its condition does not hold."""

from __future__ import annotations

import pytest

import memprof
from memprof import Category as C
from memprof.anatomy.predict import ActivationPrediction
from memprof.analyse.reconciler.causes import (CAUSES, Context, autocast_weight_copies, causes, device_rows,
                                       for_loop_step_bound, gradients_missing, korthikanti_assumptions,
                                       lazy_optimizer_state, no_formula, no_persistent_16bit_copy, per_module_rules,
                                       released_by_backward, saved_outside_the_model, outside_transformer_layers)

from factories import adamw_spec, bd, cpu, facts, linear_call, module, phase, trace

GPT = {"seq_len": 8, "batch": 2, "hidden": 16, "heads": 2, "layers": 2}


def ctx(t, measured, formula, *, rec=None, tags=None, precision="fp32", optimizer="adamw", transformer=None,
        saved=1000, without_rule=()):
    return Context(t, measured, rec, tags or {}, formula, precision, optimizer, transformer,
                   ActivationPrediction(saved, without_rule))


def _named(found):
    return {(c.category, c.name): c.bytes for c in found}


def _step(*, fwd_end_act=600, bwd_act=None, opt=True, step=0):
    """forward -> backward (-> optimizer) of one step, activations as given."""
    fwd = phase(step, "forward", start=cpu(), peak=cpu(activations=fwd_end_act), end=cpu(activations=fwd_end_act))
    bwd = phase(step, "backward", start=cpu(activations=fwd_end_act),
                peak=cpu(activations=fwd_end_act if bwd_act is None else bwd_act), end=cpu(gradients=100))
    recs = [fwd, bwd]
    if opt:
        recs.append(phase(step, "optimizer", start=cpu(gradients=100), peak=cpu(gradients=100, optimizer_states=200),
                          end=cpu(gradients=100, optimizer_states=200)))
    return recs


# ---------------------------------------------------------------------- model states


def test_no_persistent_16bit_copy_is_at_most_two_bytes_per_parameter():
    t = trace(phases=tuple(_step()), facts=facts(num_params=100))
    # HF mixed precision: 6 B/param = 600; autocast keeps fp32 weights only: 400 measured.
    found = no_persistent_16bit_copy(ctx(t, cpu(weights=400), cpu(weights=600), precision="mixed"))
    assert _named(found) == {(C.WEIGHTS, "no persistent 16-bit copy"): -200}
    # More than 2 B/param short is not this cause's to explain: it names 2 B/param, the rest stays unexplained.
    found = no_persistent_16bit_copy(ctx(t, cpu(weights=100), cpu(weights=600), precision="mixed"))
    assert _named(found) == {(C.WEIGHTS, "no persistent 16-bit copy"): -200}
    assert no_persistent_16bit_copy(ctx(t, cpu(weights=400), cpu(weights=600), precision="fp32")) == []


def test_gradients_not_allocated_before_backward_and_in_progress_during_it():
    fwd, bwd, _ = _step()
    t = trace(phases=(fwd, bwd))
    found = gradients_missing(ctx(t, cpu(gradients=0), cpu(gradients=400), rec=fwd))
    assert _named(found) == {(C.GRADIENTS, "gradients not allocated"): -400}
    found = gradients_missing(ctx(t, cpu(gradients=150), cpu(gradients=400), rec=bwd))
    assert _named(found) == {(C.GRADIENTS, "backward in progress"): -250}
    assert "only part of the gradients" in found[0].sentence
    assert gradients_missing(ctx(t, cpu(gradients=400), cpu(gradients=400), rec=bwd)) == []


def test_optimizer_state_created_lazily_before_and_during_the_first_step():
    fwd, bwd, opt = _step()
    t = trace(phases=(fwd, bwd, opt))
    found = lazy_optimizer_state(ctx(t, cpu(optimizer_states=0), cpu(optimizer_states=296), rec=bwd))
    assert _named(found) == {(C.OPTIMIZER_STATES, "state created lazily"): -296}
    found = lazy_optimizer_state(ctx(t, cpu(optimizer_states=100), cpu(optimizer_states=296), rec=opt))
    assert _named(found) == {(C.OPTIMIZER_STATES, "state created lazily"): -196}
    # A later step with less state than the formula is not "lazy": it stays unexplained.
    later = _step(step=1)
    t2 = trace(phases=(fwd, bwd, opt, *later))
    assert lazy_optimizer_state(ctx(t2, cpu(optimizer_states=100), cpu(optimizer_states=296), rec=later[2])) == []


# ---------------------------------------------------------------------- activations


def test_released_by_backward_is_what_backward_freed_of_the_forwards_saves():
    fwd, bwd, _ = _step(fwd_end_act=600, bwd_act=250)
    t = trace(phases=(fwd, bwd))
    found = released_by_backward(ctx(t, cpu(activations=250), cpu(activations=600), rec=bwd))
    assert _named(found) == {(C.ACTIVATIONS, "released by backward"): 250 - 600}
    assert released_by_backward(ctx(t, cpu(activations=250), cpu(activations=600), rec=fwd)) == []


def test_autocast_weight_copies_count_the_tagged_bytes():
    fwd, _, _ = _step()
    t = trace(phases=(fwd,))
    found = autocast_weight_copies(ctx(t, cpu(activations=900), cpu(activations=600), rec=fwd,
                                       tags={"autocast_weight_copy": 288}))
    assert _named(found) == {(C.ACTIVATIONS, "autocast weight copies"): 288}


def test_korthikantis_assumptions_each_with_its_bytes():
    fwd, _, _ = _step()
    t = trace(phases=(fwd,))
    tags = {"norm_statistics": 64, "dropout_mask_4byte": 400, "dropout_mask_2byte": 200,
            "autocast_fp32_output": 128, "attention_logsumexp": 32}
    found = _named(korthikanti_assumptions(ctx(t, cpu(activations=5000), cpu(activations=4000), rec=fwd,
                                               tags=tags, transformer=GPT)))
    assert found == {
        (C.ACTIVATIONS, "normalisation statistics"): 64,
        # a 4-byte mask is 3 bytes over the 1-byte mask assumed, a 2-byte mask 1 byte: 400*3/4 + 200/2
        (C.ACTIVATIONS, "dropout masks in the input dtype"): 300 + 100,
        (C.ACTIVATIONS, "ops autocast runs in fp32"): 64,  # half of 128: 4 bytes where 2 were assumed
        (C.ACTIVATIONS, "attention logsumexp"): 32,
    }
    flash = ctx(t, cpu(activations=5000), cpu(activations=4000), rec=fwd, tags=tags,
                transformer={**GPT, "attention": "flash"})
    assert (C.ACTIVATIONS, "attention logsumexp") not in _named(korthikanti_assumptions(flash))
    assert korthikanti_assumptions(ctx(t, cpu(activations=5000), cpu(activations=4000), rec=fwd, tags=tags)) == []


def test_outside_the_transformer_layers_is_the_forward_minus_the_repeated_blocks():
    fwd, bwd, _ = _step(fwd_end_act=1000)
    mods = (module("<model>", "GPT", activations=1000, own=0),
            module("h.0", "Block", activations=300), module("h.1", "Block", activations=300),
            module("lm_head", "Linear", activations=150))
    t = trace(phases=(fwd, bwd), modules=mods)
    found = outside_transformer_layers(ctx(t, cpu(activations=1000), cpu(activations=600), rec=fwd,
                                           transformer=GPT))
    assert _named(found) == {(C.ACTIVATIONS, "outside the transformer layers"): 1000 - 600}
    assert outside_transformer_layers(ctx(t, cpu(activations=1000), cpu(activations=600), rec=fwd)) == []


def test_per_module_rule_causes_each_with_its_sign():
    fwd, bwd, _ = _step()
    t = trace(phases=(fwd, bwd), facts=facts(activation_inputs_saved=96))
    tags = {"saved_in_container_code": 500, "saved_in_module_without_rule": 70, "saved_by_two_modules": 40,
            "saved_as_expanded_view": 30, "saved_as_view_of_larger": 20}
    found = per_module_rules(ctx(t, cpu(activations=2000), cpu(activations=1500), rec=fwd, tags=tags,
                                 without_rule=("Custom",)))
    assert _named(found) == {
        (C.ACTIVATIONS, "functional code in container modules"): 500,
        (C.ACTIVATIONS, "modules without a formula"): 70,
        (C.ACTIVATIONS, "saved by two modules"): -40,
        (C.ACTIVATIONS, "saved expanded views"): -30,
        (C.ACTIVATIONS, "saved views of larger storages"): 20,
        (C.ACTIVATIONS, "model inputs saved by modules"): -96,
    }
    assert "Custom" in next(c.sentence for c in found if c.name == "modules without a formula")
    # In backward the tags are read at the end of the forward it follows.
    in_bwd = per_module_rules(ctx(trace(phases=(phase(0, "forward", start=cpu(), peak=cpu(activations=600),
                                                      end=cpu(activations=600),
                                                      tags_end={"saved_in_container_code": 11}), bwd)),
                                  cpu(activations=500), cpu(activations=400), rec=bwd,
                                  tags={"saved_in_container_code": 999}))
    assert _named(in_bwd) == {(C.ACTIVATIONS, "functional code in container modules"): 11}
    # No per-module formula (saved bytes unknown), or Korthikanti's form instead: silent.
    assert per_module_rules(ctx(t, cpu(activations=2000), cpu(activations=1500), rec=fwd, tags=tags, saved=None)) == []
    assert per_module_rules(ctx(t, cpu(activations=2000), cpu(activations=1500), rec=fwd, tags=tags,
                                transformer=GPT)) == []


def test_saved_outside_the_model_is_the_loss_functions_saves():
    fwd, _, _ = _step()
    t = trace(phases=(fwd,))
    found = saved_outside_the_model(ctx(t, cpu(activations=700), cpu(activations=600), rec=fwd,
                                        tags={"saved_outside_modules": 100}))
    assert _named(found) == {(C.ACTIVATIONS, "saved outside the model"): 100}


def test_activation_checkpointing_names_what_regions_skip_keep_and_recompute():
    from memprof.anatomy.predict import ActivationPrediction
    from memprof.analyse.reconciler.causes import activation_checkpointing

    fwd, bwd, _ = _step(fwd_end_act=150, bwd_act=400)
    t = trace(phases=(fwd, bwd))
    # Forward end: the formula counts 1,000 bytes of saves, 900 of them by modules under checkpoint;
    # the regions keep 50 bytes of inputs instead.
    c = Context(t, cpu(activations=150), fwd, {"kept_by_checkpoint": 50}, cpu(activations=1000), "fp32", "adamw",
                None, ActivationPrediction(1000, (), (), 900))
    assert _named(activation_checkpointing(c)) == {
        (C.ACTIVATIONS, "activation checkpointing: saves not kept"): -900,
        (C.ACTIVATIONS, "activation checkpointing: region inputs"): 50}
    # In backward: the recomputed region's 300 bytes are read at this moment, not at forward's end.
    c = Context(t, cpu(activations=400), bwd, {"recomputed_for_backward": 300}, cpu(activations=1000), "fp32",
                "adamw", None, ActivationPrediction(1000, (), (), 900))
    assert _named(activation_checkpointing(c))[(C.ACTIVATIONS, "activation checkpointing: recomputed in backward")] == 300
    # No checkpointing: nothing.
    c = Context(t, cpu(activations=150), fwd, {}, cpu(activations=1000), "fp32", "adamw", None,
                ActivationPrediction(1000))
    assert activation_checkpointing(c) == []


# ---------------------------------------------------------------------- temporaries, device, the rest


def test_a_for_loop_step_below_its_bound():
    _, _, opt = _step()
    t = trace(phases=(opt,), optimizer_implementation="for-loop")
    found = for_loop_step_bound(ctx(t, cpu(temporaries=100), cpu(temporaries=300), rec=opt))
    assert _named(found) == {(C.TEMPORARIES, "for-loop step is below its bound"): -200}
    foreach = trace(phases=(opt,), optimizer_implementation="foreach")
    assert for_loop_step_bound(ctx(foreach, cpu(temporaries=100), cpu(temporaries=300), rec=opt)) == []


def test_device_rows_name_the_allocator_and_the_cuda_context():
    t = trace(device="cuda")
    measured = bd(weights=1024, allocator_overhead=2_097_152, outside_torch=500 * 2**20)
    found = _named(device_rows(ctx(t, measured, bd(weights=1024))))
    assert found == {(C.ALLOCATOR_OVERHEAD, "caching allocator"): 2_097_152,
                     (C.OUTSIDE_TORCH, "CUDA context and libraries"): 500 * 2**20}
    assert device_rows(ctx(trace(), cpu(weights=1024), cpu(weights=1024))) == []  # CPU: not measured


def test_categories_without_a_formula_count_as_measured():
    t = trace()
    measured = cpu(weights=100, inputs=48, temporaries=16)
    formula = bd(weights=100, buffers=0, gradients=0, optimizer_states=0, activations=0)  # no inputs, temporaries
    assert _named(no_formula(ctx(t, measured, formula))) == {(C.INPUTS, "no formula"): 48,
                                                             (C.TEMPORARIES, "no formula"): 16}


def test_the_table_holds_every_cause_once_and_zero_bytes_are_dropped():
    assert len(set(CAUSES)) == len(CAUSES) == 14
    fwd, _, _ = _step()
    t = trace(phases=(fwd,))
    found = causes(ctx(t, cpu(activations=600), cpu(activations=600), rec=fwd, tags={"saved_outside_modules": 0}))
    assert found == ()


# ---------------------------------------------------------------------- the whole reconciliation


def test_a_hand_built_run_reconciles_to_the_byte():
    # Linear(8, 4), batch 3, fp32 AdamW (for-loop): weights 36 params x 4 = 144, gradients 144, state
    # exp_avg + exp_avg_sq 2 x 144 + a 4-byte step counter per parameter tensor = 296; activations: the
    # per-module rule saves the input (3 x 8 x 4 = 96), which is the model's input (facts say 96).
    f = phase(0, "forward", start=cpu(weights=144, inputs=96), peak=cpu(weights=144, inputs=96, temporaries=48),
              end=cpu(weights=144, inputs=96, temporaries=48))
    b = phase(0, "backward", start=cpu(weights=144, inputs=96, temporaries=48),
              peak=cpu(weights=144, gradients=144, inputs=96, temporaries=48), end=cpu(weights=144, gradients=144,
                                                                                        inputs=96))
    o = phase(0, "optimizer", start=cpu(weights=144, gradients=144, inputs=96),
              peak=cpu(weights=144, gradients=144, optimizer_states=296, inputs=96, temporaries=144),
              end=cpu(weights=144, gradients=144, optimizer_states=296, inputs=96))
    t = trace(phases=(f, b, o), optimizer="torch.optim.adamw.AdamW", optimizer_implementation="for-loop",
              param_dtypes=("float32",),
              facts=facts(num_params=36, num_trainable=36, trainable_tensors=2, weight_bytes=144,
                          trainable_bytes=144, activation_inputs_saved=96),
              module_calls=(linear_call("<model>", 8, 4, 3),), optimizers=(adamw_spec((4, 8), (4,)),))
    rec = memprof.reconcile(t, at="steady")
    assert {r.category: r.formula for r in rec.rows if r.formula is not None} == {
        C.WEIGHTS: 144, C.BUFFERS: 0, C.GRADIENTS: 144, C.OPTIMIZER_STATES: 296, C.ACTIVATIONS: 0}
    assert rec.total.measured == 144 + 144 + 296 + 96 and rec.total.formula == 584
    assert _named(rec.explanations) == {(C.INPUTS, "no formula"): 96}
    assert all(rec.unexplained(c) in (0, None) for c in C)
    peak = memprof.reconcile(t)
    assert peak.row(C.TEMPORARIES).measured == 144 and peak.row(C.TEMPORARIES).formula is not None


@pytest.mark.parametrize("at", ["peak", "steady"])
def test_the_total_row_adds_up(at):
    fwd, bwd, opt = _step()
    t = trace(phases=(fwd, bwd, opt), facts=facts(num_params=25, num_trainable=25))
    rec = memprof.reconcile(t, at=at)
    # The explanations are the named causes plus one "unexplained" remainder per category with a gap.
    unexplained = {c.category: c.bytes for c in rec.explanations if c.name == "unexplained"}
    assert unexplained == {c: rec.unexplained(c) for c in C if rec.unexplained(c)}
    assert rec.total.formula + sum(c.bytes for c in rec.explanations) == rec.total.measured
