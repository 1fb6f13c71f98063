"""The per-rank table (memprof.analyse.reconciler.per_rank) on hand-built traces of one rank: each term divided
by the degrees that cut it, the named parts of each gap, "not modelled" rows, the text; the layout record to a
file and back, and refused when corrupt."""

from __future__ import annotations

import pytest

from memprof import Category as C
from memprof.analyse.reconciler import reconcile
from memprof.errors import TraceFormatError
from memprof.record.layout import MeshLayout, ParamGroup
from memprof.record.parts import RankInfo
from memprof.record.trace import Trace
from memprof.render.ranks import rank_table_lines

from factories import cpu, facts, phase, trace

# One rank of dp 2 x tp 2: 800 fp32 elements cut by both (3,200 B globally), 200 cut by dp only and whole on tp
# (800 B). An even share: 3,200 / 4 + 800 / 2 = 1,200 B; the rank stores 8 B more (padding).
LAYOUT = MeshLayout(mesh=(("dp", 2), ("tp", 2)),
                    groups=(ParamGroup(("dp",), ("tp",), 200, 200, 800), ParamGroup(("dp", "tp"), (), 800, 800, 3200)),
                    param_dtype="bfloat16", units=2, largest_unit_bytes=600)
STORED = 1_208


def _rank(layout: "MeshLayout | None" = LAYOUT, name: str = "fsdp2") -> Trace:
    rest = cpu(weights=STORED, gradients=1_200)
    fwd = cpu(weights=STORED + 600, activations=500, temporaries=40)
    # Backward's peak: the largest unit (600 B) and 100 B more gathered; 300 B of gradients produced so far.
    bwd = cpu(weights=STORED + 700, gradients=300, activations=200)
    return trace(phases=(phase(0, "forward", start=cpu(weights=STORED), peak=fwd, end=cpu(weights=STORED)),
                         phase(0, "backward", start=cpu(weights=STORED), peak=bwd, end=rest)),
                 num_steps=1, facts=facts(num_params=500, num_trainable=500, weight_bytes=STORED),
                 distributed=RankInfo(rank=1, world_size=4, backend="gloo", layout=name, layout_detail=layout))


def test_the_backward_peak_names_the_padding_and_the_units_gathered():
    t = reconcile(_rank(), at=(0, "backward", "peak")).per_rank
    assert (t.rank, t.world_size, t.degrees, t.simulated) == (1, 4, (("dp", 2), ("tp", 2)), False)
    w = t.row(C.WEIGHTS)
    # 800 / 2 + 3,200 / 4 = 1,200 B at rest, + the largest unit 600 B.
    assert (w.value, w.actual) == (1_800, STORED + 700)
    assert [(n, b) for n, b, _ in w.parts] == [("padding and uneven rows", 8), ("units gathered beside the largest",
                                                                                100)]
    assert w.unexplained == 0
    assert w.formula.startswith("parameters at rest: 800 B / (dp = 2) + 3,200 B / (dp·tp = 4)")
    g = t.row(C.GRADIENTS)
    # Every unit's sharded gradients (1,200 B) + the largest unit's unsharded ones (600 B); 300 B so far.
    assert (g.value, g.actual, g.parts[0][:2]) == (1_800, 300, ("backward in progress", -1_500))
    assert g.unexplained == 0


def test_rows_without_a_per_rank_formula_say_so():
    t = reconcile(_rank(), at=(0, "forward", "peak")).per_rank
    assert [r.category for r in t.rows] == [C.WEIGHTS, C.GRADIENTS, C.OPTIMIZER_STATES, C.ACTIVATIONS,
                                            C.COMMUNICATION, C.TEMPORARIES]
    assert t.row(C.GRADIENTS).value == 0  # none before backward: a formula of 0, not a missing one
    for cat in (C.ACTIVATIONS, C.COMMUNICATION, C.TEMPORARIES):
        assert t.row(cat).value is None and "not modelled" in t.row(cat).formula
    assert t.row(C.OPTIMIZER_STATES).formula == "no optimizer"
    lines = rank_table_lines(t)
    assert lines[1] == "Per rank: rank 1 of 4, mesh dp 2 × tp 2"
    assert lines[3].startswith("  weights                1.8 KiB     1.8 KiB        +8 B  parameters at rest")
    assert any(line.startswith("  activations       not modelled       500 B") for line in lines)


def test_at_rest_nothing_gathered_and_the_end_of_backward_holds_the_shards():
    t = reconcile(_rank(), at=(0, "backward", "end")).per_rank
    assert (t.row(C.WEIGHTS).value, t.row(C.WEIGHTS).actual) == (1_200, STORED)
    assert (t.row(C.GRADIENTS).value, t.row(C.GRADIENTS).actual, t.row(C.GRADIENTS).parts) == (1_200, 1_200, ())


def test_no_table_without_a_layout_except_ddp():
    assert reconcile(_rank(None, "fsdp1")).per_rank is None
    t = reconcile(_rank(None, "ddp"), at=(0, "backward", "end")).per_rank
    assert t.degrees == (("dp_replicate", 4),)
    assert t.row(C.WEIGHTS).value == STORED  # whole on every rank
    # DDP's bucket: a copy of the gradients, 1,208 B x 500 / 500 trainable; this breakdown did not measure it.
    assert (t.row(C.COMMUNICATION).value, t.row(C.COMMUNICATION).actual) == (STORED, None)
    assert "not measured" in "\n".join(rank_table_lines(t))


def test_the_layout_goes_to_a_file_and_back_and_is_refused_when_corrupt():
    tr = _rank()
    assert Trace.from_dict(tr.to_dict()).distributed == tr.distributed
    data = tr.to_dict()
    data["distributed"]["layout_detail"]["groups"][0]["elements"] = -1
    with pytest.raises(TraceFormatError, match="elements"):
        Trace.from_dict(data)
    data = tr.to_dict()
    data["distributed"]["layout_detail"]["offload"] = "no"
    with pytest.raises(TraceFormatError, match="offload"):
        Trace.from_dict(data)


def test_the_html_shows_the_same_table():
    from memprof.render.html import reconciliation_html

    page = reconciliation_html(reconcile(_rank(), at=(0, "backward", "peak")))
    assert "Per rank: rank 1 of 4, mesh dp 2 × tp 2" in page
    assert ">measured<" in page and "not modelled" in page
    assert "<small>+8 B padding and uneven rows</small>" in page and "<small>+100 B units gathered" in page


def test_gradients_freed_by_zero_grad_are_named():
    tr = _rank()
    after = phase(0, "other", start=cpu(weights=STORED, gradients=1_200), peak=cpu(weights=STORED, gradients=1_200),
                  end=cpu(weights=STORED))
    tr = trace(phases=(*tr.phases, after), num_steps=1, facts=tr.facts, distributed=tr.distributed)
    g = reconcile(tr, at=(0, "other", "end")).per_rank.row(C.GRADIENTS)
    assert (g.value, g.actual, g.parts[0][:2], g.unexplained) == (1_200, 0, ("freed by zero_grad", -1_200), 0)
