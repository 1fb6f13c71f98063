"""Expert parallelism over two real gloo processes, each with its own batch and its real routing, against the
simulation of each rank given every rank's recorded routing (``routing=[report0, report1]``): the rank replays its
own router calls, and the counts each other rank sends it come from that rank's record. Every category at the peak
and the end of every phase of both steps, to the byte."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import memprof

from ep_models import IDS_LEN, build, expert_parallel, gloo_rank, loss_fn
from phases import assert_same_phases

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not built in")


@pytest.mark.slow
def test_each_gloo_rank_equals_its_simulation_with_every_rank_s_recorded_routing(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(gloo_rank, args=(2, str(tmp_path)), nprocs=2)
    reports = [memprof.load(tmp_path / f"rank{r}.json") for r in range(2)]
    # Real routing: the two ranks' batches route differently, so each rank's receive side differs.
    assert reports[0].trace.routing.calls != reports[1].trace.routing.calls
    ids = torch.zeros(IDS_LEN, dtype=torch.long)  # shapes only: the routing comes from the records
    for rank, rep in enumerate(reports):
        est = memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=ids, targets=ids, loss_fn=loss_fn,
                               world_size=2, rank=rank, parallelize=expert_parallel, routing=reports)
        assert_same_phases(est.trace, rep.trace, rank)
        assert est.peak_bytes == rep.peak.total
        assert any("every source sent what its recorded run's router chose" in n for n in est.notes)
