"""``estimate(..., parallelize=fn, rank=r)`` against real processes: the same ``fn`` run by 2 (and 4) processes
over gloo, each profiling itself, every rank's phases equal to its simulation in every category at the peak and
the end of every phase, to the byte. Real collectives move real data here; the simulation's fake process group
moves none, and the memory must not differ."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import memprof

from gloo_settled import join_gloo, settle_collectives
from test_parallelize import IDS, assert_equal_everywhere, build, fsdp_bf16, loss_fn, simulated, tp_sp

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


def fsdp_tp_sp(model, mesh):
    """FSDP 2 x TP 2: Megatron's split with sequence parallelism inside each rank's tp group, FSDP2 with bf16
    gathers over dp."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    tp_sp(model, mesh["tp"])
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=mp)
    return fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


LAYOUTS = {"fsdp_bf16": (fsdp_bf16, None), "fsdp_tp_sp": (fsdp_tp_sp, {"dp": 2, "tp": 2})}


def _worker(rank: int, world: int, name: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    settle_collectives()
    fn, mesh = LAYOUTS[name]
    join_gloo(rank, world, f"{out}/store")
    try:
        device_mesh = (init_device_mesh("cpu", (world,)) if mesh is None
                       else init_device_mesh("cpu", tuple(mesh.values()), mesh_dim_names=tuple(mesh)))
        model = fn(build(), device_mesh)
        opt = torch.optim.AdamW(model.parameters())
        with memprof.profile(model, opt) as prof:  # the estimate's loop: two steps, the loss held through each
            for _ in range(2):
                loss = loss_fn(model(IDS), IDS)
                loss.backward()
                opt.step()
                opt.zero_grad()
            del loss
        prof.report().save(f"{out}/rank{rank}.json")
        dist.barrier()  # no rank tears gloo down before the others are done
    finally:
        dist.destroy_process_group()


def _run(tmp_path, name: str, world: int) -> "list[memprof.Report]":
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, name, str(tmp_path)), nprocs=world, join=True)
    return [memprof.load(tmp_path / f"rank{r}.json") for r in range(world)]


@pytest.mark.slow
def test_fsdp2_bf16_on_two_gloo_processes_is_its_simulation(tmp_path):
    reports = _run(tmp_path, "fsdp_bf16", 2)
    for rank, rep in enumerate(reports):
        assert (rep.trace.distributed.rank, rep.trace.distributed.backend) == (rank, "gloo")
        est = simulated(fsdp_bf16, 2, rank)
        assert_equal_everywhere(est, rep)
        assert est.trace.distributed.layout_detail == rep.trace.distributed.layout_detail
    merged = memprof.merge(reports)
    assert merged.worst in (0, 1) and not merged.simulated
