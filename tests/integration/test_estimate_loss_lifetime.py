"""The estimate's training loop keeps the loss as a real loop does: bound through optimizer.step() and
zero_grad() (it is logged after the step) until the next step's loss replaces it, released when the loop ends."""

import torch
from torch import nn

import memprof
from memprof.vocabulary import Phase


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _real(x, y, keep):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = []
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if not keep:
                del loss
            opt.step()
            opt.zero_grad()
            if keep:
                logged.append(loss.item())  # a loop logs its loss after the step
        if keep:
            del loss  # the loop has ended
    return prof.report().trace


def _optimizer_peaks(trace):
    return [p.peak.total for p in trace.phases if p.phase is Phase.OPTIMIZER]


def test_the_loss_lives_through_the_optimizer_step_as_in_a_real_loop():
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    est = memprof.estimate(_model(), lambda ps: torch.optim.SGD(ps, lr=0.1), inputs=x, targets=y,
                           loss_fn=nn.functional.mse_loss, device="cpu", steps=2)
    kept, dropped = _real(x, y, keep=True), _real(x, y, keep=False)
    # On CPU mse_loss's 0-dim result keeps the storage of its elementwise buffer: 4 x 4 fp32 = 64 bytes, held at
    # every optimizer step by a loop that logs the loss after it, missed by one that deletes it right after
    # backward (as the estimate's loop once did: an under-estimate of that much).
    held = nn.functional.mse_loss(torch.randn(4, 4), y).untyped_storage().nbytes()
    assert held == 4 * 4 * 4
    assert [a - b for a, b in zip(_optimizer_peaks(kept), _optimizer_peaks(dropped))] == [held, held]
    # The estimate follows the loop that keeps it: every phase's start, peak and end, every category.
    assert [(p.phase, p.start, p.peak, p.end) for p in est.trace.phases] == \
        [(p.phase, p.start, p.peak, p.end) for p in kept.phases]
    assert _optimizer_peaks(est.trace) != _optimizer_peaks(dropped)
