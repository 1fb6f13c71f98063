"""Inputs memprof's module hooks cannot describe never break the user's step.

The hooks describe each module call of the first forward (shapes and dtype, for the per-module formula).
A tensor that a shape and a dtype do not size (a jagged nested tensor, whose ragged size is symbolic; a
sparse tensor; a subclass whose ``shape`` raises) must not raise into the step: the step runs exactly as
without memprof, the report notes what could not be described, and the formula is not predicted rather
than predicted from part of the model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memprof
from memprof.anatomy.predict import predict_activations
from memprof.record.specs import NotDescribed, TensorSpec
from tests.helpers import hooks_left


class ShapeRaises(torch.Tensor):
    """A subclass whose size cannot be read (a library's tensor whose shape depends on state it lacks)."""

    @property
    def shape(self):  # type: ignore[override]
        raise RuntimeError("this tensor has no shape to tell")


class Head(nn.Module):
    """A Linear on whatever the batch is: a jagged nested tensor goes through the Linear as it is, the
    others are made dense first."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        if x.is_nested:
            return self.lin(x).values()
        if x.layout is not torch.strided:
            x = x.to_dense()
        return self.lin(x.as_subclass(torch.Tensor))


def batch(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "jagged":
        return torch.nested.nested_tensor([torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)],
                                          layout=torch.jagged, requires_grad=True)
    if kind == "sparse":
        return torch.randn(3, 4, generator=g).to_sparse()
    return torch.randn(3, 4, generator=g).as_subclass(ShapeRaises)


WHY = {"jagged": "took a NestedTensor of layout jagged", "sparse": "took a Tensor of layout sparse_coo",
       "subclass": "took a ShapeRaises whose shape or dtype cannot be read (RuntimeError: this tensor has no shape"}


def train(kind: str, mode: "str | None"):
    """Two steps of SGD on the batch; what the step computed (outputs, input gradient, weights) and the report."""
    torch.manual_seed(0)
    model = Head()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = batch(kind)
    outs, grads = [], []

    def step():
        out = model(x)
        out.sum().backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach().clone())
        if x.grad is not None:
            # torch cannot accumulate into a nested gradient (aten::stride, with or without memprof): kept and cleared
            grads.append(x.grad.values().clone())
            x.grad = None

    if mode is None:
        step()
        step()
        report = None
    else:
        with memprof.profile(model, opt, mode=mode) as prof:
            step()
            step()
        report = prof.report()
        assert hooks_left(model) == []
    return outs, grads, [p.detach().clone() for p in model.parameters()], report


@pytest.mark.parametrize("mode", ["exact", "light"])
@pytest.mark.parametrize("kind", ["jagged", "sparse", "subclass"])
def test_a_step_on_an_input_memprof_cannot_describe_runs_as_without_it(kind, mode):
    outs, grads, params, report = train(kind, mode)
    ref_outs, ref_grads, ref_params, _ = train(kind, None)
    assert len(outs) == 2 and all(torch.equal(a, b) for a, b in zip(outs, ref_outs, strict=True))
    assert len(grads) == (2 if kind == "jagged" else 0)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    notes = [n for n in report.trace.notes if "memprof cannot describe the call" in n]
    assert len(notes) == 1 and f"module <model> {WHY[kind]}" in notes[0], report.trace.notes
    # Not a formula summed over the calls described before the one that was not: no formula at all.
    assert report.trace.module_calls == ()
    assert predict_activations(report.trace).saved_bytes is None


def test_a_call_that_returns_what_cannot_be_described_ends_the_capture_too():
    class Nest(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return torch.nested.nested_tensor_from_jagged(self.lin(x), offsets=torch.tensor([0, 1, 3]))

    model = Nest()
    x = torch.randn(3, 4)
    with memprof.profile(model, mode="exact") as prof:
        model(x).values().sum().backward()
    notes = [n for n in prof.report().trace.notes if "cannot describe" in n]
    assert notes == ["module <model> returned a NestedTensor of layout jagged: memprof cannot describe the call, "
                     "so the per-module formula is not predicted"]
    assert prof.report().trace.module_calls == ()


def test_a_spec_says_why_it_cannot_be_made():
    x = batch("jagged")
    with pytest.raises(NotDescribed, match="layout jagged"):
        TensorSpec.of(x)
    with pytest.raises(NotDescribed, match="whose shape or dtype cannot be read"):
        TensorSpec.of(batch("subclass"))
    # A plain tensor, and the dense values of the nested one, are described as before.
    assert TensorSpec.of(x.values()) == TensorSpec((8, 4), "float32")


def _raising(attribute: str) -> type:
    class Raises(torch.Tensor):
        """A subclass one of whose attributes raises when read."""

        def __getattribute__(self, name):
            if name == attribute:
                raise RuntimeError(f"no {name} to tell")
            return super().__getattribute__(name)

    return Raises


# Where memprof reads each attribute, and the note that says what it could not measure.
RAISING = {"device": ["an input of the model could not be read (RuntimeError: no device to tell): what it holds is "
                      "not counted among inputs"],
           "requires_grad": ["module <model> holds something it cannot read (RuntimeError: no requires_grad to tell): "
                             "memprof cannot describe the call, so the per-module formula is not predicted"]}


@pytest.mark.parametrize("mode", ["exact", "light"])
@pytest.mark.parametrize("attribute", sorted(RAISING))
def test_an_input_whose_attributes_raise_runs_as_without_memprof(attribute, mode):
    def run(profiled: bool):
        torch.manual_seed(0)
        model = Head()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).as_subclass(_raising(attribute))
        if not profiled:
            out = model(x)
            out.sum().backward()
            opt.step()
            return out.detach(), list(model.parameters()), None
        with memprof.profile(model, opt, mode=mode) as prof:
            out = model(x)
            out.sum().backward()
            opt.step()
        assert hooks_left(model) == []
        return out.detach(), list(model.parameters()), prof.report()

    out, params, report = run(True)
    ref_out, ref_params, _ = run(False)
    assert torch.equal(out, ref_out) and all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    expected = list(RAISING[attribute])
    if attribute == "requires_grad" and mode == "exact":  # the per-module backward frames read it too
        expected.append("module <model>: a tensor it took or returned could not be read (RuntimeError: no "
                        "requires_grad to tell), so its per-module backward figures are not measured")
    assert sorted(n for n in report.trace.notes if "to tell" in n) == sorted(expected)


@pytest.mark.parametrize("mode", ["exact", "light"])
def test_a_jagged_batch_is_counted_as_inputs(mode):
    # A nested tensor holds its data in tensors of its own (values, offsets): those are the batch's bytes,
    # never left out of every category. values: 8 x 4 float32 = 128 B; offsets: 3 int64 = 24 B.
    model, x = Head(), batch("jagged")
    expected = x.values().untyped_storage().nbytes() + x.offsets().untyped_storage().nbytes()
    assert expected == 8 * 4 * 4 + 3 * 8
    with memprof.profile(model, mode=mode) as prof:
        model(x).sum().backward()
    assert prof.report().peak[memprof.Category.INPUTS] == expected


@pytest.mark.parametrize("mode", ["exact", "light"])
@pytest.mark.parametrize("attribute", ["is_cpu", "layout"])
def test_a_saved_tensor_whose_attributes_raise_leaves_activations_not_measured(attribute, mode):
    # The Linear saves its input, a subclass whose is_cpu or layout raises: memprof's pack reads both. The step
    # runs as without memprof, and the activations it could not count are not measured, never 0.
    def run(profiled: bool):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).as_subclass(_raising(attribute))
        if not profiled:
            model(x).sum().backward()
            return list(model.parameters()), None
        with memprof.profile(model, mode=mode) as prof:
            model(x).sum().backward()
        assert hooks_left(model) == []
        return list(model.parameters()), prof.report()

    params, report = run(True)
    ref_params, _ = run(False)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(params, ref_params, strict=True))
    assert report.peak[memprof.Category.ACTIVATIONS] is None
    assert any("autograd saved a Raises whose device or layout cannot be read (RuntimeError): activations are "
               "not measured" == n for n in report.trace.notes)

