"""The optimizer state's signature: equal while the state keeps its tensors, different when one is replaced,
resized or retyped, whichever form (columns of plain tensors, rows otherwise) it takes."""

from __future__ import annotations

import torch

from memprof.collect.step_signature import state_signature


def _adam():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_an_in_place_update_keeps_the_signature():
    model, opt = _adam()
    before = state_signature(opt)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # exp_avg, exp_avg_sq and step updated in place
    assert before is not None and before[0] == "columns"
    assert state_signature(opt) == before


def test_a_state_tensor_replaced_resized_or_retyped_changes_the_signature():
    model, opt = _adam()
    state = opt.state[model.weight]
    before = state_signature(opt)
    state["exp_avg"] = state["exp_avg"].clone()  # same shape and dtype, another storage
    replaced = state_signature(opt)
    assert replaced != before
    state["exp_avg"] = torch.zeros(8, 4)  # resized
    assert state_signature(opt) not in (before, replaced)
    state["exp_avg"] = torch.zeros(3, 4, dtype=torch.float64)  # retyped
    assert state_signature(opt) not in (before, replaced)


def test_a_python_number_in_the_state_takes_the_rows_and_a_subclass_gives_none():
    model, opt = _adam()
    columns = state_signature(opt)
    opt.state[model.bias]["count"] = 3  # a counter kept as a number: its type is compared
    rows = state_signature(opt)
    assert rows is not None and rows[0] != "columns" and rows != columns
    opt.state[model.bias]["count"] = 4
    assert state_signature(opt) == rows  # the counter's value is not compared

    class Sub(torch.Tensor):
        pass

    opt.state[model.bias]["extra"] = torch.zeros(3).as_subclass(Sub)
    assert state_signature(opt) is None
