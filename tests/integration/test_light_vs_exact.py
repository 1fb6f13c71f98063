"""Light mode against exact mode on CPU: what docs/reliability.md says light mode sees, and what it does not.

Light mode has no dispatch mode, so code outside the model's modules runs unseen: what the loss function
saves is not an activation there, and a tensor made before the profile that only that code uses (the
targets, a metric accumulator such as the HF Trainer's ``tr_loss``) is not an input. Everything else
the two modes share matches to the byte.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import memprof
from memprof import Category as C

from helpers import saved_activation_bytes
from models import MLP

SHARED = (C.WEIGHTS, C.BUFFERS, C.GRADIENTS, C.OPTIMIZER_STATES, C.KV_CACHE, C.COMMUNICATION)


def _run(mode):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    acc = torch.zeros(())  # a metric accumulator made before the profile
    with memprof.profile(model, opt, mode=mode) as prof:
        # Not tests/training.py's loop: the loss is added to a metric made before the profile, which light
        # mode cannot see and exact mode counts.
        for _ in range(2):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            acc += loss.detach()
    return prof.report(), acc, model, x, y


def test_light_mode_matches_exact_mode_except_what_only_code_outside_the_model_uses():
    exact, acc_exact, model, x, y = _run("exact")
    light, acc_light, _, _, _ = _run("light")
    assert torch.equal(acc_exact, acc_light)  # the same training
    assert exact.num_steps == light.num_steps == 2
    for step in (0, 1):
        for phase in ("forward", "backward", "optimizer"):
            for moment in ("start", "end"):
                f, li = exact.breakdown(step, phase, moment), light.breakdown(step, phase, moment)
                for cat in SHARED:
                    assert li[cat] == f[cat], (step, phase, moment, cat)
                assert li[C.TEMPORARIES] is None and li.total is None  # no allocator counter on CPU
    f, li = exact.breakdown(1, "forward", "end"), light.breakdown(1, "forward", "end")
    # Inputs. Exact mode: x handed to the model, y handed to the loss, acc used by `acc +=` after step 0:
    # 16*32*4 + 16*8 + 4. Light mode: what is handed to the model's modules, x.
    assert f[C.INPUTS] == x.nbytes + y.nbytes + 4 == 2048 + 128 + 4
    assert li[C.INPUTS] == x.nbytes == 2048
    # Activations. Exact mode: what the model saves and what the loss saves (its log-softmax output,
    # 16*10*4, and total_weight, 4); light mode: what the model's modules save, the two ReLU outputs.
    expected = saved_activation_bytes(lambda: F.cross_entropy(model(x), y), list(model.parameters()) + [x, y])
    assert f[C.ACTIVATIONS] == expected == 2 * 16 * 64 * 4 + 640 + 4
    assert li[C.ACTIVATIONS] == 2 * 16 * 64 * 4
    # Light mode says what it leaves out, and where it goes on an accelerator.
    note = [n for n in light.trace.notes if "outside the model's modules" in n]
    assert len(note) == 1
    assert "not counted as activations, nor as inputs the tensors made before the profile" in note[0]
    assert "a metric accumulator" in note[0] and "among temporaries" in note[0]
    assert not any("outside the model's modules" in n for n in exact.trace.notes)


def test_light_mode_sees_what_the_model_saves_exact_mode_also_the_loss():
    model = MLP()
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    # 2 ReLU results 16*64*4, log-softmax 16*10*4 = 640, total_weight 4
    expected = saved_activation_bytes(lambda: F.cross_entropy(model(x), y), list(model.parameters()) + [x, y])
    assert expected == 2 * 4096 + 640 + 4
    out = {}
    notes = {}
    for mode in ("exact", "light"):
        with memprof.profile(model, mode=mode) as prof:
            F.cross_entropy(model(x), y).backward()
        out[mode] = prof.report().breakdown(0, "forward", "end")
        notes[mode] = prof.trace.notes
    assert out["exact"][C.ACTIVATIONS] == expected
    assert out["exact"][C.INPUTS] == 16 * 32 * 4 + 16 * 8
    # memprof's saved-tensor pair is on the stack only inside the model's calls (so that torch.func
    # and the user's own pairs work outside them). Exact mode finds what the loss saved on the graph when
    # backward starts; light mode sees no op and no graph, so it counts what the model saved: the two
    # ReLU results. It says so in a note.
    assert out["light"][C.ACTIVATIONS] == 2 * 4096
    assert out["light"][C.INPUTS] == 16 * 32 * 4
    assert any("outside the model's modules" in n for n in notes["light"])
