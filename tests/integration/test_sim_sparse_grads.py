"""An embedding with sparse gradients (``nn.Embedding(sparse=True)``) simulates on the CPU target as it runs.

autograd's AccumulateGrad clones a sparse gradient when references to its indices or values other than its own are
held, which a fake tensor's Python object always is (torch/csrc/autograd/functions/accumulate_grad.h), and the fake
kernel's clone of a sparse tensor has no element: the simulated gradient held nothing where the real one holds its
indices (8 B per looked-up index) and a row of values per index. Every estimate with such an embedding was under
from backward's end on (2,176 B here, 16 indices: 128 + 16 x 32 x 4 B), and with Adagrad, whose step peaks with
the gradients held, under at its peak (found by a review). ``CpuKernels`` now clones a sparse tensor as the CPU
does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memprof
from test_train_step import IDS, assert_never_under, assert_same_run, loss_fn, measured, plain


class SparseTiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(96, 32, sparse=True)
        self.head = nn.Linear(32, 96)

    def forward(self, ids):
        return self.head(self.emb(ids))


def _built():
    torch.manual_seed(0)
    return SparseTiny()


def _rewriting(rewrite):
    """The plain step with ``rewrite(model)`` between backward and the optimizer's step: a gradient changed there."""
    def step(model, opt, x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        rewrite(model)
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _own_loss_step(model, opt, x):
    """A step whose model returns its loss."""
    loss = model(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1), lambda ps: torch.optim.Adagrad(ps)],
                         ids=["sgd", "adagrad"])
def test_a_sparse_embedding_gradient_is_the_real_runs(make):
    real = measured(plain, model=_built(), make=make)
    est = memprof.estimate(_built(), make, inputs=IDS, targets=IDS, train_step=plain, steps=2)
    assert_same_run(est, real)
    # The gradients at step 0's backward end: the head's dense ones (96 x 32 + 96 fp32) and the embedding's sparse
    # one, its indices (1 x 16 int64: IDS is a 2 x 8 batch) and values (16 x 32 fp32).
    backward = next(p for p in est.trace.phases if p.step == 0 and p.phase.value == "backward")
    assert backward.end[memprof.Category.GRADIENTS] == (96 * 32 + 96) * 4 + 16 * 8 + 16 * 32 * 4
    assert any("clone (sparse)" in n for n in est.notes), est.notes


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_an_optimizer_op_without_a_meta_kernel_is_named_the_optimizers():
    # Adagrad's sparse step coalesces the gradient and calls sparse_mask, neither of which has a kernel for sparse
    # meta tensors (the GPU target's): the error said an op of the model had none, and to register a fake kernel
    # for it.
    from memprof.errors import SimulationError

    # (Its first such op: the gradient's coalesce, now that the gradient holds elements; sparse_mask after it.)
    with pytest.raises(SimulationError, match=r"_coalesce.*An op of the optimizer's step") as info:
        memprof.estimate(_built(), torch.optim.Adagrad, inputs=IDS, targets=IDS, loss_fn=loss_fn, gpu="h100-80gb")
    assert "of the model" not in str(info.value)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("make", [lambda ps: torch.optim.SparseAdam(ps), lambda ps: torch.optim.Adagrad(ps)],
                         ids=["sparse-adam", "adagrad"])
def test_a_sparse_step_coalesces_every_index_distinct_exactly_and_repeated_never_under(make):
    # SparseAdam's and Adagrad's sparse steps coalesce the gradient (one index per distinct looked-up row) and mask
    # their states by it (sparse_mask: new indices and values): the fake kernels made both empty, and the step's
    # temporaries came out under (528 B for SparseAdam, 176 B for Adagrad on 15 looked-up rows; a sweep's finding).
    # Distinct rows: the real run's to the byte. One row looked up 16 times: the simulation keeps 16, over.
    def step(model, opt, x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    y = torch.randn(2, 8, 4)
    for x, exact in ((torch.arange(16).view(2, 8), True), (torch.zeros(2, 8, dtype=torch.long), False)):
        torch.manual_seed(0)
        real = measured(step, steps=1, model=nn.Embedding(20, 4, sparse=True), make=make, batch=(x, y))
        torch.manual_seed(0)
        est = memprof.estimate(nn.Embedding(20, 4, sparse=True), make, inputs=x, targets=y, train_step=step, steps=1)
        if exact:
            assert_same_run(est, real)
        else:
            assert_never_under(est, real)
            step_peaks = [(a.peak.total, b.peak.total) for a, b in zip(est.trace.phases, real.trace.phases)
                          if a.phase.value == "optimizer"]
            assert step_peaks and all(a > b for a, b in step_peaks), step_peaks  # 16 rows kept where 1 is
        assert any("a sparse tensor coalesced kept every index it was given" in n for n in est.notes), est.notes


class _Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(100, 8, sparse=True, mode="sum")
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.bag(x)).sum()


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_an_embedding_bags_sparse_gradient_with_adagrad():
    # _embedding_bag_backward(sparse=True) makes a row per index; its fake kernel made none, and with Adagrad the
    # estimate came out 31,132 B under (a review's finding). Distinct indices: the real run's to the byte.
    # Repeated: over (the coalesce keeps every index).
    make = lambda ps: torch.optim.Adagrad(ps)  # noqa: E731
    step = _own_loss_step
    for x, exact in ((torch.arange(32).view(4, 8), True), (torch.zeros(4, 8, dtype=torch.long), False)):
        torch.manual_seed(0)
        real = measured(step, model=_Bag(), make=make, batch=(x,))
        torch.manual_seed(0)
        est = memprof.estimate(_Bag(), make, inputs=x, train_step=step, steps=2)
        if exact:
            assert_same_run(est, real)
        else:
            assert_never_under(est, real)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_sgd_momentum_over_a_sparse_gradient_keeps_the_room_of_both_operands(nesterov):
    # SGD's momentum buffer over a sparse gradient: buf.mul_(m).add_(grad) (and with nesterov grad.add(buf), a new
    # sparse tensor). The CPU's sparse add makes indices and values with room for both operands' elements and keeps
    # that room when equal indices merge (add_out_sparse_cpu); the fake kernel kept the buffer's own, or none for a
    # new sum, and the estimate was under from the second step (2,176 B of optimizer states: 16 indices x 8 B and
    # 16 rows x 32 x 4 B). Each step here looks up 16 rows no step before it did: nothing merges, and the run is
    # the real one to the byte. The same rows every step: the real buffer's room stays at 32 elements, the
    # simulation's grows by 16 a step (nothing merges there), over from the third step, never under.
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=nesterov)  # noqa: E731
    calls = []

    def step(model, opt, x, y):
        ids = x + 16 * len(calls)  # rows 0-15, 16-31, 32-47: distinct from every earlier step's
        calls.append(1)
        loss = loss_fn(model(ids), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x = torch.arange(16).view(2, 8)
    real = measured(step, steps=3, model=_built(), make=make, batch=(x, IDS))
    calls.clear()
    est = memprof.estimate(_built(), make, inputs=x, targets=IDS, train_step=step, steps=3)
    assert_same_run(est, real)
    states = [p.end[memprof.Category.OPTIMIZER_STATES] for p in est.trace.phases if p.phase.value == "optimizer"]
    # The head's dense buffer (96 x 32 + 96 fp32: 12,672 B) and the embedding's: 16, 32, then 48 elements of an
    # 8-byte index and a 128-byte row (2,176 B per 16).
    assert states == [12_672 + 2_176 * k for k in (1, 2, 3)], states
    assert any("a sum of sparse tensors merged no equal indices" in n for n in est.notes), est.notes

    real = measured(plain, steps=3, model=_built(), make=make)
    est = memprof.estimate(_built(), make, inputs=IDS, targets=IDS, train_step=plain, steps=3)
    assert_never_under(est, real)
    over = [a.end[memprof.Category.OPTIMIZER_STATES] - b.end[memprof.Category.OPTIMIZER_STATES]
            for a, b in zip(est.trace.phases, real.trace.phases) if a.phase.value == "optimizer"]
    assert over == [0, 0, 2_176], over  # the third step's 16 elements more than the real room of 32


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_sparse_gradient_on_a_cuda_target_holds_its_elements_and_its_step_is_refused():
    # The sparse gradient's clone (AccumulateGrad's, device-independent ATen code) had no element on meta tensors
    # either: a CUDA target's estimate held the embedding's gradient as nothing, and SGD's step over that empty
    # gradient ran, silently under. The clone now holds its indices and values on every target; the step's
    # dense += sparse has no meta kernel (CUDA's kernel is not simulated), and is refused with the optimizer named.
    from memprof.errors import SimulationError

    est = memprof.estimate(_built(), None, inputs=IDS, targets=IDS, loss_fn=loss_fn, gpu="h100-80gb")
    backward = next(p for p in est.trace.phases if p.step == 0 and p.phase.value == "backward")
    # The head's dense gradients (96 x 32 fp32 and 96 fp32), the embedding's 16 indices (int64) and 16 rows of 32
    # fp32, each in the CUDA caching allocator's 512-byte blocks: 12,288 + 512 (384) + 512 (128) + 2,048.
    assert backward.end[memprof.Category.GRADIENTS] == 96 * 32 * 4 + 512 + 512 + 16 * 32 * 4
    assert any("clone (sparse)" in n for n in est.notes), est.notes
    with pytest.raises(SimulationError, match="An op of the optimizer's step"):
        memprof.estimate(_built(), lambda ps: torch.optim.SGD(ps, lr=0.1), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                         gpu="h100-80gb")


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("how", ["maximize", "scaled"])
def test_a_sparse_gradient_negated_or_scaled_keeps_its_elements(how):
    # SGD's maximize negates the gradient (-grad), a step may scale it (p.grad = p.grad * 0.5): the fake kernels of
    # a sparse tensor's elementwise ops made no elements, and the momentum buffer cloned from the result held none:
    # 2,176 B under from step 0's optimizer step (a review's finding). The CPU's keep every element.
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, maximize=how == "maximize")  # noqa: E731

    def halved(model):
        if how == "scaled":
            for p in model.parameters():
                p.grad = p.grad * 0.5

    step = _rewriting(halved)
    x = torch.arange(16).view(2, 8)
    real = measured(step, model=_built(), make=make, batch=(x, IDS))
    est = memprof.estimate(_built(), make, inputs=x, targets=IDS, train_step=step)
    assert_same_run(est, real)
    assert any("an elementwise op's sparse result kept all of its argument's elements" in n for n in est.notes)


class _SparseAdjacency(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.register_buffer("adj", torch.eye(16).to_sparse())  # 2 x 16 int64 indices, 16 fp32 values: 320 B

    def forward(self, x):
        return torch.sparse.mm(self.adj, self.lin(x)).sum()


def test_a_sparse_buffer_holds_its_elements():
    # The twin of a sparse buffer was a strided tensor of its shape's, holding 4 B where the buffer holds 320 B, and
    # sparse.mm over it made other activations and temporaries (a review's finding).
    x = torch.randn(16, 32)
    torch.manual_seed(0)
    real = measured(_own_loss_step, model=_SparseAdjacency(), make=torch.optim.Adam, batch=(x,))
    torch.manual_seed(0)
    est = memprof.estimate(_SparseAdjacency(), torch.optim.Adam, inputs=x, train_step=_own_loss_step)
    assert_same_run(est, real)
    assert est.trace.phases[0].start[memprof.Category.BUFFERS] == 2 * 16 * 8 + 16 * 4


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_dense_tensor_made_sparse_keeps_every_position_never_under():
    # to_sparse()'s element count is the tensor's nonzero positions, which the values decide; its fake kernel made
    # none, and a gradient rebuilt with to_dense().to_sparse() held nothing (20,480 B under, a review's finding).
    # Every position stands for them now: over by the zeros, never under.
    def rebuilt(model):
        model.emb.weight.grad = model.emb.weight.grad.to_dense().to_sparse()

    step = _rewriting(rebuilt)
    make = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    x = torch.arange(16).view(2, 8)
    real = measured(step, model=_built(), make=make, batch=(x, IDS))
    est = memprof.estimate(_built(), make, inputs=x, targets=IDS, train_step=step)
    assert_never_under(est, real)
    # The embedding's 96 x 32 positions: 2 x 3,072 int64 indices and 3,072 fp32 values, and the head's gradients.
    other = next(p for p in est.trace.phases if p.step == 0 and p.phase.value == "other")
    assert other.end[memprof.Category.GRADIENTS] == (96 * 32 + 96) * 4 + 2 * 3_072 * 8 + 3_072 * 4
    assert any("a dense tensor made sparse kept every position" in n for n in est.notes), est.notes


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_coalesced_sparse_gradient_steps_as_the_real_run(momentum):
    # A step that coalesces its sparse gradient: the fake kernel of the parameter's += coalesced sparse gradient
    # reads the values, and the simulation failed (a review's finding). Distinct rows: the real run's to the byte.
    def coalesced(model):
        model.emb.weight.grad = model.emb.weight.grad.coalesce()

    step = _rewriting(coalesced)
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=momentum)  # noqa: E731
    x = torch.arange(16).view(2, 8)
    real = measured(step, model=_built(), make=make, batch=(x, IDS))
    est = memprof.estimate(_built(), make, inputs=x, targets=IDS, train_step=step)
    assert_same_run(est, real)
