"""A storage that changes category more than once: the peaks keep what it was when they were reached."""

from __future__ import annotations

import torch

from memprof.collect.ledger import COMMUNICATION, GRADIENTS, TEMPORARIES, Ledger
from memprof.collect.moves import move


def _storage(n: int):
    return torch.empty(n, dtype=torch.uint8).untyped_storage()


def test_a_retro_move_then_another_keeps_the_peak_consistent():
    # FSDP's reduce-scatter output: made as a temporary (the peak is reached then), revealed as a collective's
    # buffer (retro), then as the sharded gradient (retro again). At the peak it was both, in turn: the peak
    # ends up holding it as a gradient, and never a negative category.
    led = Ledger()
    led.start_phase()
    keep = _storage(100)
    led.add(keep, TEMPORARIES)
    out = _storage(40)
    entry = led.add(out, TEMPORARIES)
    assert led.phase_peak[TEMPORARIES] == 140 and led.peak_total == 140
    move(led, entry, COMMUNICATION, retro=True)
    move(led, entry, GRADIENTS, retro=True)
    assert (led.phase_peak[TEMPORARIES], led.phase_peak[COMMUNICATION], led.phase_peak[GRADIENTS]) == (100, 0, 40)
    assert led.peak[GRADIENTS] == 40 and min(led.peak) >= 0
    del keep


def test_a_move_after_the_peak_is_not_read_back_into_it():
    # Moved (not retro) after the peak, then moved retro: at the peak it was still a temporary, so the retro
    # move takes it from there, not from the category it only joined later.
    led = Ledger()
    led.start_phase()
    a = _storage(64)
    entry = led.add(a, TEMPORARIES)  # the peak: 64 bytes of temporaries
    move(led, entry, COMMUNICATION)  # after the peak
    move(led, entry, GRADIENTS, retro=True)
    assert (led.phase_peak[TEMPORARIES], led.phase_peak[COMMUNICATION], led.phase_peak[GRADIENTS]) == (0, 0, 64)
    assert (led.totals[COMMUNICATION], led.totals[GRADIENTS]) == (0, 64)
