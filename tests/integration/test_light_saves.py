"""Light mode's saved tensors and gradients, accounted on the hooks' short paths, give the figures of the
general path and of exact mode.

memprof's pack writes out, for light mode's common save (a storage the ledger does not know, saved in a
module's forward), what ``SavedTracker.account`` and ``attribute`` do for it, and the gradient hook writes
out ``ParamTracker.add_grad`` for a plain gradient (tests/integration/test_overhead_counts.py holds the calls
they save). Here the whole record of a light profile made that way is compared with the record the general
path makes of the same training (``account`` for every save, ``add_grad`` for every gradient), and light
mode's figures with exact mode's and with an independent count where both modes see everything.
"""

from __future__ import annotations

import weakref

import pytest
import torch

import memprof
from memprof import Category as C
from memprof.collect import params as params_module
from memprof.collect import saved as saved_module

from helpers import saved_activation_bytes, unique_bytes
from models import make
from training import output_sum, train

MODELS = ("mlp", "cnn", "transformer", "lstm")


def _general_pack(self, t):
    # SavedTracker.pack through the general path: account() for every save, Ledger.watch() for the slot.
    key = self.account(t)
    if t.is_leaf:
        d, origin = t, None
    else:
        d, origin = t.detach(), weakref.ref(t)
    if key is None:
        return (d, t._version, origin)
    saved = saved_module.Saved.__new__(saved_module.Saved)
    saved.tensor, saved.version, saved.origin = d, t._version, origin
    self.ledger.watch(saved, (key,))
    return saved


def _general_grad_hook(self, param):
    # ParamTracker.grad_hook through add_grad() for every gradient (the hook's code before its short path).
    run = self.run
    if not run.active:
        if run.paused and self.while_paused is not None:
            self.while_paused()
        return
    if not run.forward_seen and not run.foreign_threads:
        self.invisible_forwards += 1
    self.ledger.settle()
    if run.phase is not params_module._BACKWARD:
        self.phases.backward_started()
    if param.grad is not None:
        self.add_grad(param.grad, retro=True)


def _light_trace(name, loss=None):
    torch.manual_seed(0)
    model, batch, loss_fn = make(name)
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt, mode="light") as prof:
        train(model, opt, batch, steps=3, loss=loss or loss_fn)
    return prof.trace, model


@pytest.mark.parametrize("name", MODELS)
def test_light_modes_short_paths_record_what_the_general_path_records(name, monkeypatch):
    short, model = _light_trace(name)
    monkeypatch.setattr(saved_module.SavedTracker, "pack", _general_pack)
    monkeypatch.setattr(params_module.ParamTracker, "grad_hook", _general_grad_hook)
    general, _ = _light_trace(name)
    # The records compare every figure (breakdowns at each phase's start, peak and end, the saved tensors'
    # tags at the peaks, the module table, the timeline's samples and their event counts); times are not
    # compared (their fields say compare=False).
    assert short == general
    # ... and they are figures, not empty records: the model's saves and gradients were counted.
    forward = short.steps[1].phases[0]
    assert forward.phase.value == "forward"
    assert forward.end[C.ACTIVATIONS] > 0
    # Each parameter's gradient is a tensor of its size, and tied parameters share one: the weights' bytes.
    assert short.steps[1].phases[1].end[C.GRADIENTS] == unique_bytes(model.parameters())
    assert sum(m.activations or 0 for m in short.modules) > 0


@pytest.mark.parametrize("name", MODELS)
def test_light_and_exact_mode_agree_where_both_see_every_save(name):
    # The loss is the outputs' sum, which saves nothing (SumBackward keeps a shape): every save happens in
    # the model's modules, which light mode sees, so every category but temporaries agrees to the byte at
    # each phase's start and end.
    traces = {}
    for mode in ("exact", "light"):
        torch.manual_seed(0)
        model, (x, _), _ = make(name)
        opt = torch.optim.AdamW(model.parameters())
        with memprof.profile(model, opt, mode=mode) as prof:
            train(model, opt, (x, None), steps=2, loss=output_sum)
        traces[mode] = prof.trace
    exact, light = traces["exact"], traces["light"]
    assert len(exact.steps) == len(light.steps) == 2
    for fs, ls in zip(exact.steps, light.steps):
        # Exact mode also closes the backward where its last op ran, and calls what follows until the
        # optimizer step an "other" phase of its own: the forward, backward and optimizer phases pair up, and
        # so do the steps' last phases (zero_grad's "other").
        assert [p.phase.value for p in ls.phases] == ["forward", "backward", "optimizer", "other"]
        by_kind = {p.phase.value: p for p in fs.phases if p.phase.value != "other"}
        pairs = [(by_kind[li.phase.value], li) for li in ls.phases[:3]] + [(fs.phases[-1], ls.phases[-1])]
        for f, li in pairs:
            for moment in ("start", "end"):
                fb, lb = getattr(f, moment), getattr(li, moment)
                for cat in C:
                    if cat is not C.TEMPORARIES:
                        assert lb[cat] == fb[cat], (fs.index, f.phase, moment, cat)
                assert lb[C.TEMPORARIES] is None  # no allocator counter on CPU
    # The activations at the forward's end: an independent count of what autograd saves in one forward,
    # storages deduplicated, parameters, buffers (batch norm saves its running statistics) and the input
    # left out.
    torch.manual_seed(0)
    model, (x, _), _ = make(name)
    expected = saved_activation_bytes(lambda: model(x).sum(), [*model.parameters(), *model.buffers(), x])
    assert expected > 0
    assert light.steps[1].phases[0].end[C.ACTIVATIONS] == exact.steps[1].phases[0].end[C.ACTIVATIONS] == expected
    # Each module's saved activations, as exact mode attributes them op by op.
    assert {m.path: m.activations for m in light.modules} == {m.path: m.activations for m in exact.modules}
