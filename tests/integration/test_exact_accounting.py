"""Exact mode on CPU: every figure equals an independent count.

Independent counts come from tests/helpers.py, which never imports memprof:
sums of storage sizes (numel * element_size, each storage once).
"""

import gc

import pytest
import torch
from torch import nn

import memprof
from memprof import Category as C

from helpers import (
    LiveBytes,
    assert_sums,
    buffer_bytes,
    grad_bytes,
    optimizer_state_bytes,
    saved_activation_bytes,
    unique_bytes,
    weight_bytes,
)
from models import MLP, MODEL_NAMES, make
from training import train

TENSOR_CATS = [C.WEIGHTS, C.BUFFERS, C.GRADIENTS, C.OPTIMIZER_STATES, C.ACTIVATIONS, C.INPUTS, C.TEMPORARIES]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_states_equal_independent_sums(name):
    model, batch, loss_fn = make(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch
    with memprof.profile(model, opt) as prof:
        loss = loss_fn(model(x), y)
        loss.backward()
        grads_after_backward = grad_bytes(model)
        opt.step()
        states = optimizer_state_bytes(opt)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    rep = prof.report()
    w = weight_bytes(model)  # tied weights once: the head shares the embedding's storage
    b = buffer_bytes(model)
    for step in (0, 1):
        for phase in ("forward", "backward", "optimizer"):
            bd = rep.breakdown(step, phase, "end")
            assert bd[C.WEIGHTS] == w
            assert bd[C.BUFFERS] == b
            assert_sums(bd)
            assert_sums(rep.breakdown(step, phase, "peak"))
    # Gradients: all of them after backward (fp32 grads = fp32 weights here).
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == grads_after_backward == w
    assert rep.breakdown(0, "forward", "end")[C.GRADIENTS] == 0
    # AdamW: exp_avg + exp_avg_sq in the parameter dtype (2 * 4 B/param) + a 4-byte step per parameter.
    n_params = len({p.untyped_storage()._cdata for p in model.parameters()})
    assert states == 2 * w + 4 * n_params
    assert rep.breakdown(0, "optimizer", "end")[C.OPTIMIZER_STATES] == states
    assert rep.breakdown(1, "forward", "end")[C.OPTIMIZER_STATES] == states
    assert rep.breakdown(0, "forward", "end")[C.OPTIMIZER_STATES] == 0  # created lazily by the first step
    assert_sums(rep.peak)
    assert_sums(rep.end)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_saved_activations_equal_independent_hook_count(name):
    model, batch, loss_fn = make(name)
    x, y = batch
    exclude = list(model.parameters()) + list(model.buffers()) + [x, y]
    # Independent count on an identical forward (the models are deterministic).
    expected = saved_activation_bytes(lambda: loss_fn(model(x), y), exclude)
    assert expected > 0
    with memprof.profile(model) as prof:
        loss = loss_fn(model(x), y)
        loss.backward()
    rep = prof.report()
    assert rep.breakdown(0, "forward", "end")[C.ACTIVATIONS] == expected
    # After backward every saved tensor is released.
    assert rep.breakdown(0, "backward", "end")[C.ACTIVATIONS] == 0


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_peak_total_equals_independent_live_bytes(name):
    model, batch, loss_fn = make(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = batch
    pre = list(model.parameters()) + list(model.buffers()) + [x, y]
    counter = LiveBytes(pre)
    with counter:  # the independent counter sits outside memprof's dispatch mode and sees the same ops
        with memprof.profile(model, opt) as prof:
            train(model, opt, batch, loss=loss_fn, steps=2)
        peak = counter.peak
    counter.close()
    rep = prof.report()
    assert rep.peak.total == peak
    assert_sums(rep.peak)


def test_mlp_arithmetic_by_hand():
    # MLP 32 -> 64 -> 64 -> 10, batch 16, fp32, SGD without momentum (no state).
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 32)
    y = torch.randint(0, 10, (16,))
    with memprof.profile(model, opt) as prof:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    rep = prof.report()
    # weights: (32*64 + 64) + (64*64 + 64) + (64*10 + 10) = 2112 + 4160 + 650 = 6922 params * 4 B = 27688
    assert rep.breakdown(0, "forward", "end")[C.WEIGHTS] == 27688
    # inputs: x 16*32*4 = 2048 B, y 16 int64 = 128 B
    assert rep.breakdown(0, "forward", "end")[C.INPUTS] == 2048 + 128
    # saved: fc1 out (relu result, 16*64*4=4096), fc2 input = relu out (same storage as relu result,
    # relu is not in-place here: ReLU saves its result 4096 and fc2 saves it as mat1 - one storage),
    # fc2 out relu result 4096 (saved by relu and by fc3 as mat1), log_softmax result 16*10*4 = 640,
    # nll total_weight 0-dim 4 B. Linear fc1 saves x (an input: excluded).
    assert rep.breakdown(0, "forward", "end")[C.ACTIVATIONS] == 4096 + 4096 + 640 + 4
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == 27688
    assert rep.breakdown(0, "optimizer", "end")[C.OPTIMIZER_STATES] == 0


def test_tied_weights_and_views_count_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head)
    with memprof.profile(model) as prof:
        model(torch.tensor([[1, 2, 3]])).sum().backward()
    rep = prof.report()
    assert rep.breakdown(0, "forward", "end")[C.WEIGHTS] == 10 * 4 * 4  # one 10x4 fp32 storage, not two
    assert rep.breakdown(0, "backward", "end")[C.GRADIENTS] == 10 * 4 * 4


def test_every_breakdown_sums_to_its_total():
    model, batch, loss_fn = make("transformer")
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt) as prof:
        train(model, opt, batch, loss=loss_fn, steps=3)
    tr = prof.trace
    for rec in tr.phases:
        for bd in (rec.start, rec.peak, rec.end):
            assert_sums(bd)
            assert all(v >= 0 for v in bd.counts[:9])
            assert bd[C.ALLOCATOR_OVERHEAD] is None and bd[C.OUTSIDE_TORCH] is None  # CPU: not measured
        assert rec.peak.total >= rec.start.total and rec.peak.total >= rec.end.total
        assert tr.peak.total >= rec.peak.total
    for s in tr.timeline:
        assert_sums(s.breakdown)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


@pytest.mark.parametrize("how", ["cast", "data"])
def test_parameters_cast_or_given_new_data_inside_the_block_are_weights(how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    with memprof.profile(model, mode="exact") as prof:
        if how == "cast":
            model.to(torch.bfloat16)  # Module._apply assigns param.data
        else:
            for p in model.parameters():
                p.data = p.data.clone()
        dtype = next(model.parameters()).dtype
        model(torch.randn(4, 64, dtype=dtype)).float().sum().backward()
    end = prof.report().end
    # (64*64 + 64 + 64*8 + 8) elements x 2 bytes (bf16) or x 4 (fp32), each storage once.
    assert end[C.WEIGHTS] == weight_bytes(model) == 4680 * (2 if how == "cast" else 4)
    assert end[C.GRADIENTS] == unique_bytes(p.grad for p in model.parameters())


def test_parameters_replaced_by_load_state_dict_assign_are_weights():
    # A new Parameter can take the id() of a freed one; memprof must not mistake it for the old one.
    for _ in range(5):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with memprof.profile(model, mode="exact") as prof:
            model.load_state_dict(state, assign=True)
            model(torch.randn(4, 64)).sum().backward()
        end = prof.report().end
        assert end[C.WEIGHTS] == weight_bytes(model)  # 4680 fp32 elements = 18,720 bytes
        assert end[C.GRADIENTS] == unique_bytes(p.grad for p in model.parameters())
        del model, state, prof
        gc.collect()


def _temporaries_holding(make):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with memprof.profile(model, mode="exact") as prof:
        loss = model(torch.randn(2, 4)).sum()
        held = make()  # alive across the backward
        loss.backward()
    assert held.untyped_storage().nbytes() == 4000
    return prof.report().breakdown(0, "backward", "end")


@pytest.mark.parametrize("grow", ["resize_", "out="])
def test_storages_grown_in_place_count_as_a_fresh_allocation_of_their_size(grow):
    fresh = _temporaries_holding(lambda: torch.empty(1000))  # 1000 fp32 = 4,000 bytes
    if grow == "resize_":
        grown = _temporaries_holding(lambda: torch.empty(0).resize_(1000))
    else:  # an out= argument that torch resizes to 20 x 50 fp32 = 4,000 bytes
        grown = _temporaries_holding(lambda: torch.mm(torch.randn(20, 50), torch.randn(50, 50),
                                                      out=torch.empty(0)))
    assert grown[C.TEMPORARIES] == fresh[C.TEMPORARIES]
    assert grown.total == fresh.total


class _PlainAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.table = torch.randn(512, 256)  # a plain tensor attribute, not a registered buffer

    def forward(self, x):
        return self.lin(x + self.table[: x.shape[1]])


def test_a_plain_tensor_attribute_of_a_module_is_counted_as_a_buffer():
    model = _PlainAttribute()
    with memprof.profile(model, mode="exact") as prof:
        model(torch.randn(2, 128, 256)).sum().backward()
    rep = prof.report()
    assert rep.peak[C.BUFFERS] == model.table.untyped_storage().nbytes() == 512 * 256 * 4


def test_parameters_added_inside_the_block_become_weights():
    model, x = _mlp(), torch.randn(8, 16)
    with memprof.profile(model) as prof:
        model(x).sum().backward()
        model.add_module("extra", nn.Linear(4, 4))  # a new head, not yet used
        model.extra2 = nn.Parameter(torch.zeros(1000))
        model(x).sum().backward()
    rep = prof.report()
    # 676 + 20 + 1,000 fp32 parameters = 6,784 B; none of them counted as temporaries.
    assert rep.end[C.WEIGHTS] == weight_bytes(model) == (676 + 20 + 1000) * 4
    assert any("changed during profiling (step 1: 3 parameter(s) (4.0 KiB) and 1 module(s))" in n
               for n in rep.trace.notes)
    assert rep.breakdown(1, "forward", "start")[C.WEIGHTS] == rep.end[C.WEIGHTS]


def test_lazy_modules_are_measured():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    with memprof.profile(model, opt) as prof:
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    rep = prof.report()
    # (3*8 + 8) + (8*2 + 2) = 50 fp32 parameters, and as many gradient elements.
    assert rep.end[C.WEIGHTS] == weight_bytes(model) == 200
    assert rep.end[C.GRADIENTS] == 200
    assert rep.breakdown(1, "forward", "start")[C.TEMPORARIES] == 0


def test_tensors_made_with_torch_tensor_are_counted():
    model = _mlp()
    with memprof.profile(model) as prof:
        keep = torch.tensor([1.0] * 262144)  # built in C++, seen by dispatch only as lift_fresh
        model(torch.randn(2, 16)).sum().backward()
    rep = prof.report()
    assert rep.end[C.TEMPORARIES] == keep.untyped_storage().nbytes() == 1048576
    assert rep.end.total == sum(v for v in rep.end.counts if v is not None)
