"""``estimate(..., train_step=fn)``: the user's own training step, run on the shape-only twins, against the same
function run for real under ``memprof.profile`` on CPU. Every loop feature that moves memory (outputs kept across
steps, clipping, accumulation, a scheduler, loss scaling, an EMA copy, ``.item()``, a gradient hook,
``zero_grad(set_to_none=False)``) agrees to the byte: every category at the start, peak and end of every phase of
both steps."""

from __future__ import annotations

import pytest
import torch

import memprof
from memprof import Category as C
from memprof.errors import InvalidArgumentError
from phases import assert_equal_everywhere, phase_records
from test_parallelize import IDS, Tiny, fsdp_bf16, loss_fn


def build():
    torch.manual_seed(0)
    return Tiny()  # vocab 96, dim 32, ffn 64, two blocks; IDS: a (2, 8) batch of token ids


def adamw(params):
    return torch.optim.AdamW(params, foreach=True)


def measured(step, steps: int = 2, model=None, make=adamw, batch=(IDS, IDS)):
    """``step`` run for real as a loop runs it: ``out = step(model, opt, *batch)``, the result held until the
    next call returns, the last let go when the loop ends (inside the block, as the estimate's loop ends).
    ``make``: the optimizer's factory, or an optimizer already built on ``model`` (one that has stepped)."""
    model = build() if model is None else model
    opt = make if isinstance(make, torch.optim.Optimizer) else make(model.parameters())
    with memprof.profile(model, opt) as prof:
        out = None
        for _ in range(steps):
            out = step(model, opt, *batch)
        del out
    return prof.report()


def simulated(step, steps: int = 2, **options):
    return memprof.estimate(build(), adamw, inputs=IDS, targets=IDS, train_step=step, steps=steps, **options)


def assert_same_run(est, rep) -> None:
    """The same phases, in the same order, with every category equal at each one's start, peak and end; the same
    peak at the same step and phase."""
    assert [(p.step, p.phase, p.occurrence, p.start, p.peak, p.end) for p in est.trace.phases] == \
        [(p.step, p.phase, p.occurrence, p.start, p.peak, p.end) for p in rep.trace.phases]
    assert_equal_everywhere(est, rep)


def assert_never_under(est, rep) -> None:
    """The same phases, in the same order, each at least the measured run's at its start, peak and end (where the
    simulation takes an upper bound: a branch 0 takes, every index a coalesce is given)."""
    pairs = list(zip(est.trace.phases, rep.trace.phases))
    assert [(a.step, a.phase) for a, _ in pairs] == [(b.step, b.phase) for _, b in pairs]
    for a, b in pairs:
        for at in ("start", "peak", "end"):
            assert getattr(a, at).total >= getattr(b, at).total, (a.step, a.phase, at)


# ---------------------------------------------------------------------------------------------- the loop features

def plain(model, opt, x, y):
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def keeps_logits(model, opt, x, y):
    logits = model(x)
    loss = loss_fn(logits, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return logits  # the loop keeps the output until the next step's returns


def clips(model, opt, x, y):
    loss = loss_fn(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    opt.zero_grad()
    return loss


def accumulates(model, opt, x, y):
    for half in (slice(0, 1), slice(1, 2)):  # two micro-batches of one sequence each, one optimizer step
        (loss_fn(model(x[half]), y[half]) / 2).backward()
    opt.step()
    opt.zero_grad()


def scales_the_loss(model, opt, x, y):
    loss = loss_fn(model(x), y)
    (loss * 1024.0).backward()  # a fixed loss scale
    for p in model.parameters():
        p.grad.mul_(1 / 1024.0)
    opt.step()
    opt.zero_grad()
    return loss


def logs_the_loss(model, opt, x, y):
    loss = loss_fn(model(x), y)
    loss.backward()
    value = loss.item()  # value-dependent code on the loss: the simulation answers it
    opt.step()
    opt.zero_grad()
    return value


def zeroes_in_place(model, opt, x, y):
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # older loops: the gradients stay allocated, zeroed
    return loss


class Scheduled:
    """A step with an LR scheduler, built on each new optimizer it is handed (the pattern docs/estimate.md gives)."""

    def __init__(self) -> None:
        self.opt = None

    def __call__(self, model, opt, x, y):
        if opt is not self.opt:  # a new run: its scheduler
            self.opt, self.scheduler = opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
        loss = plain(model, opt, x, y)
        self.scheduler.step()
        return loss


class Averaged:
    """A step keeping an EMA copy of the weights, made at the first call of each run (a hand copy: AveragedModel
    deep-copies the module, and a deep copy of fake tensors is not safe in torch)."""

    def __init__(self) -> None:
        self.opt = None

    def __call__(self, model, opt, x, y):
        if opt is not self.opt:  # a new run: its EMA copy is made below
            self.opt, self.ema = opt, None
        loss = plain(model, opt, x, y)
        params = [p.detach() for p in model.parameters()]
        with torch.no_grad():
            if self.ema is None:
                self.ema = [p.clone() for p in params]
            torch._foreach_lerp_(self.ema, params, 0.001)
        return loss


class Hooked:
    """A step whose gradients pass a hook (registered once per model it is handed)."""

    def __init__(self) -> None:
        self.model = None

    def __call__(self, model, opt, x, y):
        if model is not self.model:  # a new run: hook its parameters
            for p in model.parameters():
                p.register_hook(lambda g: g * 0.5)  # a new gradient tensor in place of autograd's
            self.model = model
        return plain(model, opt, x, y)


FEATURES = {
    "outputs kept": lambda: keeps_logits,
    "clip_grad_norm_": lambda: clips,
    "accumulation": lambda: accumulates,
    "lr scheduler": Scheduled,
    "loss scaling": lambda: scales_the_loss,
    "ema": Averaged,
    "item": lambda: logs_the_loss,
    "gradient hook": Hooked,
    "zero_grad in place": lambda: zeroes_in_place,
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_loop_feature_is_simulated_to_the_byte(feature):
    make = FEATURES[feature]
    assert_same_run(simulated(make()), measured(make()))


def test_the_kept_output_is_held_through_the_next_forward():
    kept, dropped = simulated(keeps_logits), simulated(plain)
    # Between the steps the loop holds what the step returned, and nothing else outside the model and optimizer:
    # the logits of step 0, (2, 8, 96) fp32 = 2 * 8 * 96 * 4 = 6,144 bytes, against the plain step's loss, one fp32
    # scalar (4 bytes). Both are temporaries (neither is saved for a backward).
    k, d = phase_records(kept.trace), phase_records(dropped.trace)
    assert k[(1, "forward", 0)].start[C.TEMPORARIES] == 2 * 8 * 96 * 4 == 6_144
    assert d[(1, "forward", 0)].start[C.TEMPORARIES] == 4
    # Released when the loop ends: nothing of the step's is left at the end of the run.
    assert k[(1, "other", 1)].end[C.TEMPORARIES] == d[(1, "other", 1)].end[C.TEMPORARIES] == 0
    assert any("keeps_logits(model, optimizer, batch, targets), called 2 times" in n for n in kept.notes)


def test_accumulation_gives_two_forward_and_backward_phases_per_step():
    est = simulated(accumulates)
    assert [(p.phase.value, p.occurrence) for p in est.trace.phases if p.step == 0] == [
        ("forward", 0), ("backward", 0), ("other", 0), ("forward", 1), ("backward", 1), ("other", 1),
        ("optimizer", 0), ("other", 2)]


def test_zero_grad_in_place_keeps_the_gradients_in_the_simulation():
    est = simulated(zeroes_in_place)
    params = sum(p.numel() for p in build().parameters())
    # Every parameter's gradient stays allocated after the step: 14,432 fp32 parameters x 4 bytes (embedding 96 x 32,
    # two blocks of 32 + 32 x 64 + 64 x 32, a norm of 32, a head of 32 x 96).
    assert params == 96 * 32 + 2 * (32 + 32 * 64 + 64 * 32) + 32 + 32 * 96 == 14_432
    assert phase_records(est.trace)[(1, "optimizer", 0)].end[C.GRADIENTS] == params * 4


def test_item_is_answered_and_the_notes_say_where():
    est = simulated(logs_the_loss)
    note = next(n for n in est.notes if "read values that shape-only tensors do not hold" in n)
    assert "item() x2 at test_train_step.py:" in note


def test_a_loop_that_stops_on_a_value_is_refused_where_it_would_never_stop():
    # A step whose loop stops on a value (model.generate()'s stop test in an RL step, a while loop on a tensor):
    # every read is answered 0 (False), so the loop never stopped and the estimate never returned (a new user's
    # sweep). The real step below stops after 3 rounds; the simulation is refused at the limit, naming the place.
    from memprof.simulate.user_step import LOOP_READS

    rounds = []

    def step(model, opt, x, y):
        done = torch.zeros(())
        while not bool(done):
            rounds.append(1)
            done = x.float().mean() * 0 + (len(rounds) % 3 == 0)  # a tensor whose value decides
        return plain(model, opt, x, y)

    measured(step, steps=1)
    assert len(rounds) == 3
    rounds.clear()
    with pytest.raises(memprof.errors.SimulationError,
                       match=rf"read a value \(item\(\)\) at test_train_step.py:\d+ more than {LOOP_READS} times"):
        simulated(step, steps=1)
    assert len(rounds) == LOOP_READS  # stopped at the limit (the read before each round), not let run


def test_an_accumulation_loop_logging_each_micro_batch_is_not_taken_for_an_endless_one():
    # More micro-batches than LOOP_READS, each logging its loss.item() after its backward: the loop progresses, and
    # the count starts again after each backward (a review refused 300 micro-batches, which the real run ran).
    from memprof.simulate.user_step import LOOP_READS

    micro = LOOP_READS + 44
    x, y = torch.randn(2, 4), torch.randn(2, 4)

    def step(model, opt, x, y):
        total = 0.0
        for _ in range(micro):
            loss = ((model(x) - y) ** 2).mean() / micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        return total

    make = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    torch.manual_seed(0)
    real = measured(step, steps=1, model=torch.nn.Linear(4, 4), make=make, batch=(x, y))
    torch.manual_seed(0)
    est = memprof.estimate(torch.nn.Linear(4, 4), make, inputs=x, targets=y, train_step=step, steps=1)
    assert_same_run(est, real)


def test_a_step_that_cannot_be_called_as_the_loop_calls_it_is_refused_naming_the_call():
    # A three-argument step given targets=: torch's own TypeError came out of the simulated step (a new user's
    # sweep); a generator function ran none of its body, and the estimate held nothing, silently.
    def three(model, opt, x):
        return plain(model, opt, x, x)

    with pytest.raises(InvalidArgumentError, match=r"three\(model, opt, x\) cannot be called as the loop calls "
                                                   r"it, train_step\(model, optimizer, batch, targets\)"):
        simulated(three)

    def generating(model, opt, x, y):
        yield plain(model, opt, x, y)

    with pytest.raises(InvalidArgumentError, match="generating is a generator function"):
        simulated(generating)


def test_a_value_the_model_reads_in_its_forward_is_still_refused():
    class Reads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * float(x.sum())  # the model's own value-dependent code

    def step(model, opt, x):
        model(x).sum().backward()

    with pytest.raises(memprof.errors.SimulationError, match="reads tensor values"):
        memprof.estimate(Reads(), None, inputs=torch.randn(2, 4), train_step=step)


# ------------------------------------------------------------------------------------------------- composition

def test_with_precision_bf16_the_step_runs_on_bf16_twins():
    def bf16_step(model, opt, x, y):
        return keeps_logits(model, opt, x, y)

    est = simulated(bf16_step, precision="bf16")
    model = build().to(torch.bfloat16)
    assert_same_run(est, measured(bf16_step, model=model))


def test_with_mixed_precision_each_call_of_the_model_runs_under_autocast():
    def step(model, opt, x, y):
        return keeps_logits(model, opt, x, y)

    def real(model, opt, x, y):  # what precision="mixed" means with train_step: the model's calls under autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = loss_fn(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return logits

    est = simulated(step, precision="mixed")
    assert_same_run(est, measured(real))
    # The logits kept are autocast's bf16 output of the head: (2, 8, 96) x 2 bytes less than the fp32 run's.
    assert est.peak_bytes != simulated(step).peak_bytes
    assert any("each call of the model ran under the target's autocast" in n for n in est.notes)


def test_with_parallelize_the_step_runs_on_one_rank_of_the_fake_process_group():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    est = simulated(keeps_logits, world_size=2, rank=0, parallelize=fsdp_bf16)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = fsdp_bf16(build(), init_device_mesh("cpu", (2,)))
        rep = measured(keeps_logits, model=model)
    finally:
        dist.destroy_process_group()
    assert_same_run(est, rep)
    assert est.trace.distributed.layout == "fsdp2"


def test_with_a_gpu_the_kept_output_reaches_the_device_figures():
    kept = simulated(keeps_logits, gpu="h100-80gb")
    dropped = simulated(plain, gpu="h100-80gb")
    # On a CUDA target every block is rounded up to 512 bytes: the kept logits, 2 * 8 * 96 * 4 = 6,144 bytes (12 x
    # 512), against the plain step's fp32 scalar loss in one 512-byte block, held into step 1's forward.
    k, d = phase_records(kept.trace), phase_records(dropped.trace)
    assert k[(1, "forward", 0)].start[C.TEMPORARIES] == 6_144
    assert d[(1, "forward", 0)].start[C.TEMPORARIES] == 512
    assert kept.device_peak is not None and dropped.device_peak is not None


# ---------------------------------------------------------------------------------------------------- errors

def test_an_error_in_the_step_propagates_unchanged():
    raised = TypeError("the user's own bug")

    def broken(model, opt, x, y):
        model(x)
        raise raised

    with pytest.raises(TypeError) as caught:
        simulated(broken)
    assert caught.value is raised


@pytest.mark.parametrize("bad", [42, "train", torch.nn.Linear(2, 2)])
def test_a_step_that_is_not_a_function_is_refused(bad):
    with pytest.raises(InvalidArgumentError, match="train_step must be the function your loop calls"):
        simulated(bad)


@pytest.mark.parametrize("option", ["loss_fn", "step_context"])
def test_memprofs_own_loop_options_are_refused_with_a_train_step(option):
    from contextlib import nullcontext

    given = {"loss_fn": loss_fn, "step_context": nullcontext}[option]
    with pytest.raises(InvalidArgumentError, match=f"{option}= belong to memprof's loop"):
        memprof.estimate(build(), adamw, inputs=IDS, targets=IDS, train_step=plain, **{option: given})


def test_pipeline_refuses_a_train_step_and_says_why():
    with pytest.raises(InvalidArgumentError, match="torch's schedule runs the step"):
        memprof.estimate(build(), adamw, inputs=IDS, targets=IDS, train_step=plain, world_size=2,
                         pipeline=memprof.Pipeline(split=lambda m, i, n: m, schedule="gpipe", microbatches=2))


def test_max_batch_size_passes_the_step_through():
    def make_batch(b):
        return torch.zeros(b, 8, dtype=torch.long), torch.zeros(b, 8, dtype=torch.long)

    raised = TypeError("called")

    def sentinel(model, opt, x, y):
        assert x.shape[0] % 8 == 0
        raise raised

    with pytest.raises(TypeError) as caught:
        memprof.max_batch_size(build(), adamw, make_batch, "1 GiB", train_step=sentinel)
    assert caught.value is raised
    plan = memprof.max_batch_size(build(), adamw, make_batch, "1 MiB", train_step=keeps_logits)
    x, y = make_batch(8)
    est = memprof.estimate(build(), adamw, inputs=x, targets=y, train_step=keeps_logits)
    assert dict(plan.points)[8] == est.peak_bytes


def test_a_stateful_step_reused_across_runs_counts_its_state_in_each():
    step = Averaged()
    first, second = simulated(step), simulated(step)
    # The EMA copy is made afresh for each run's twin: a copy of every weight, 14,432 fp32 parameters x 4 bytes =
    # 57,728 bytes, held from step 0's optimizer phase on in both runs alike.
    assert [(p.phase, p.start, p.peak, p.end) for p in second.trace.phases] == \
        [(p.phase, p.start, p.peak, p.end) for p in first.trace.phases]
    plain_run = phase_records(simulated(plain).trace)
    ema = phase_records(second.trace)[(1, "forward", 0)].start[C.TEMPORARIES] - \
        plain_run[(1, "forward", 0)].start[C.TEMPORARIES]
    assert ema == 14_432 * 4 == 57_728


def test_the_step_is_handed_the_twins_and_the_inputs_as_given():
    model = build()
    batch = {"ids": IDS}
    seen = []

    class ById(torch.nn.Module):  # takes its batch as a keyword, as a dict of inputs is handed on
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(ids)

    def step(m, opt, inputs):  # no targets=: three arguments
        seen.append((m, opt, inputs))
        m(**inputs).sum().backward()

    wrapped = ById(model)
    memprof.estimate(wrapped, None, inputs=batch, train_step=step, steps=2)
    (m0, opt0, x0), (m1, opt1, x1) = seen
    assert m0 is m1 and m0 is not wrapped and opt0 is None  # one twin for the run, never the user's model
    assert set(x0) == {"ids"} and x0["ids"] is not IDS and x0["ids"].shape == IDS.shape
    assert all(p.grad is None for p in model.parameters())  # the user's model is untouched
