"""``estimate(..., loop=...)``: a framework's own training step by name (:mod:`memprof.simulate.loops`), simulated
on the shape-only twins, against the same step run for real under ``memprof.profile`` on CPU: every category at the
start, peak and end of every phase of both steps agrees to the byte. Plus the loops that are refused, the HF
Trainer's being the code of the installed transformers, and ``estimate_hf``'s default loop and notes."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import memprof  # noqa: E402
from memprof import Category as C  # noqa: E402
from memprof.errors import InvalidArgumentError, MissingExtraError, UnknownNameError  # noqa: E402
from memprof.simulate.loops import loop_step  # noqa: E402
from phases import assert_equal_everywhere  # noqa: E402

# Eager attention: the causal mask is built in both runs (SDPA skips it when the values allow, which a shape-only
# simulation cannot see).
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64)
CONFIG = transformers.LlamaConfig(attn_implementation="eager", **TINY)
IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
BATCH = {"input_ids": IDS, "labels": IDS}


def build():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(CONFIG).train()


def adamw(params):
    return torch.optim.AdamW(params, foreach=True)


def measured(step, steps: int = 2):
    """The loop's step run for real as a loop runs it: its result held until the next call returns."""
    model = build()
    opt = adamw(model.parameters())
    with memprof.profile(model, opt) as prof:
        out = None
        for _ in range(steps):
            out = step(model, opt, BATCH)
        del out
    return prof.report()


def simulated(steps: int = 2, **options):
    return memprof.estimate(build(), adamw, inputs=BATCH, device="cpu", steps=steps, **options)


@pytest.mark.parametrize("loop", ["hf-trainer", "accelerate"])
def test_each_named_loop_is_simulated_to_the_byte(loop):
    est, rep = simulated(loop=loop), measured(loop_step(loop))
    assert [(p.step, p.phase, p.occurrence, p.start, p.peak, p.end) for p in est.trace.phases] == \
        [(p.step, p.phase, p.occurrence, p.start, p.peak, p.end) for p in rep.trace.phases]
    assert_equal_everywhere(est, rep)


@pytest.mark.parametrize("loop", ["hf-trainer", "accelerate"])
def test_accumulation_and_clipping_of_a_named_loop_are_simulated_to_the_byte(loop):
    # Two micro-batches per optimizer step: two forward and backward phases in each step; no clipping: the
    # gradient norm's foreach temporaries are gone.
    for kwargs in ({"gradient_accumulation_steps": 2}, {"max_grad_norm": 0.0}):
        est = simulated(train_step=loop_step(loop, **kwargs))
        rep = measured(loop_step(loop, **kwargs))
        assert_equal_everywhere(est, rep)
        if "gradient_accumulation_steps" in kwargs:
            assert sum(p.phase.value == "forward" and p.step == 1 for p in est.trace.phases) == 2


def test_the_trainer_step_differs_from_memprofs_loop_by_what_the_trainer_keeps():
    # The same model states; beyond memprof's loop the Trainer hands the model num_items_in_batch, the count of label
    # tokens (an int64 sum divided by tp * cp * sp = 1: a float32 scalar, 4 B, an input of the model's call), and
    # keeps its running loss sum and the gradient norm (float32 scalars) through the optimizer step.
    trainer = simulated(loop="hf-trainer")
    plain = simulated(loss_fn=lambda out: out.loss)
    for cat in (C.WEIGHTS, C.GRADIENTS, C.OPTIMIZER_STATES, C.ACTIVATIONS):
        assert trainer.peak[cat] == plain.peak[cat]
    assert trainer.peak[C.INPUTS] == plain.peak[C.INPUTS] + 4
    assert trainer.peak[C.TEMPORARIES] > plain.peak[C.TEMPORARIES]


def test_the_trainer_step_is_the_installed_trainers_code(monkeypatch):
    # Trainer.training_step and compute_loss of the installed transformers are the ones called, once per micro-batch.
    calls = {"training_step": 0, "compute_loss": 0}
    for name in calls:
        original = getattr(transformers.Trainer, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(transformers.Trainer, name, counted)
    est = simulated(steps=3, train_step=loop_step("hf-trainer", gradient_accumulation_steps=2))
    assert calls == {"training_step": 6, "compute_loss": 6}
    assert any("Trainer.training_step" in n and transformers.__version__ in n and torch.__version__ in n
               for n in est.notes)


def test_a_trainer_without_the_functions_the_loop_calls_is_refused_naming_them(monkeypatch):
    monkeypatch.delattr(transformers.Trainer, "_get_num_items_in_batch")
    with pytest.raises(MissingExtraError, match="_get_num_items_in_batch"):
        simulated(loop="hf-trainer")


def test_no_accelerator_state_is_left_in_the_process():
    # accelerate's AcceleratorState is process-wide: a named loop never creates one (a Trainer or an Accelerator
    # would, and a later Accelerator(mixed_precision=...) of the user's would then be refused).
    from accelerate.state import AcceleratorState, PartialState

    before = (dict(AcceleratorState._shared_state), dict(PartialState._shared_state))
    simulated(loop="hf-trainer")
    simulated(loop="accelerate")
    assert (dict(AcceleratorState._shared_state), dict(PartialState._shared_state)) == before


@pytest.mark.parametrize(("loop", "error", "words"), [
    ("lightning", InvalidArgumentError, "Trainer.fit"),
    ("torchtitan", MissingExtraError, "not installed"),
    ("banana", UnknownNameError, "hf-trainer"),
])
def test_a_loop_that_cannot_be_simulated_is_refused_saying_why(loop, error, words):
    with pytest.raises(error, match=words):
        simulated(loop=loop)


def test_a_missing_framework_names_the_extra(monkeypatch):
    import sys

    models = [build(), build()]  # built first: transformers' model classes import accelerate themselves
    assert transformers.Trainer is not None
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate raises ImportError
    for loop, model in zip(("accelerate", "hf-trainer"), models):  # the Trainer's step runs on Accelerator.backward
        with pytest.raises(MissingExtraError, match=r"accelerate is not installed; pip install "
                                                    r"'torch-memprof\[accelerate\]'"):
            memprof.estimate(model, adamw, inputs=BATCH, device="cpu", loop=loop)


@pytest.mark.parametrize("given", [{"train_step": lambda m, o, x: None}, {"loss_fn": lambda out: out.loss},
                                   {"step_context": lambda: None}])
def test_what_a_named_loop_does_itself_is_refused_beside_it(given):
    with pytest.raises(InvalidArgumentError):
        simulated(loop="hf-trainer", **given)


def test_the_trainer_takes_the_batch_dict_only():
    with pytest.raises(InvalidArgumentError, match="dict"):
        memprof.estimate(build(), adamw, inputs=IDS, targets=IDS, device="cpu", loop="hf-trainer")


def test_estimate_hf_defaults_to_the_trainers_step_and_names_loop_and_versions(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY,
              "transformers_version": "4.38.2"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    est = memprof.estimate_hf(tmp_path, seq_len=8, batch_size=2, device="cpu")
    built = memprof.simulate.hf.build_model(memprof.simulate.hf.load_config(tmp_path))
    batch = memprof.simulate.hf.token_batch(built, 2, 8)
    by_hand = memprof.estimate(built.model, lambda ps: torch.optim.AdamW(ps), inputs=batch, device="cpu",
                               loop="hf-trainer", precision="fp32")
    assert est.peak == by_hand.peak
    plain = memprof.estimate_hf(tmp_path, seq_len=8, batch_size=2, device="cpu", loop="plain")
    assert plain.peak != est.peak
    text = "\n".join(est.notes)
    assert "the HF Trainer's step (loop='hf-trainer')" in text and transformers.__version__ in text
    assert torch.__version__ in text
    assert f"written by transformers 4.38.2; the simulation ran the installed transformers {transformers.__version__}" \
        in text
    assert "memprof's own (loop='plain')" in "\n".join(plain.notes)
    config["transformers_version"] = transformers.__version__
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert not any("written by transformers" in n for n in memprof.estimate_hf(tmp_path, seq_len=8, batch_size=1,
                                                                             device="cpu").notes)


def test_max_batch_size_passes_the_loop_through():
    def make(b):
        ids = torch.zeros(b, 8, dtype=torch.long, device="meta")
        return {"input_ids": ids, "labels": ids}

    at_two = simulated(loop="hf-trainer").peak_bytes  # batch 2
    plan = memprof.max_batch_size(build(), adamw, make, at_two, device="cpu", loop="hf-trainer", multiple_of=1)
    assert plan.batch_size == 2  # batch 2's own peak is the budget: 2 fits, 3 does not


def autocast_calls(model):
    """Each call of ``model`` under CPU bf16 autocast, as accelerate's ``prepare_model`` wraps the forward under
    mixed precision (and as the simulation runs each model call under the target's autocast)."""
    regions = []

    def enter(module, args):
        region = torch.autocast("cpu", dtype=torch.bfloat16)
        region.__enter__()
        regions.append(region)

    def leave(module, args, out):  # returns None: the output is left as it is
        regions.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter, prepend=True)
    model.register_forward_hook(leave, always_call=True)
    return model


@pytest.mark.parametrize("loop", ["hf-trainer", "accelerate"])
def test_a_named_loop_under_mixed_precision_is_simulated_to_the_byte(loop):
    # Each model call under bf16 autocast in both runs, and the step's fp32 copy of the half-precision outputs
    # (accelerate's convert_to_fp32); here that copy is transient after the loss (compute_loss lets the outputs go),
    # below every phase moment, so this checks the mixed path runs alike, not the copy's bytes.
    model = autocast_calls(build())
    opt = adamw(model.parameters())
    step = loop_step(loop, precision="mixed")
    with memprof.profile(model, opt) as prof:
        out = None
        for _ in range(2):
            out = step(model, opt, BATCH)
        del out
    assert_equal_everywhere(simulated(loop=loop, precision="mixed"), prof.report())
    with pytest.raises(InvalidArgumentError, match="mixed-fp16"):
        simulated(loop=loop, precision="mixed-fp16")
