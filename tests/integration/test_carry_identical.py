"""A carried optimizer step records what measuring it records: the same phase records (every category at each
phase's start, peak and end, the ops, the tags), the same run peak, and the same training.

Each case trains two identical copies (same seed, same batches): one profiled as shipped (steps carried once
known), one with ``carry_optimizer_steps=False`` (every step measured op by op, the reference). The carried run
must have carried steps (else the comparison holds nothing), and its records must equal the reference's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memprof
from tests.helpers import optimizer_state_bytes, weight_bytes

STEPS = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 48), nn.LayerNorm(48), nn.GELU(), nn.Linear(48, 48), nn.GELU(),
                         nn.Linear(48, 5))


def _batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 24, generator=g), torch.randint(0, 5, (16,), generator=g)


def _optimizers(kind: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    params = list(model.parameters())
    make = {
        "sgd": lambda: [torch.optim.SGD(params, lr=0.1)],
        "sgd-momentum": lambda: [torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)],
        "adam": lambda: [torch.optim.Adam(params, lr=1e-3, weight_decay=1e-2)],
        "adamw-foreach": lambda: [torch.optim.AdamW(params, lr=1e-3, foreach=True)],
        "adamw-for-loop": lambda: [torch.optim.AdamW(params, lr=1e-3, foreach=False)],
        "adamw-amsgrad": lambda: [torch.optim.AdamW(params, lr=1e-3, amsgrad=True)],
        "adamw-fused": lambda: [torch.optim.AdamW(params, lr=1e-3, fused=True)],
        "adagrad": lambda: [torch.optim.Adagrad(params, lr=1e-2)],
        "rmsprop": lambda: [torch.optim.RMSprop(params, lr=1e-3, momentum=0.5, centered=True)],
        "two": lambda: [torch.optim.AdamW(params[:4], lr=1e-3), torch.optim.SGD(params[4:], lr=0.1, momentum=0.9)],
        # A second optimizer stepping some of the same parameters, after the first updated them.
        "shared": lambda: [torch.optim.AdamW(params, lr=1e-3), torch.optim.SGD(params[:2], lr=0.1, momentum=0.9)],
    }
    return make[kind]()


def _train(kind: str, *, carry: "bool | None", autocast: bool = False, scaler: bool = False):
    """STEPS steps of the model; profiled with carry on or off (None: not profiled). The report (or None), the
    model and the optimizers."""
    model = _model()
    opts = _optimizers(kind, model)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaler else None
    block = (memprof.profile(model, opts, mode="exact", carry_optimizer_steps=carry) if carry is not None
             else contextlib.nullcontext())
    records = []
    with block as prof:
        for i in range(STEPS):
            x, y = _batch(i)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(model(x), y)
            if grad_scaler is not None:
                grad_scaler.scale(loss).backward()
                for opt in opts:
                    grad_scaler.step(opt)
                grad_scaler.update()
            else:
                loss.backward()
                for opt in opts:
                    opt.step()
            for opt in opts:
                opt.zero_grad()
            del loss
            if prof is not None:
                prof.end_step()  # every step's record, not only those the report keeps in full
                records.append(prof.latest_step())
    report = prof.report() if prof is not None else None
    if report is not None:
        report.every_step = records
    return report, model, opts


CASES = ["sgd", "sgd-momentum", "adam", "adamw-foreach", "adamw-for-loop", "adamw-amsgrad", "adagrad", "rmsprop",
         "two", "shared"]


def _fused_on_cpu() -> bool:
    try:
        p = nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except RuntimeError:
        return False


def _assert_same_record(carried, measured) -> None:
    assert len(carried.every_step) == STEPS
    assert carried.every_step == measured.every_step
    a, b = carried.trace, measured.trace
    # Every phase of every step: the start, peak and end breakdowns (each category), ops and tags.
    assert a.steps == b.steps
    assert (a.start, a.peak, a.end, a.peak_step, a.peak_phase, a.peak_tags) == \
        (b.start, b.peak, b.end, b.peak_step, b.peak_phase, b.peak_tags)
    assert a.phase_stats == b.phase_stats


#: The first step carried: step 0 makes the state of most optimizers (measured), step 1 is the first steady
#: step (measured), the later ones are carried. SGD without momentum has no state, and Adagrad makes its state
#: in its constructor: their step 0 is already steady.
FIRST_CARRIED = {"sgd": 1, "adagrad": 1}


def _assert_carried(report, first: int = 2) -> None:
    spans = report.trace.optimizer_steps
    carried = {s for a, b, kind in spans if kind == "carried" for s in range(a, b + 1)}
    assert carried == set(range(first, STEPS)), spans
    assert any("carried at steps" in n for n in report.trace.notes)


@pytest.mark.parametrize("kind", CASES + ["adamw-fused"])
def test_carried_steps_record_what_measuring_records(kind):
    if kind == "adamw-fused" and not _fused_on_cpu():
        pytest.skip("this torch has no fused AdamW on CPU")
    carried, model, opts = _train(kind, carry=True)
    measured, _, _ = _train(kind, carry=False)
    _assert_carried(carried, FIRST_CARRIED.get(kind, 2))
    assert measured.trace.optimizer_steps == ()  # carry off: nothing carried, nothing said
    _assert_same_record(carried, measured)
    # And the carried optimizer phases hold what is there, counted apart: every parameter's storage once
    # (weight_bytes) and every state tensor's storage once (optimizer_state_bytes).
    for step in carried.every_step[2:]:
        for p in step.phases:
            if p.phase.value == "optimizer":
                assert p.start.get("weights") == weight_bytes(model)
        assert sum(p.end.get("optimizer_states") for p in step.phases if p.phase.value == "optimizer"
                   and p.occurrence == len(opts) - 1) == sum(optimizer_state_bytes(o) for o in opts)


@pytest.mark.parametrize("kind", ["adamw-foreach", "sgd-momentum"])
def test_carried_under_autocast_records_what_measuring_records(kind):
    carried, _, _ = _train(kind, carry=True, autocast=True)
    measured, _, _ = _train(kind, carry=False, autocast=True)
    _assert_carried(carried)
    _assert_same_record(carried, measured)


def test_carried_with_a_grad_scaler_records_what_measuring_records():
    try:
        torch.amp.GradScaler("cpu")
    except (RuntimeError, TypeError, AttributeError):
        pytest.skip("this torch has no GradScaler for CPU")
    carried, _, _ = _train("adamw-foreach", carry=True, scaler=True)
    measured, _, _ = _train("adamw-foreach", carry=False, scaler=True)
    steps = {s for a, b, k in carried.trace.optimizer_steps if k == "carried" for s in range(a, b + 1)}
    assert steps  # a step the scaler skipped (inf) runs no optimizer step: the others are carried
    _assert_same_record(carried, measured)


@pytest.mark.parametrize("kind", ["adamw-foreach", "adamw-for-loop", "sgd-momentum", "two"])
def test_training_is_bit_identical_with_carried_steps(kind):
    _, plain_model, plain_opts = _train(kind, carry=None)
    _, model, opts = _train(kind, carry=True)
    for a, b in zip(plain_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    for plain, opt in zip(plain_opts, opts):
        for p, q in zip(plain.state.values(), opt.state.values()):
            assert p.keys() == q.keys()
            for key in p:
                assert torch.equal(torch.as_tensor(p[key]), torch.as_tensor(q[key])), key


def test_the_saved_record_keeps_which_steps_were_carried(tmp_path):
    report, _, _ = _train("adam", carry=True)
    path = tmp_path / "run.json"
    report.save(path)
    loaded = memprof.load(path)
    assert loaded.trace.optimizer_steps == report.trace.optimizer_steps == ((0, 1, "measured"),
                                                                             (2, STEPS - 1, "carried"))
    assert loaded.trace == report.trace


def test_the_measured_step_is_held_against_the_optimizer_formula(monkeypatch):
    from memprof.anatomy import optimizers as formulas

    report, _, opts = _train("adamw-foreach", carry=True)
    # AdamW foreach: the formula of anatomy/optimizers.py is exact, and the note stays silent.
    formula = formulas.predict_optimizer_step_transient_bytes(opts[0])
    for step in report.every_step:
        phase = next(p for p in step.phases if p.phase.value == "optimizer")
        assert phase.peak.get("temporaries") - phase.start.get("temporaries") == formula > 0
    assert not any("the formula" in n for n in report.trace.notes)
    # A formula that disagrees is named in a note, with both figures.
    monkeypatch.setattr(formulas, "predict_optimizer_step_transient_bytes", lambda opt, with_grad=None: 1)
    report, _, _ = _train("adamw-foreach", carry=True)
    said = [n for n in report.trace.notes if "the formula" in n]
    assert len(said) == 1 and f"allocated {formula:,} bytes" in said[0] and "gives 1" in said[0]
