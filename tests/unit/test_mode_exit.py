"""A simulation's function mode leaves the stack as it found it, also when a mode entered after it was left there
by an interrupt that cut its entry short (its exit never registered): torch's own exit pops the top blindly."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from memprof.simulate.modes import Rules


class Other(TorchFunctionMode):
    pass


def test_leaving_a_mode_takes_off_what_an_interrupted_entry_left_above_it():
    depth = torch._C._len_torch_function_stack()
    rules = Rules()
    rules.__enter__()
    Other().__enter__()  # pushed, its exit never to run (an interrupt landed right after the push)
    rules.__exit__(None, None, None)
    assert torch._C._len_torch_function_stack() == depth


def test_leaving_a_mode_that_is_not_on_the_stack_pops_nothing():
    depth = torch._C._len_torch_function_stack()
    outer = Other()
    outer.__enter__()
    try:
        rules = Rules()
        rules.__enter__()
        torch._C._pop_torch_function_stack()  # taken off already (an outer cleanup restored the stack's depth)
        rules.__exit__(None, None, None)
        assert torch._C._len_torch_function_stack() == depth + 1  # outer's own mode stays, for outer's exit
    finally:
        outer.__exit__(None, None, None)
    assert torch._C._len_torch_function_stack() == depth
