"""On a CUDA target an optimizer left to torch's choice (foreach=None) steps as torch steps it there: the foreach
implementation, whose temporaries are a list of every parameter's at once.

The twin's parameters are meta or fake CPU tensors, for which torch's ``_default_to_fused_or_foreach``
(torch/optim/optimizer.py) picks the for-loop, one parameter's temporaries at a time. Before, every CUDA estimate
of a default torch optimizer simulated the for-loop: an AdamW step on CUDA holds the square root of every second
moment at once (``_multi_tensor_adam``'s ``exp_avg_sq_sqrt``), which the estimate left out."""

from __future__ import annotations

import torch
from torch import nn

import memprof
from memprof.simulate import twin as twin_module

from test_parallelize import IDS, build, fsdp_bf16, loss_fn


def _phases(est, phase):
    return [p for p in est.trace.phases if p.phase.value == phase]


def _round(n: int) -> int:
    return -(-n // 512) * 512  # the CUDA caching allocator's smallest block and rounding


def test_a_default_adamw_on_cuda_holds_the_square_root_of_every_state_at_its_step():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    kw = dict(inputs=torch.randn(4, 64), gpu="h100-80gb")
    user = torch.optim.AdamW(model.parameters())
    default = memprof.estimate(model, user, **kw)
    foreach = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps, foreach=True), **kw)
    loop = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps, foreach=False), **kw)
    assert default.trace.peak == foreach.trace.peak and default.peak_bytes == foreach.peak_bytes
    assert default.peak_bytes > loop.peak_bytes
    assert any(n.startswith("optimizer step: AdamW's foreach implementation, as torch chooses it for parameters on "
                            "cuda") for n in default.notes), default.notes
    assert all(g["foreach"] is None for g in user.param_groups)  # the user's optimizer is not touched
    # The step's temporaries at its peak: the square roots of the 12 second moments, each its own block (6 weights of
    # 64 x 64 fp32, 16,384 B; 6 biases of 64 fp32, 256 B -> 512 B), and the loss the loop holds through the step
    # (4 B -> 512 B).
    roots = sum(_round(p.numel() * 4) for p in model.parameters())
    assert roots == 6 * 16_384 + 6 * 512
    for record in _phases(default, "optimizer"):
        assert record.peak[memprof.Category.TEMPORARIES] == roots + 512


def test_a_cpu_target_keeps_the_cpus_own_choice_and_the_for_loop_where_foreach_does_not_simulate(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8))
    kw = dict(inputs=torch.randn(4, 32))
    cpu = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps), **kw)
    assert cpu.trace.peak == memprof.estimate(model, lambda ps: torch.optim.AdamW(ps, foreach=False), **kw).trace.peak
    assert not any("foreach" in n for n in cpu.notes), cpu.notes
    # An optimizer whose foreach step does not simulate (none of torch's now: made so here) keeps the for-loop, with
    # a note saying what that leaves out.
    monkeypatch.setattr(twin_module, "_FOREACH_SIMULATED", (torch.optim.SGD,))
    kw = dict(kw, gpu="h100-80gb")
    kept = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps), **kw)
    assert kept.trace.peak == memprof.estimate(model, lambda ps: torch.optim.AdamW(ps, foreach=False), **kw).trace.peak
    assert any(n.startswith("AdamW's step on cuda is torch's foreach implementation, which reads values")
               for n in kept.notes), kept.notes


def test_an_fsdp2_rank_on_cuda_steps_its_dtensor_shards_with_foreach():
    # FSDP2's parameters are DTensors, which torch.distributed.tensor adds to the types foreach takes.
    kw = dict(inputs=IDS, targets=IDS, loss_fn=loss_fn, world_size=2, parallelize=fsdp_bf16, gpu="h100-80gb")
    default = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), **kw)
    foreach = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps, foreach=True), **kw)
    loop = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps, foreach=False), **kw)
    assert default.trace.peak == foreach.trace.peak
    steps = [[p.peak for p in _phases(e, "optimizer")] for e in (default, foreach, loop)]
    assert steps[0] == steps[1] != steps[2]
    assert any("AdamW's foreach implementation" in n for n in default.notes), default.notes


def test_asgd_on_cuda_steps_with_foreach_as_torch_chooses():
    # ASGD's foreach step reads its counters (answered 0, as its for-loop's are): it was kept on the for-loop, one
    # parameter's temporaries at a time where torch's CUDA step holds a list of every parameter's (17,408 B under
    # here).
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    kw = dict(inputs=torch.randn(4, 64), gpu="h100-80gb")
    default = memprof.estimate(model, torch.optim.ASGD, **kw)
    foreach = memprof.estimate(model, lambda ps: torch.optim.ASGD(ps, foreach=True), **kw)
    loop = memprof.estimate(model, lambda ps: torch.optim.ASGD(ps, foreach=False), **kw)
    assert default.trace.peak == foreach.trace.peak and default.peak_bytes == foreach.peak_bytes > loop.peak_bytes
    assert any("ASGD's foreach implementation, as torch chooses it" in n for n in default.notes), default.notes
