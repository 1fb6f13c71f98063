"""estimate(world_size=N, parallel=...): one rank of a data-parallel job, simulated in this process, held to
ZeRO's Table I and FSDP's per-parameter padding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memprof
from memprof import Category as C
from memprof.cli import main
from memprof.errors import InvalidArgumentError, UnknownNameError

# 64x64 + 64 + 33x64 + 33 = 6,305 fp32 parameters in 4 tensors; AdamW keeps exp_avg and exp_avg_sq like each
# parameter (8 bytes a parameter) and a 4-byte step counter per tensor.
PSI = 64 * 64 + 64 + 33 * 64 + 33


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 33))


def _steady(est) -> dict:
    end = [p for p in est.trace.phases if p.phase.value == "optimizer"][-1].end
    return {c: end[c] for c in (C.WEIGHTS, C.GRADIENTS, C.OPTIMIZER_STATES, C.COMMUNICATION)}


def _estimate(world, parallel, **kw):
    model = _model()
    return memprof.estimate(model, torch.optim.AdamW(model.parameters()), inputs=torch.randn(16, 64),
                            world_size=world, parallel=parallel, **kw)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("world", [2, 8])
def test_zero_stages_hold_table_one(world):
    # ZeRO Table I with fp32 AdamW: parameters 4 B, gradients 4 B, optimizer states 8 B a parameter; stage 1
    # partitions the states, stage 2 also the gradients, stage 3 also the parameters. Each is one flat buffer
    # (exp_avg and exp_avg_sq one each) of which a rank holds ceil(6,305 / N) elements: 3,153 at N = 2, 789 at
    # N = 8. The step counters (4 x 4 bytes) are whole on every rank.
    part = _ceil(PSI, world)
    whole_w, whole_g, states = 4 * PSI, 4 * PSI, 2 * 4 * part + 16
    expect = {
        "zero1": (whole_w, whole_g, states),
        "zero2": (whole_w, 4 * part, states),
        "zero3": (4 * part, 4 * part, states),
    }
    for parallel, (w, g, o) in expect.items():
        s = _steady(_estimate(world, parallel))
        assert (s[C.WEIGHTS], s[C.GRADIENTS], s[C.OPTIMIZER_STATES]) == (w, g, o), parallel


@pytest.mark.parametrize("world", [2, 8])
def test_fsdp_shards_each_parameter_with_its_padding(world):
    est = _estimate(world, "fsdp")
    # Rank 0 holds ceil(rows / N) rows of each parameter: 64 rows -> 64/N; 33 rows -> ceil(33/N) (17 at N=2,
    # 5 at N=8), every rank storing that many (padding), times 65 columns (weight + bias) x 4 bytes.
    rows = 64 // world + _ceil(33, world)
    sharded = rows * 65 * 4
    full = (64 + _ceil(33, world) * world) * 65 * 4  # gathered: every rank's padded shard
    d = est.trace.distributed
    assert (d.layout, d.world_size, d.sharded_bytes, d.unsharded_bytes) == ("fsdp", world, sharded, full)
    # The optimizer's state is made like the real rows of rank 0's shards (no padding): at N = 2 and 8 rank 0's
    # rows are all real.
    s = _steady(est)
    assert (s[C.WEIGHTS], s[C.GRADIENTS], s[C.OPTIMIZER_STATES]) == (sharded, sharded, 2 * sharded + 16)
    fwd = next(p for p in est.trace.phases if p.phase.value == "forward" and p.step == 1)
    assert fwd.end[C.WEIGHTS] == sharded  # the root holds no parameters: nothing stays gathered
    # At the forward's peak the second Linear is gathered (34 or 40 padded rows x 65 x 4 bytes) while FSDP2 still
    # keeps the first one's all-gather buffer (64 x 65 x 4) beside the second's, as a real rank does.
    second = _ceil(33, world) * world * 65 * 4
    assert fwd.peak[C.WEIGHTS] == sharded + second and fwd.peak[C.COMMUNICATION] == 64 * 65 * 4 + second
    # The formula beside it is Table I's per rank; the padding is named when reconciled.
    # 4 x 6,305 / N rounded half up: 12,610 at N = 2, 3,152.5 -> 3,153 at N = 8.
    assert est.formula[C.WEIGHTS] == {2: 12_610, 8: 3_153}[world]


def test_ddp_keeps_everything_and_copies_the_gradients_into_buckets():
    est = _estimate(4, "ddp")
    s = _steady(est)
    # Nothing sharded; DDP's buckets hold a copy of every gradient (4 x 6,305 bytes).
    assert (s[C.WEIGHTS], s[C.GRADIENTS], s[C.OPTIMIZER_STATES], s[C.COMMUNICATION]) == (
        4 * PSI, 4 * PSI, 8 * PSI + 16, 4 * PSI)
    first = est.trace.phases[0]  # DDP makes its buckets when it wraps the model: there from the start
    assert first.start[C.COMMUNICATION] == 4 * PSI
    assert est.trace.distributed.bucket_view is False


def test_deepspeed_buckets_are_not_estimated_rather_than_zero():
    est = _estimate(2, "zero2")
    assert est.peak[C.COMMUNICATION] is None
    assert any("reduce_bucket_size" in n for n in est.notes)
    # The per-phase statistics say so too: "not measured" is never 0.
    for st in est.trace.phase_stats:
        assert st.at("peak", C.COMMUNICATION) is None and st.at("end", C.COMMUNICATION) is None


@pytest.mark.parametrize("parallel", ["zero1", "zero2", "zero3", "fsdp", "ddp"])
def test_a_ranks_phase_statistics_are_its_records(parallel):
    # LayoutPlan.finish rewrites a rank's records (its optimizer step on the rank's shards, ZeRO-1/2's buckets not
    # estimated); the per-phase statistics are made from the same records: each series' smallest, (lower) median
    # and largest over the run's steps of that phase, every step kept here.
    from memprof.record.stats import STAT_KEYS, Stat

    est = _estimate(4, parallel, steps=3)
    assert est.trace.phase_stats
    for st in est.trace.phase_stats:
        records = [r for r in est.trace.phases if (r.phase, r.occurrence) == (st.phase, st.occurrence)]
        assert len(records) == st.count  # every step's record kept (a phase such as "other" need not be in each)
        for moment in ("peak", "end"):
            for i, key in enumerate(STAT_KEYS):
                got = [getattr(r, moment).total if key == "total" else getattr(r, moment).counts[i]
                       for r in records]
                values = sorted(v for v in got if v is not None)
                n = len(values)
                expected = None if None in got else Stat(values[0], values[(n + 1) // 2 - 1], values[-1])
                assert st.at(moment, key) == expected, (st.phase, moment, key)


def test_bad_world_sizes_and_layouts_are_refused():
    model = _model()
    x = torch.randn(2, 64)
    for bad in (0, -1, 2.0, True, "8"):
        with pytest.raises(InvalidArgumentError, match="world_size must be a positive int"):
            memprof.estimate(model, inputs=x, world_size=bad, parallel="ddp")
    with pytest.raises(UnknownNameError, match="unknown parallel layout 'tp'; use one of ddp, fsdp"):
        memprof.estimate(model, inputs=x, world_size=2, parallel="tp")
    with pytest.raises(InvalidArgumentError, match="world_size=4 needs parallel="):
        memprof.estimate(model, inputs=x, world_size=4)
    with pytest.raises(InvalidArgumentError, match="world_size must be a positive int"):
        memprof.max_batch_size(model, None, lambda b: torch.randn(b, 64), "1 MiB", world_size=0, parallel="fsdp")


def test_the_planner_sizes_one_rank():
    model = _model()
    kw = dict(multiple_of=8)
    one = memprof.max_batch_size(model, lambda ps: torch.optim.AdamW(ps), lambda b: torch.randn(b, 64), "300 KiB", **kw)
    sharded = memprof.max_batch_size(model, lambda ps: torch.optim.AdamW(ps), lambda b: torch.randn(b, 64),
                                     "300 KiB", world_size=8, parallel="zero1", **kw)
    # Sharding the optimizer state 8 ways frees (8 x 6,305 x 7/8 =) 44 KiB of the budget for activations.
    assert sharded.batch_size > one.batch_size


def test_the_command_line_takes_a_world_size(tmp_path, capsys, monkeypatch):
    mod = tmp_path / "rank_models.py"
    mod.write_text(
        "import torch\nfrom torch import nn\n"
        "def build(batch_size):\n"
        "    return {'model': nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 33)),\n"
        "            'inputs': torch.randn(batch_size, 64)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["estimate", "rank_models:build", "--batch-size", "16", "--device", "cpu", "--world-size", "2",
                 "--parallel", "fsdp"]) == 0
    assert "one rank of 2 under fsdp" in capsys.readouterr().out
    # A value no run can have is the parser's usage error (exit status 2), before anything is built.
    with pytest.raises(SystemExit) as refused:
        main(["estimate", "rank_models:build", "--batch-size", "16", "--world-size", "0", "--parallel", "fsdp"])
    assert refused.value.code == 2
    assert "--world-size must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["estimate", "rank_models:build", "--batch-size", "16", "--parallel", "tp"])
    assert main(["estimate", "rank_models:build", "--batch-size", "16", "--world-size", "2", "--parallel", "fsdp",
                 "--generate", "--prompt-len", "4", "--new-tokens", "2"]) == 1
    assert "--world-size is a training step's: leave it out with --generate" in capsys.readouterr().err


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.ModuleList([nn.Linear(32, 8) for _ in range(4)])  # a stack inside the block: not units
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x):
        return x + self.mlp(x) + torch.cat([h(x) for h in self.attn], -1)


def test_units_are_the_outermost_repeated_blocks():
    from memprof.simulate.ranks import _units

    flat = nn.Sequential(nn.Embedding(100, 32), *[_Block() for _ in range(3)], nn.Linear(32, 100))
    blocks, units = _units(flat)
    # The three blocks, whatever sits beside them in the container; the embedding and head are the root's.
    assert [b for b, _ in blocks] == list(flat)[1:4]
    assert {units.get(id(p)) for p in flat[0].parameters()} == {None}
    assert len({units[id(p)] for b in list(flat)[1:4] for p in b.parameters()}) == 3
    # Without any block of submodules, a stack of leaf layers is wrapped layer by layer.
    leaves, _ = _units(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    assert len(leaves) == 2
    est = memprof.estimate(flat, torch.optim.AdamW(flat.parameters()), inputs=torch.randint(0, 100, (2, 5)),
                           world_size=4, parallel="fsdp")
    assert any("3 block(s) (_Block)" in n for n in est.notes)


@pytest.mark.parametrize("parallel", ["zero1", "zero2", "zero3", "fsdp"])
def test_the_tags_at_a_ranks_peak_are_its_peak_records(parallel):
    # The replica's peak is its first optimizer step (every state whole); LayoutPlan.finish puts the rank's peak
    # where the rank's figures have it, a forward under autocast here, and kept the replica's tags: a ZeRO-2 rank's
    # textbook line said no autocast cast of a weight was live at a peak that holds 3 MiB of them (found by a
    # review, this GPT-NeoX on 3 ranks). The tags are the peak record's now, and the module at a peak that moved
    # is not named.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPTNeoXConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                     num_attention_heads=4, vocab_size=64, max_position_embeddings=64)
    est = memprof.estimate_hf(cfg, seq_len=16, batch_size=2, precision="mixed", world_size=3, parallel=parallel,
                              gpu="h100-80gb", extrapolate=False)
    rec = next(r for r in est.trace.phases
               if (r.step, r.phase, r.peak) == (est.trace.peak_step, est.trace.peak_phase, est.trace.peak))
    assert dict(est.trace.peak_tags) == dict(rec.tags_peak)
    casts = dict(rec.tags_peak).get("autocast_weight_copy", 0)
    sentence = next(c.sentence for c in est.textbook.causes if c.name == "no persistent 16-bit copy")
    assert ("of such casts are live" in sentence) == bool(casts)
