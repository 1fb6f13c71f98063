"""A token-choice mixture of experts split over expert-parallel ranks, as torchtitan and transformers' ``AllToAllEP``
write it: the router's top-k, per-expert counts exchanged with a first all-to-all, the tokens dispatched and
combined with ``all_to_all_single_autograd`` whose split sizes are the counts read back with ``tolist()``.

And what a measured run of it on torch's fake process group needs to route as a simulation assumes:
:class:`BalancedTopk` overwrites each router top-k's indices with the balanced choice (token ``t``'s ``j``-th pick is
expert ``(t * k + j) mod E``), and :class:`PeersLikeThisRank` writes the counts an all-to-all receives as peers that
route alike would send them (the fake process group moves no data). Both write in place: nothing is allocated."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

E, K, DIM, HID, VOCAB = 8, 2, 32, 64, 64
IDS_LEN = 24  # tokens per rank: 48 picks, 6 per expert when balanced


class MoE(nn.Module):
    """``E`` experts (SwiGLU-free: silu between two matmuls), top-``K`` routing; ``exchange`` is how the counts
    travel: ``"funcol"`` (the functional all-to-all) or ``"c10d"`` (``dist.all_to_all_single`` in place)."""

    def __init__(self, exchange: str = "funcol") -> None:
        super().__init__()
        self.router = nn.Linear(DIM, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, DIM, HID) * 0.02)
        self.w2 = nn.Parameter(torch.randn(E, HID, DIM) * 0.02)
        self.group = None
        self.exchange = exchange

    def forward(self, x):
        t = x.shape[0]
        top, idx = self.router(x).softmax(-1).topk(K, dim=-1)
        flat = idx.flatten()
        order = flat.argsort(stable=True)  # (token, pick) pairs grouped by expert, so by owning rank
        routed = x[order // K]
        counts = torch.bincount(flat, minlength=E)
        local = self.w1.shape[0]
        ep = E // local
        if self.exchange == "funcol":
            recv_counts = funcol.all_to_all_single(counts, None, None, self.group)
        else:
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=self.group)
        send = counts.view(ep, local).sum(1).tolist()
        recv = recv_counts.view(ep, local).sum(1).tolist()
        got = funcol.all_to_all_single_autograd(routed, recv, send, self.group)
        # The received rows come grouped by source rank, then by local expert: regroup them by local expert.
        ids = torch.arange(local).repeat(ep).repeat_interleave(recv_counts.flatten(), output_size=sum(recv))
        by_expert = ids.argsort(stable=True)
        chunks = got[by_expert].split(recv_counts.view(ep, local).sum(0).tolist())
        y = torch.cat([F.silu(c @ self.w1[e]) @ self.w2[e] for e, c in enumerate(chunks)])
        back = funcol.all_to_all_single_autograd(y[by_expert.argsort()], send, recv, self.group)
        out = back[order.argsort()]
        return (out.view(t, K, -1) * top.unsqueeze(-1)).sum(1)


class Block(nn.Module):
    def __init__(self, exchange: str) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.moe = MoE(exchange)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class Net(nn.Module):
    """Embedding, ``layers`` MoE blocks, an untied head; called with a 1-D batch of token ids."""

    def __init__(self, exchange: str = "funcol", layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(exchange) for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build(exchange: str = "funcol") -> Net:
    torch.manual_seed(0)
    return Net(exchange)


def loss_fn(logits, targets):
    return F.cross_entropy(logits, targets)


def expert_parallel(model, mesh):
    """Each rank keeps its ``E / EP`` experts' weights (a contiguous range, as GShard and torchtitan place them)."""
    r, n = mesh.get_local_rank(), mesh.size()
    local = E // n
    for block in model.layers:
        moe = block.moe
        moe.w1 = nn.Parameter(moe.w1.detach()[r * local:(r + 1) * local].clone())
        moe.w2 = nn.Parameter(moe.w2.detach()[r * local:(r + 1) * local].clone())
        moe.group = mesh.get_group()
    return model


class BalancedTopk(TorchFunctionMode):
    """Every floating top-k's indices rewritten in place to the balanced choice: row ``t``'s ``j``-th pick is
    ``(t * k + j) mod n`` (no row picks one expert twice while ``k <= n``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.topk, torch.Tensor.topk) and args[0].is_floating_point():
            scores, idx = args[0], out[1]
            rows, k, n = idx.shape[0], idx.shape[1], scores.shape[-1]
            with torch._C._DisableTorchDispatch():
                # .data: not a modification autograd tracks (topk saves its indices for backward)
                idx.data.copy_((torch.arange(rows * k) % n).view(rows, k))
        return out


class PeersLikeThisRank(TorchDispatchMode):
    """The counts an integer all-to-all receives, as peers that route like this rank send them: from every
    source, this rank's chunk of what it sends itself (equal chunks, one per rank)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if "all_to_all_single" in name or "alltoall_base_" in name:
            if "_c10d_functional" in name:
                sent, filled, group = args[0], out, _group(args[3] if len(args) > 3 else None, named=True)
            else:
                sent, filled, group = args[1], args[0], _group(args[2] if len(args) > 2 else None, named=False)
            if not sent.is_floating_point():
                n, r = dist.get_world_size(group), dist.get_rank(group)
                with torch._C._DisableTorchDispatch():
                    mine = sent.chunk(n)[r]
                    filled.copy_(torch.cat([mine] * n))
        return out


def _group(handle, named: bool):
    """The process group an all-to-all runs on (its EP group, a subgroup where EP is not every rank), from the op's
    group name or its boxed process group; the world's where it says none."""
    from torch._C._distributed_c10d import ProcessGroup, _resolve_process_group

    if handle is None:
        return dist.group.WORLD
    return _resolve_process_group(handle) if named else ProcessGroup.unbox(handle)


def gloo_rank(rank: int, world: int, folder: str) -> None:
    """One rank of a real expert-parallel run over gloo: its own batch, its real routing recorded
    (``record_routing=True``), the estimate's loop, the report saved as ``rank<r>.json`` in ``folder``."""
    import os

    import memprof
    from gloo_settled import join_gloo, settle_collectives
    from torch.distributed.device_mesh import init_device_mesh

    settle_collectives()
    join_gloo(rank, world, os.path.join(folder, "store"))
    try:
        model = expert_parallel(build(), init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, VOCAB, (IDS_LEN,), generator=torch.Generator().manual_seed(100 + rank))
        with memprof.profile(model, opt, record_routing=True) as prof:
            for _ in range(2):
                loss = loss_fn(model(ids), ids)
                loss.backward()
                opt.step()
                opt.zero_grad()
            del loss
        prof.report().save(os.path.join(folder, f"rank{rank}.json"))
    finally:
        dist.destroy_process_group()
