"""merge() (memprof.analyse.merge) on hand-built traces of ranks: which ranks are given and missing, the worst
rank, the spread of the peaks, the whole text (memprof.render.text.merged_text), each rank against a
budget, and every refusal."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from memprof.analyse.budget import Judged, check_budget
from memprof.analyse.merge import merge
from memprof.errors import InvalidArgumentError, MemoryBudgetExceeded, MergeError
from memprof.record.layout import MeshLayout
from memprof.record.parts import RankInfo
from memprof.report.reports import Report
from memprof.render.text import merged_text
from memprof.report.ranks import merge as merge_reports

from factories import bd, cpu, facts, phase, trace


def _rank(rank: int, world: int, activations: int, *, layout: str = "ddp", params: int = 1024, light=False):
    """One rank's one step: 4 KiB of weights, ``activations`` bytes saved at the forward's peak."""
    if light:  # light mode on CPU: temporaries and the total not measured
        peak = bd(None, weights=4096, buffers=0, gradients=0, optimizer_states=0, activations=activations, inputs=0)
        start = end = bd(None, weights=4096, buffers=0, gradients=0, optimizer_states=0, activations=0, inputs=0)
    else:
        peak, start, end = cpu(weights=4096, activations=activations), cpu(weights=4096), cpu(weights=4096)
    return trace(phases=(phase(0, "forward", start=start, peak=peak, end=end),), num_steps=1,
                 mode="light" if light else "exact", facts=facts(num_params=params),
                 distributed=RankInfo(rank=rank, world_size=world, backend="gloo", layout=layout, bucket_view=False))


def test_ranks_are_sorted_the_worst_named_and_the_missing_listed():
    # Peaks: rank 0 4096 + 1024 = 5,120 B; rank 1 4096 + 8192 = 12,288 B; rank 3 4096 + 2048 = 6,144 B.
    ranks = [_rank(1, 4, 8192), _rank(0, 4, 1024), _rank(3, 4, 2048)]
    m = merge(ranks)
    assert list(m.ranks) == [0, 1, 3] and m.ranks[1] is ranks[0]
    assert (m.world_size, m.missing, m.worst) == (4, (2,), 1)
    # max - min = 12,288 - 5,120 = 7,168 B; mean = 23,552 / 3; max / mean = 12,288 * 3 / 23,552 = 1.5652...
    assert m.spread == (7168, pytest.approx(12288 * 3 / 23552))
    assert m.notes == ("ranks 2 of 4 were not given",)
    assert merged_text(m) == textwrap.dedent("""\
        memprof merge: 3 of 4 rank(s); worst rank 1
          spread of the peaks: 7.0 KiB (max - min), max/mean 1.565
          rank          peak  where                 largest at the peak
             0       5.0 KiB  step 0 forward        weights 4.0 KiB
             1      12.0 KiB  step 0 forward        activations 8.0 KiB *
             3       6.0 KiB  step 0 forward        weights 4.0 KiB
          - ranks 2 of 4 were not given""")


def test_equal_peaks_name_the_lowest_rank():
    m = merge([_rank(1, 2, 1024), _rank(0, 2, 1024)])
    assert (m.worst, m.spread, m.missing, m.notes) == (0, (0, 1.0), (), ())


def test_unmeasured_peaks_name_no_worst_rank_and_no_spread():
    m = merge([_rank(0, 2, 1024, light=True), _rank(1, 2, 2048, light=True)])
    assert m.spread is None
    assert m.worst == 0  # no peak was measured: every rank ties, and the lowest is named
    assert m.notes == ("a rank's peak total was not measured (light mode on CPU): the worst rank and the spread "
                       "compare what was measured only",)
    assert merged_text(m) == textwrap.dedent("""\
        memprof merge: 2 of 2 rank(s); peaks not measured on every rank
          rank          peak  where                 largest at the peak
             0  not measured  step 0 forward        weights 4.0 KiB
             1  not measured  step 0 forward        weights 4.0 KiB
          - a rank's peak total was not measured (light mode on CPU): the worst rank and the spread compare what was measured only""")


def test_missing_ranks_are_named_in_stretches():
    m = merge([_rank(r, 1000, 8) for r in (0, 2, 3, 5, 9)])
    # 1; 4; 6, 7, 8; 10 .. 999: two neighbours are listed, three or more are a stretch.
    assert m.notes == ("ranks 1, 4, 6-8, 10-999 of 1000 were not given",)
    assert len(m.missing) == 995


def test_each_rank_is_judged_against_a_budget():
    m = merge_reports([_rank(0, 2, 1024), _rank(1, 2, 8192)])
    # The worst rank's result: rank 1, 4096 + 8192 = 12,288 B.
    assert check_budget(m, total=12_288)["total"] == Judged(12_288, 12_288)
    with pytest.raises(MemoryBudgetExceeded) as info:
        check_budget(m, total=5120)  # rank 0 is at 5,120 B, within; rank 1 is over
    assert str(info.value) == ("rank(s) 1 of 2 over budget; rank 1: memory budget exceeded (1 of 1 budget(s)):")
    assert info.value.overruns == {"total": Judged(5120, 12_288)}


def test_what_is_not_the_ranks_of_one_run_is_refused():
    cases = [
        ([], "merge() needs at least one report (one per rank)"),
        ([_rank(0, 2, 8), _rank(0, 2, 8)], "rank 0 is given twice (report 1 is one); give each rank's report once"),
        ([_rank(0, 2, 8), _rank(1, 4, 8)], "the ranks have different world sizes: rank 0 is of a world of 2; rank 1 is "
                                           "of a world of 4: not the ranks of one run"),
        ([_rank(0, 2, 8, params=5), _rank(1, 2, 8)],
         "the reports profile models of different sizes ([5, 1024] parameters on the rank): not the ranks of one run"),
        ([_rank(2, 2, 8)], "rank(s) [2] do not exist in a world of 2"),
        ([trace(num_steps=0)], "report 0 was not profiled inside a torch.distributed process group (its trace records "
                               "no rank); profile each rank after init_process_group"),
    ]
    for given, message in cases:
        with pytest.raises(MergeError) as info:
            merge(given)
        assert str(info.value) == message
    takes = "merge() takes a list of reports or paths of saved traces (Traces too), one per rank"
    for given, message in ((_rank(0, 1, 8), f"{takes}; got one Trace: put it in a list"),
                           ("rank0.json", f"{takes}; got one str: put it in a list"),
                           (3, f"{takes}, got int"), ([3], f"{takes}, got int in the list")):
        with pytest.raises(InvalidArgumentError) as info:
            merge(given)
        assert str(info.value) == message


# ------------------------------------------------------------------ ranks of one run: layouts, and simulated ranks


def _with(t, **info):
    """``t`` with its rank record changed."""
    return dataclasses.replace(t, distributed=dataclasses.replace(t.distributed, **info))


def _meshed(t, *mesh):
    return _with(t, layout_detail=MeshLayout(mesh=tuple(mesh), groups=()))


def test_ranks_of_different_layouts_backends_or_meshes_are_refused_naming_each():
    # Each was a merge of "one run" before (a note at most): the layout, backend and mesh are the run's.
    cases = [
        ([_rank(0, 2, 8), _rank(1, 2, 8, layout="fsdp2")],
         "the ranks have different parallel layouts (measured ranks): rank 0 is ddp over gloo; rank 1 is fsdp2 over "
         "gloo: not the ranks of one run"),
        ([_rank(0, 4, 8), _with(_rank(1, 4, 8), backend="nccl"), _rank(2, 4, 8), _rank(3, 4, 8)],
         "the ranks have different parallel layouts (measured ranks): ranks 0, 2, 3 are ddp over gloo; rank 1 is ddp "
         "over nccl: not the ranks of one run"),
        ([_meshed(_rank(0, 4, 8, layout="fsdp2"), ("dp_shard", 4)),
          _meshed(_rank(1, 4, 8, layout="fsdp2"), ("dp_replicate", 2), ("dp_shard", 2))],
         "the ranks have different parallel layouts (measured ranks): rank 0 is fsdp2 over gloo on mesh dp_shard=4; "
         "rank 1 is fsdp2 over gloo on mesh dp_replicate=2 x dp_shard=2: not the ranks of one run"),
        ([_meshed(_rank(0, 2, 8, layout="fsdp2"), ("dp_shard", 2)), _rank(1, 2, 8, layout="fsdp2")],
         "the ranks have different parallel layouts (measured ranks): rank 0 is fsdp2 over gloo on mesh dp_shard=2; "
         "rank 1 is fsdp2 over gloo: not the ranks of one run"),
        # Two simulated ranks of different layouts (memprof's layout simulation records no backend).
        ([_with(_rank(0, 2, 8), backend=None), _with(_rank(1, 2, 8, layout="fsdp"), backend=None)],
         "the ranks have different parallel layouts (simulated ranks): rank 0 is ddp; rank 1 is fsdp: not the ranks "
         "of one run"),
    ]
    for given, message in cases:
        with pytest.raises(MergeError) as info:
            merge(given)
        assert str(info.value) == message


def test_the_files_of_the_ranks_that_differ_are_named(tmp_path):
    paths = []
    for r, t in enumerate([_rank(0, 2, 8), _rank(1, 2, 8, layout="fsdp2")]):
        paths.append(tmp_path / f"rank{r}.json")
        Report(t).save(paths[-1])
    with pytest.raises(MergeError) as info:
        merge(paths)
    assert str(info.value) == (f"the ranks have different parallel layouts (measured ranks): rank 0 ({paths[0]}) is ddp "
                               f"over gloo; rank 1 ({paths[1]}) is fsdp2 over gloo: not the ranks of one run")


def test_simulated_ranks_are_put_beside_measured_ones_only_when_asked():
    measured = _meshed(_rank(0, 2, 1024, layout="fsdp2"), ("dp_shard", 2))
    fake = _with(_meshed(_rank(1, 2, 2048, layout="fsdp2"), ("dp_shard", 2)), backend="fake")  # parallelize=fn
    layout_sim = _with(_meshed(_rank(1, 2, 2048, layout="fsdp"), ("dp_shard", 2)), backend=None)  # parallel="fsdp"
    for sim in (fake, layout_sim):
        with pytest.raises(MergeError) as info:
            merge([measured, sim])
        assert str(info.value) == ("rank 1 is simulated and rank 0 is measured: merge the ranks of one run, or pass "
                                   "mixed=True to hold a prediction against a run")
    m = merge([measured, fake], mixed=True)
    assert m.simulated and list(m.ranks) == [0, 1] and m.worst == 1
    assert m.notes == ("mixed: rank 1 is simulated, rank 0 is measured",)
    m = merge_reports([measured, layout_sim], mixed=True)  # the facade passes it on
    assert m.notes == ("mixed: rank 1 is simulated, rank 0 is measured",
                       "the simulated and measured ranks name their layouts differently (fsdp and fsdp2) over one "
                       "mesh: check they are one layout")
    # Asked or not, a prediction of another mesh or world is no prediction of this run.
    with pytest.raises(MergeError) as info:
        merge([measured, _with(_meshed(_rank(1, 2, 8, layout="fsdp2"), ("tp", 2)), backend="fake")], mixed=True)
    assert str(info.value) == ("the ranks have different device meshes: rank 0 is on mesh dp_shard=2; rank 1 is on mesh "
                               "tp=2: not the ranks of one run")
    with pytest.raises(MergeError, match="different world sizes"):
        merge([measured, _with(_meshed(_rank(1, 4, 8, layout="fsdp2"), ("dp_shard", 2)), backend="fake")], mixed=True)
    with pytest.raises(InvalidArgumentError, match=r"merge\(mixed=...\) must be True or False, got 'yes'"):
        merge([measured], mixed="yes")
    assert not merge([measured]).simulated and merge([layout_sim]).simulated
