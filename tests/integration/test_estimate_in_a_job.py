"""``estimate(parallelize=...)`` from inside a running job (a pre-flight check after ``init_process_group``): the
simulation runs its fake ranks with the job's world set aside, gives the figures it gives outside a job, and
leaves the job's process groups as they were, every one still working."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import distributed_c10d as c10d


from test_parallelize import fsdp_bf16, simulated


def _phases(est) -> list:
    return [(p.step, p.phase, p.occurrence, p.peak.counts, p.end.counts) for s in est.trace.steps for p in s.phases]


def test_an_estimate_inside_a_gloo_job_leaves_the_jobs_groups_as_they_were(tmp_path):
    outside = simulated(fsdp_bf16, 2, 1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        default = c10d._get_default_group()
        pair = dist.new_group([0])  # a second group of the job's, with its own name
        names = dict(c10d._world.pg_names)
        inside = simulated(fsdp_bf16, 2, 1)  # rank 1 of 2, while this process is rank 0 of 1
        # The same figures as outside a job.
        assert inside.peak_bytes == outside.peak_bytes and _phases(inside) == _phases(outside)
        assert inside.trace.distributed.world_size == 2 and inside.trace.distributed.rank == 1
        # The job's world: the same objects, rank, size and backend, every group by its name.
        assert dist.is_initialized() and c10d._get_default_group() is default
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "gloo")
        assert dict(c10d._world.pg_names) == names
        for pg, name in names.items():
            assert c10d._resolve_process_group(name) is pg  # functional collectives find them by name
        # And they work.
        t = torch.ones(3)
        dist.all_reduce(t)
        dist.all_reduce(t, group=pair)
        assert torch.equal(t, torch.ones(3))
        assert torch.equal(funcol.all_reduce(torch.ones(2), "sum", default), torch.ones(2))
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()
