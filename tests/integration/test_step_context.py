"""``estimate(..., step_context=...)``: the context a training loop enters around forward, loss and backward.

``loss_parallel`` under tensor parallelism (a column-wise head whose logits stay sharded on the vocabulary,
``Shard(-1)``), against the same function and context on real tensors on torch's fake process group, rank 0 of 2,
every category at the peak and the end of every phase of both steps, to the byte. ``context_parallel`` (torch's
ring attention, whose handlers exist only for the CUDA attention ops, so no CPU run can check it) against the
rank's own arithmetic. And the refusals."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C
from memprof.errors import InvalidArgumentError
from phases import assert_same_phases

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

VOCAB, DIM, FFN = 96, 32, 64
IDS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return x + self.w2(F.silu(self.w1(x)))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build() -> nn.Module:
    torch.manual_seed(0)
    return Tiny()


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tp_sharded_logits(model, mesh):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # Megatron's split (Shoeybi et al. 2019, §3), and the head's logits left sharded on the vocabulary for
    # loss_parallel, as torchtitan's plan does (use_local_output=False keeps them a DTensor).
    plan = {"head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.layers)):
        plan[f"layers.{i}.w1"] = ColwiseParallel()
        plan[f"layers.{i}.w2"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _loss_parallel():
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel


def measured_loss_parallel(world: int = 2, rank: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        model = tp_sharded_logits(build(), init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters())
        with memprof.profile(model, opt) as prof:
            for _ in range(2):
                with loss_parallel():
                    loss = loss_fn(model(IDS), IDS)
                    loss.backward()
                opt.step()
                opt.zero_grad()
            del loss
        return prof.report()
    finally:
        dist.destroy_process_group()


def test_loss_parallel_is_simulated_to_the_byte():
    est = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                           world_size=2, parallelize=tp_sharded_logits, step_context=_loss_parallel())
    rep = measured_loss_parallel()
    assert_same_phases(est.trace, rep.trace)
    assert est.peak_bytes == rep.peak.total
    # The logits the loss reads are the rank's half of the vocabulary: 2 x 8 x 48 x 4 B = 3,072 B, where the whole
    # vocabulary's would be 6,144 B; the input ids are the batch, 2 x 8 x 8 B = 128 B.
    assert est.peak[C.INPUTS] == 2 * 8 * 8 == 128
    assert any(n.startswith("step context: each step's forward, loss and backward ran inside loss_parallel")
               for n in est.notes)


def test_without_loss_parallel_the_sharded_logits_fail_as_they_would_in_the_real_loop():
    # The same plan without the context: cross_entropy on vocabulary-sharded logits has no sharding rule
    # outside loss_parallel, so the step fails in the simulation as in a real run: the context is what runs.
    with pytest.raises(memprof.errors.SimulationError, match="mixed torch.Tensor and DTensor"):
        memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                         world_size=2, parallelize=tp_sharded_logits)


def test_refusals():
    with pytest.raises(InvalidArgumentError, match="not an entered or built context"):
        memprof.estimate(build(), inputs=IDS, step_context=torch.no_grad())
    with pytest.raises(InvalidArgumentError, match="not a context manager"):
        memprof.estimate(build(), inputs=IDS, step_context=lambda step: 3)
    with pytest.raises(InvalidArgumentError, match="not an entered or built context"):  # under pipeline= too
        memprof.estimate(build(), inputs=IDS, world_size=2, pipeline=object(), step_context=torch.no_grad())


def test_the_context_is_entered_and_left_at_every_step_around_forward_and_backward():
    seen = []

    @contextlib.contextmanager
    def watch(step):
        seen.append(("enter", tuple(step.inputs.shape), step.mesh, isinstance(step.optimizer, torch.optim.SGD),
                     any(p.grad is not None for p in step.model.parameters())))
        yield
        seen.append(("exit", all(p.grad is not None for p in step.model.parameters())))

    est = memprof.estimate(build(), lambda ps: torch.optim.SGD(ps, lr=0.1), inputs=IDS, step_context=watch)
    # Two steps: entered before the forward (no gradient yet: zero_grad set them to None) and left after the
    # backward (every gradient there), the optimizer step outside; no mesh without parallelize=.
    assert seen == [("enter", (2, 8), None, True, False), ("exit", True)] * 2
    assert any(n.startswith("step context: each step's forward, loss and backward ran inside "
                            "test_the_context_is_entered") for n in est.notes)


SEQ, HEADS = 1024, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(128, 3 * 128, bias=False)
        self.o = nn.Linear(128, 128, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, 128 // HEADS).permute(2, 0, 3, 1, 4)
        # F's attribute read at call time: context_parallel() rebinds it to the ring attention's wrapper.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(b, s, -1))


def _attention_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Attention(), Attention()).bfloat16()


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_holds_the_rank_s_share_of_the_sequence(cp):
    from torch.distributed.tensor.experimental import context_parallel

    shapes = []

    def sharded(step):
        @contextlib.contextmanager
        def around():
            with context_parallel(step.mesh, buffers=[step.inputs], buffer_seq_dims=[1]):
                shapes.append(tuple(step.inputs.shape))  # the batch, sharded in place on the sequence
                yield
            shapes.append(tuple(step.inputs.shape))  # and restored
        return around()

    x = torch.randn(1, SEQ, 128, dtype=torch.bfloat16)
    est = memprof.estimate(_attention_model(), None, inputs=x, device="cuda", world_size=cp,
                           parallelize=lambda model, mesh: model, step_context=sharded, steps=1)
    s = SEQ // cp
    assert shapes == [(1, s, 128), (1, SEQ, 128)]
    # Saved per rank at the end of the forward, bf16 (2 B), b = 1, D = 128, H = 4, s = SEQ / cp tokens, each
    # allocation in 512-byte blocks: per block the q, k, v the ring attention saves (views of the qkv output,
    # s x 3D x 2 = 768 s), its output (s x D x 2 = 256 s), its log-sum-exp (H x s x 4 = 16 s, fp32), the flash
    # kernel's two empty philox tensors (2 x 512), and o's input, a copy (256 s: the ring's output is laid out
    # (b, H, s, hd), so transpose + reshape copies); block 1's qkv also saves block 0's output (256 s). Block 0's
    # qkv input is the batch itself (inputs). 2 x (1,296 s + 1,024) + 256 s = 2,848 s + 2,048.
    forward = next(p for p in est.trace.phases if p.phase.value == "forward")
    assert forward.end[C.ACTIVATIONS] == 2_848 * s + 2_048 == {2: 1_460_224, 4: 731_136}[cp]
    # The ring gathers the other ranks' keys and values: collective buffers.
    assert est.peak[C.COMMUNICATION] > 0
    assert any(n.startswith("context parallelism: attention ran as torch's ring attention") for n in est.notes)


def test_context_parallel_on_a_cpu_target_says_to_estimate_for_cuda():
    from torch.distributed.tensor.experimental import context_parallel

    with pytest.raises(memprof.errors.SimulationError, match="device='cuda'"):
        memprof.estimate(_attention_model(), None, inputs=torch.randn(1, 64, 128, dtype=torch.bfloat16),
                         world_size=2, parallelize=lambda model, mesh: model, steps=1,
                         step_context=lambda step: context_parallel(step.mesh, buffers=[step.inputs],
                                                                    buffer_seq_dims=[1]))
