"""One run, one formula: an estimate's printed table, its reconciliation, the CLI and a generation show the same
formula bytes for every category at a moment (memprof.analyse.reconciler.formula_at, in the run's own regime), and
beside it the textbook's figure (HF's 18 B/param for mixed-precision AdamW) with the cause of its difference in
exact bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memprof
from memprof import Category as C
from memprof.analyse.reconciler import formula_at

MIXED = ("mixed", "amp", "mixed-fp16")  # the user's words for fp32 parameters under torch.autocast


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def _params(model):
    """Parameter elements, tied ones once: the independent count the bytes/param multiply."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _formula_column(text):
    """category -> the formula column of a printed estimate or reconciliation table, as printed."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["category", "formula"])
    out = {}
    for line in lines[head + 1:]:
        name, formula = line[2:22].strip(), line[22:36].strip()
        out[name] = formula
        if name == "total":
            return out
    raise AssertionError(f"no total row in\n{text}")


def _rows(rec):
    return {r.category: r.formula for r in rec.rows}


@pytest.mark.parametrize("precision", MIXED)
def test_an_autocast_estimate_prints_the_formula_its_reconciliation_prints(precision):
    est = memprof.estimate(_mlp(), lambda ps: torch.optim.AdamW(ps), inputs=torch.randn(4, 64),
                           precision=precision, device="cpu")
    rec = est.report().reconcile()
    # The data under both tables, then the tables as printed.
    assert {c: est.formula[c] for c in C} == _rows(rec)
    assert est.formula.total == rec.total.formula
    assert _formula_column(str(est)) == _formula_column(str(rec))
    assert est.textbook == rec.textbook


def test_at_every_moment_the_formula_holds_the_weights_torch_holds_and_the_textbook_its_copy():
    model = _mlp()
    n = _params(model)  # 2 x (64 x 64 + 64) = 8,320
    fp32 = sum(p.numel() * p.element_size() for p in model.parameters())  # 4 x 8,320 = 33,280 B
    est = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps), inputs=torch.randn(4, 64), precision="mixed",
                           device="cpu")
    report = est.report()
    for at in ("peak", "steady", (0, "forward", "end"), (0, "backward", "peak"), (-1, "optimizer", "peak")):
        rec = report.reconcile(at=at)
        assert rec.row(C.WEIGHTS).formula == formula_at(est.trace, at)[C.WEIGHTS] == fp32, at
        assert rec.textbook.breakdown[C.WEIGHTS] == fp32 + 2 * n, at  # HF: 4 + 2 B/param = 6 x 8,320 = 49,920
        named = {(c.category, c.name): c.bytes for c in rec.textbook.causes}
        assert named == {(C.WEIGHTS, "no persistent 16-bit copy"): -2 * n}, at  # -16,640 B
        assert (rec.textbook.bytes_per_param, rec.textbook.formula_bytes_per_param) == (18, 16)


def test_the_printed_tables_show_the_textbook_figure_and_its_cause_in_exact_bytes():
    model = _mlp()
    n = _params(model)
    # The model states of a real CPU autocast step with AdamW, summed from its tensors (storages once each).
    opt = torch.optim.AdamW(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 64)).sum()
    loss.backward()
    opt.step()
    tensors = [*model.parameters(), *(p.grad for p in model.parameters()),
               *(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))]
    states = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    # 4 B weights + 4 B gradients + 2 x 4 B exp_avg, exp_avg_sq per parameter, and four 4-byte fp32 step counters:
    # 16 x 8,320 + 16 = 133,136 B. The textbook adds the 16-bit copy: + 2 x 8,320 = 149,776 B.
    assert states == 16 * n + 16

    est = memprof.estimate(_mlp(), lambda ps: torch.optim.AdamW(ps), inputs=torch.randn(4, 64), precision="mixed",
                           device="cpu")
    assert (est.textbook.formula_model_states, est.textbook.model_states) == (states, states + 2 * n)
    for text in (str(est), str(est.report().reconcile())):
        assert "textbook model states: 18 bytes/param = 6 weights + 4 gradients + 8 optimizer states " in text
        assert f"{states + 2 * n:,} B" in text and f"{states:,} B" in text
        assert "formula model states: 16 bytes/param = 4 weights + 4 gradients + 8 optimizer states " in text
        assert f"weights          {-2 * n:+,} B" in text and "no persistent 16-bit copy" in text


def test_a_7b_llama_shows_one_formula_total_in_its_estimate_and_its_reconciliation():
    transformers = pytest.importorskip("transformers")
    # Llama-2-7B's shape (Touvron et al. 2023, Table 1), on the meta device: no memory, a second to simulate.
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    n = _params(model)
    assert n == 6_738_415_616
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    est = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps, foreach=True),
                           inputs=dict(input_ids=ids, labels=ids), loss_fn=lambda out: out.loss,
                           precision="mixed", device="cuda", steps=1)
    rec = est.report().reconcile()
    assert {c: est.formula[c] for c in C} == _rows(rec)
    assert est.formula.total == rec.total.formula
    assert _formula_column(str(est))["total"] == _formula_column(str(rec))["total"]
    # fp32 weights as torch.autocast keeps them: 4 x 6,738,415,616 = 26,953,662,464 B (25.1 GiB), not HF's
    # 6 B/param (37.7 GiB); the textbook's persistent bf16 copy: -2 x 6,738,415,616 = -13,476,831,232 B.
    assert est.formula[C.WEIGHTS] == 4 * n
    for text in (str(est), str(rec)):
        assert f"{-2 * n:+,} B (12.6 GiB)  no persistent 16-bit copy" in text


def test_a_mixed_precision_generation_estimate_shows_its_reconciliation_formula():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=128)).eval()
    n = _params(model)
    est = memprof.estimate_generation(model, batch_size=2, prompt_len=5, max_new_tokens=3, precision="mixed",
                                      device="cpu")
    rec = est.report().reconcile()
    assert {c: est.formula[c] for c in C} == _rows(rec)
    # Inference keeps the fp32 weights only (4 B/param); HF's mixed-precision inference counts 6.
    assert est.formula[C.WEIGHTS] == 4 * n and est.textbook.breakdown[C.WEIGHTS] == 6 * n
    assert (est.textbook.bytes_per_param, est.textbook.formula_bytes_per_param) == (6, 4)


def test_the_cli_estimate_prints_the_reconciliation_formula(tmp_path, monkeypatch, capsys):
    from memprof.cli import main

    (tmp_path / "one_formula_mlp.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "def build(batch_size):\n"
        "    return {'model': nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)),\n"
        "            'inputs': torch.empty(batch_size, 64)}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["estimate", "one_formula_mlp:build", "--batch-size", "4", "--precision", "mixed",
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    with torch.device("meta"):
        model = _mlp()
    est = memprof.estimate(model, lambda ps: torch.optim.AdamW(ps), inputs=torch.empty(4, 64, device="meta"),
                           precision="mixed", device="cpu")
    assert _formula_column(printed) == _formula_column(str(est.report().reconcile()))
    assert f"{-2 * _params(model):+,} B" in printed


def test_an_estimate_and_reconcile_show_one_formula_for_one_moment():
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(2, 256)
    est = memprof.estimate(model, opt, inputs=x)
    rec = memprof.reconcile(est.trace)
    assert est.trace.peak_phase is memprof.Phase.OPTIMIZER  # small batch: the foreach step is the peak
    assert est.formula == memprof.Breakdown.from_mapping(
        {r.category: r.formula for r in rec.rows}, total=est.formula.total)
    assert est.formula[C.ACTIVATIONS] == 0
