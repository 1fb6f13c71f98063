"""source="allocator" with no dispatch mode, on CPU: the stand-in allocator history receives an entry for every
storage the step makes and frees (``allocator_events.StorageEvents``, as the CUDA caching allocator records them),
and the profile's phase records, reduced from those entries alone, are held against the dispatch mode's, phase by
phase, at each start, peak and end, in every category.

Where the two differ by design (docs/exact-sources.md), the difference is asserted to the byte: the hooks see
backward begin at the model's own backward (the first saved tensor its modules unpack), so the loss function's
backward falls in the forward phase, and the loss's saved tensors, which no hook registers, are temporaries there.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import memprof
from memprof.collect import allocator_history
from memprof.vocabulary import TENSOR_CATEGORIES

from allocator_events import StorageEvents
from allocator_stand_in import FakeAllocator
from helpers import hook_registry
from models import MLP, TiedTransformer

CATS = [c.value for c in TENSOR_CATEGORIES]


@pytest.fixture
def stand_in(monkeypatch):
    fake = FakeAllocator()
    monkeypatch.setattr(allocator_history, "backend_for", lambda device: fake)
    return fake


def mlp_case():
    # 8 rows of 10 classes: the loss's logits are N x V = 8 x 10
    return MLP(), (torch.randn(8, 32),), torch.randint(0, 10, (8,))


def gpt_case():
    # batch 2 x 15 positions of a 50-token vocabulary: N x V = 30 x 50
    idx = torch.randint(0, 50, (2, 16))
    return TiedTransformer(), (idx[:, :-1],), idx[:, 1:].flatten()


def loss_of(model, args, target):
    out = model(*args)
    return F.cross_entropy(out.flatten(0, -2), target)


def train(case, source, fake, *, steps=2, autocast=False, fail=False):
    """``steps`` AdamW steps of ``case`` under a profile with ``source`` (None: no profile), the stand-in
    allocator fed beneath it; the dispatch modes on the stack at each step's loss; the model."""
    torch.manual_seed(0)
    model, args, target = case()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    modes = []
    with StorageEvents(fake) as events:
        prof = memprof.profile(model, opt, mode="exact", source=source) if source else None
        before = hook_registry(model, [opt], [target, *args])
        try:
            with prof if prof is not None else torch.enable_grad():
                if prof is not None:
                    prof.mark_inputs(target)  # handed only to the loss: no hook sees it otherwise
                for _ in range(steps):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        loss = loss_of(model, args, target)
                    modes.append([m for m in _get_current_dispatch_mode_stack() if m is not events])
                    if fail:
                        raise ZeroDivisionError("the user's error")
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    del loss
        finally:
            after = hook_registry(model, [opt], [target, *args])
            # the same counts as before, and no hook on what the steps made (gradients, optimizer state)
            assert {k: after[k] for k in before} == before
            assert all(v == 0 for k, v in after.items() if k not in before)
    return prof, model, modes


def records(prof):
    return {(p.step, p.phase.value, p.occurrence): p for s in prof.trace.steps for p in s.phases}


def figures(bd):
    return {c: bd[c] for c in CATS} | {"total": bd.total}


CASES = {"mlp": (mlp_case, 8 * 10), "gpt": (gpt_case, 30 * 50)}
#: At the forward's peak where the dispatch mode's peak stays the highest moment of the allocator's forward window
#: (the MLP's), the activations the allocator's record has more (its category at the window's end):
#: fp32: fc2's ReLU output, 8 x 64 x 4 = 2048 bytes, saved by the op that made it, a temporary for the dispatch mode
#: at its allocation (the peak); bf16 autocast: the peak is the loss's fp32 log_softmax output (8 x 10 x 4 = 320)
#: with nll_loss's 4-byte total_weight, activations for the dispatch mode, which saw autograd save them outside the
#: model, temporaries for the allocator's record: -324.
PEAK_MOVED = {("mlp", False): 2048, ("mlp", True): -324}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize("name", list(CASES))
def test_phase_records_match_the_dispatch_source(stand_in, name, autocast) -> None:
    case, nv = CASES[name]
    disp, _, _ = train(case, "dispatch", stand_in, autocast=autocast)
    alloc, _, modes = train(case, "allocator", stand_in, autocast=autocast)
    assert modes == [[], []]  # no dispatch mode of memprof's on the stack (the stand-in's own is left out)
    assert alloc.mode == "exact" and alloc.trace.mode == "exact"
    d, a = records(disp), records(alloc)
    assert list(d) == list(a) and len(d) >= 6  # the same phases: 2 steps of forward, backward, optimizer, ...
    lsm = nv * 4  # the loss's log_softmax output: N x V fp32 (autocast runs it in fp32 too)
    logit_grad = nv * (2 if autocast else 4)  # the gradient of the logits, in the logits' dtype
    for key in d:
        for moment in ("start", "peak", "end"):
            fd, fa = figures(getattr(d[key], moment)), figures(getattr(a[key], moment))
            _, phase, _ = key
            if (phase, moment) in (("forward", "end"), ("backward", "start")):
                # The loss's backward ran in the allocator's forward window: its saved log_softmax output and
                # nll_loss's 4-byte total_weight are freed, the gradient of the logits is live (a temporary).
                want = dict(fd, activations=fd["activations"] - lsm - 4,
                            temporaries=fd["temporaries"] + logit_grad)
                want["total"] = fd["total"] - lsm - 4 + logit_grad
                assert fa == want, key + (moment,)
            elif (phase, moment) == ("forward", "peak"):
                end = figures(d[key[:2] + (0,)].end)
                # The loss's backward reached this high inside the allocator's window: the forward's end, with
                # the gradients of nll_loss and log_softmax (N x V fp32 each) live and total_weight freed.
                in_loss_backward = end["total"] + 2 * lsm - 4
                assert fa["total"] == max(fd["total"], in_loss_backward), key
                assert {c: fa[c] for c in CATS[:4]} == {c: fd[c] for c in CATS[:4]}  # persistent: the same
                if in_loss_backward > fd["total"]:
                    assert fa["activations"] == end["activations"] - lsm - 4, key
                else:
                    moved = PEAK_MOVED[(name, autocast)]
                    assert (fa["activations"] - fd["activations"], fa["temporaries"] - fd["temporaries"]) == (
                        moved, -moved), key
            else:
                assert fa == fd, key + (moment,)  # backward's peak and end, the optimizer, the rest: byte-equal
    # The run's peak is the highest phase peak, as the windows give it.
    highest = max((p.peak for p in a.values()), key=lambda b: b.total)
    assert figures(alloc.trace.peak) == figures(highest)
    assert figures(alloc.trace.end) == figures(list(a.values())[-1].end)


def test_training_is_unchanged(stand_in) -> None:
    _, bare, _ = train(gpt_case, None, stand_in)
    _, profiled, _ = train(gpt_case, "allocator", stand_in)
    for (n, p), q in zip(bare.named_parameters(), profiled.parameters()):
        assert torch.equal(p, q), n


def test_everything_is_removed_when_the_block_raises(stand_in) -> None:
    # train() compares every hook before and after, also when the body raises
    with pytest.raises(ZeroDivisionError, match="the user's error"):
        train(mlp_case, "allocator", stand_in, fail=True)
    assert not stand_in.on and stand_in.calls[-1] == (None, {})  # memprof's recording stopped


def test_the_record_says_where_its_figures_come_from(stand_in) -> None:
    prof, _, _ = train(mlp_case, "allocator", stand_in)
    notes = "\n".join(prof.trace.notes)
    assert "reduced from the CUDA caching allocator's own events (no dispatch mode ran)" in notes
    assert "the one the hooks knew at the end of its phase" in notes
    assert "light mode" not in notes  # no counter-based note: every category is measured
    assert all(p.peak["temporaries"] is not None for s in prof.trace.steps for p in s.phases)


def test_a_schedule_is_refused_with_the_fix(stand_in) -> None:
    from memprof.errors import InvalidArgumentError

    model = MLP()
    with pytest.raises(InvalidArgumentError, match="profile without schedule=, or with source='dispatch'"):
        memprof.profile(model, source="allocator", schedule=memprof.schedule(wait=1, warmup=0, active=1))


def test_the_step_that_holds_the_peak_is_kept_in_full(stand_in) -> None:
    # 7 steps; in step 4 a 400,000-byte temporary (100,000 fp32 ones) is made and freed between the forward and
    # the backward: only the allocator's events show it, and it makes step 4's forward the run's peak. The record
    # keeps the first 3 steps, the peak's and the last in full (memprof.collect.retention.FIRST_STEPS = 3).
    torch.manual_seed(0)
    model, args, target = mlp_case()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with StorageEvents(stand_in), memprof.profile(model, opt, source="allocator") as prof:
        prof.mark_inputs(target)
        for step in range(7):
            loss = loss_of(model, args, target)
            if step == 4:
                big = torch.ones(100_000)
                del big
            loss.backward()
            opt.step()
            opt.zero_grad()
            del loss
    trace = prof.trace
    assert [s.index for s in trace.steps] == [0, 1, 2, 4, 6]
    assert (trace.peak_step, trace.peak_phase.value) == (4, "forward")
    fwd4 = next(p for p in trace.steps[3].phases if p.phase.value == "forward")
    fwd3 = next(r.window for r in prof.allocator_phases if (r.step, r.phase) == (3, "forward"))
    assert figures(trace.peak) == figures(fwd4.peak)
    # the peak is step 3's forward end (the same step, without the block) plus the block
    assert fwd4.peak.total == fwd3.end.total + 100_000 * 4


def test_the_allocator_windows_kept_stay_bounded(stand_in) -> None:
    # 120 steps of 3 phases (forward, backward, optimizer) and the "other" phase zero_grad leaves: 480 windows, more
    # than the 256 kept before the windows of steps the record does not keep in full are dropped
    torch.manual_seed(0)
    model, args, target = mlp_case()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with StorageEvents(stand_in), memprof.profile(model, opt, source="allocator") as prof:
        prof.mark_inputs(target)
        for _ in range(120):
            loss_of(model, args, target).backward()
            opt.step()
            opt.zero_grad()
    kept = {s.index for s in prof.trace.steps}
    steps = {r.step for r in prof.allocator_phases}
    assert len(prof.allocator_phases) <= 256 and steps >= kept and {0, 1, 2, 119} <= kept
    # the windows still there are the kept steps', and those of the steps since the last time the list was cut
    last_cut = min(steps - kept) if steps - kept else None
    assert last_cut is None or all(s >= last_cut for s in steps - kept)


def test_a_generation_with_a_kv_cache_matches_the_dispatch_source(stand_in) -> None:
    transformers = pytest.importorskip("transformers")
    import warnings

    def generated(source):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64, bos_token_id=0, eos_token_id=0)).eval()
        ids = torch.randint(1, 64, (1, 8))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with StorageEvents(stand_in), memprof.profile(model, source=source) as prof:
                model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        return records(prof)

    d, a = generated("dispatch"), generated("allocator")
    assert list(d) == list(a) and [k[1] for k in d].count("decode") == 3
    for key in d:
        for moment in ("start", "peak", "end"):
            fd, fa = figures(getattr(d[key], moment)), figures(getattr(a[key], moment))
            if moment == "start" and key[1] in ("prefill", "decode"):
                # What generate() made for the call in the "other" phase before it is a temporary for the dispatch
                # mode until the call takes it as an input; the allocator's window gives it the category it has at
                # the window's end from its start: the same bytes, moved from temporaries to inputs
                moved = fa["inputs"] - fd["inputs"]
                assert moved > 0 and fa == dict(fd, inputs=fd["inputs"] + moved,
                                                 temporaries=fd["temporaries"] - moved), key
            else:
                assert fa == fd, key + (moment,)  # the cache at every moment among them
    last_decode = [p for k, p in a.items() if k[1] == "decode"][-1]
    assert last_decode.end["kv_cache"] > 0  # the cache is counted as such, not among temporaries


def test_record_allocations_is_refused_with_the_fix(stand_in) -> None:
    from memprof.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="needs mode='exact' with source='dispatch'"):
        memprof.profile(MLP(), source="allocator", record_allocations=True)
