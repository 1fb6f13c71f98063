"""Accuracy of memprof: formula vs simulated vs measured on a zoo of models.

Run from the repository root::

    python benchmarks/accuracy.py                       # full zoo, about 1-2 minutes on 2 cores
    python benchmarks/accuracy.py --quick               # smoke test, a few seconds
    python benchmarks/accuracy.py --json benchmarks/results/accuracy-cpu.json \\
        --markdown benchmarks/results/accuracy-cpu.md

What is measured
----------------
Six models, built here (no downloads), small enough for a CPU:

* ``mlp``: 3 x Linear + ReLU, MSE.
* ``cnn``: 3 x (conv3x3 no bias + BatchNorm2d + ReLU) with max-pool, Linear head, cross-entropy.
* ``lstm``: Embedding + 2-layer LSTM + Linear over the last time step, cross-entropy.
* ``bert``: BERT-style encoder: token + position embeddings, ``nn.TransformerEncoder``
  (post-LN, GELU, dropout 0.1), token-level head over the vocabulary (MLM-like), cross-entropy.
* ``gpt``: ``memprof.demo.TinyGPT`` (pre-LN, eager causal attention, dropout 0.1,
  tied input/output embeddings), next-token cross-entropy.
* ``vit``: ViT-style: conv patch embedding, class token, position embedding, pre-LN
  blocks with ``F.scaled_dot_product_attention``, class head, cross-entropy.

Each model in three precisions: ``fp32``; ``bf16`` (``model.to(torch.bfloat16)``,
floating inputs cast to bf16); ``amp`` (fp32 parameters under
``torch.autocast("cpu", dtype=torch.bfloat16)``). Two optimizers: AdamW and SGD
with momentum 0.9. For each (model, precision, optimizer):

1. measured: 2 training steps (forward, loss, backward, step,
   ``zero_grad(set_to_none=True)``) under ``memprof.profile(model, opt, mode="exact")``;
2. simulated: ``memprof.estimate(model, opt, inputs=..., targets=..., loss_fn=..., device="cpu",
   precision=...)`` (fake CPU tensors, no real memory);
3. reconciled: ``report.reconcile(at="peak", estimate=est)`` and ``at="steady"``:
   per category formula / simulated / measured / gap, the unexplained remainder
   (``rec.unexplained(cat)``) and every named cause.

Everything goes to the JSON; the Markdown has a summary table and one detail
table per model. ``gpu_validate.py`` imports :data:`MODELS` and
:func:`build_case` from here.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from _machine import command_line, cpu_model, write_results  # benchmarks run as scripts from this folder

import torch
import torch.nn.functional as F
from torch import nn

try:
    import memprof
except ImportError:  # running from a checkout without installation
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import memprof
from memprof.anatomy import predict_activations
from memprof.demo import TinyGPT

MODELS = ("mlp", "cnn", "lstm", "bert", "gpt", "vit")
PRECISIONS = ("fp32", "bf16", "amp")
OPTIMIZERS = ("adamw", "sgd")
# Categories that exist on every device (the device-only rows are None on CPU).
TENSOR_CATEGORIES = ("weights", "buffers", "gradients", "optimizer_states", "activations", "inputs", "temporaries")


# ---------------------------------------------------------------------------- the zoo


def _mlp(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _cnn(channels: tuple[int, ...], classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = []
    c_in = 3
    for i, c in enumerate(channels):
        layers += [nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        if i < len(channels) - 1:
            layers.append(nn.MaxPool2d(2))
        c_in = c
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes)]
    return nn.Sequential(*layers)


class LSTMClassifier(nn.Module):
    def __init__(self, vocab: int, emb: int, hidden: int, layers: int, classes: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.emb(idx))
        return self.head(out[:, -1])


class BertEncoder(nn.Module):
    """BERT-style: embeddings + LayerNorm + dropout, post-LN encoder layers, MLM-like head."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.ln(self.tok(idx) + self.pos(pos)))
        return self.head(self.encoder(x))


class ViTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    def __init__(self, image: int, patch: int, hidden: int, layers: int, heads: int, classes: int) -> None:
        super().__init__()
        n = (image // patch) ** 2
        self.patch = nn.Conv2d(3, hidden, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos = nn.Parameter(torch.randn(1, n + 1, hidden) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x[:, 0]))


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass
class Case:
    """One model with its batch and loss; ``inputs``/``targets`` on the model's device."""

    name: str
    description: str
    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: Callable[..., torch.Tensor]
    transformer: "dict[str, Any] | None" = None  # Korthikanti configuration, for information


def build_case(name: str, quick: bool = False, device: "str | torch.device" = "cpu",
               scale: int = 1) -> Case:
    """Build model ``name`` with a deterministic batch. ``scale`` multiplies the batch (GPU runs)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "mlp":
        width, depth, batch = (256, 3, 32) if not quick else (32, 3, 4)
        batch *= scale
        model = _mlp(width, depth)
        x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
        desc = f"{depth} x Linear({width},{width}) + ReLU, batch {batch}, MSE"
        case = Case(name, desc, model, x, y, F.mse_loss)
    elif name == "cnn":
        channels, batch, hw = ((16, 32, 64), 16, 32) if not quick else ((4, 8, 8), 2, 16)
        batch *= scale
        model = _cnn(channels)
        x = torch.randn(batch, 3, hw, hw, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        desc = (f"3 x (conv3x3 + BatchNorm2d + ReLU), channels {channels}, input 3x{hw}x{hw}, batch {batch}, "
                "cross-entropy")
        case = Case(name, desc, model, x, y, F.cross_entropy)
    elif name == "lstm":
        vocab, emb, hidden, layers, seq, batch = (1000, 64, 128, 2, 32, 8) if not quick else (50, 8, 16, 2, 8, 2)
        batch *= scale
        model = LSTMClassifier(vocab, emb, hidden, layers, 10)
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        desc = (f"Embedding({vocab},{emb}) + {layers}-layer LSTM(hidden {hidden}) + Linear on the last step, "
                f"seq {seq}, batch {batch}, cross-entropy")
        case = Case(name, desc, model, x, y, F.cross_entropy)
    elif name == "bert":
        vocab, hidden, layers, heads, seq, batch = (1000, 128, 2, 4, 64, 4) if not quick else (50, 16, 1, 2, 8, 2)
        batch *= scale
        model = BertEncoder(vocab, hidden, layers, heads, seq)
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        desc = (f"BERT-style nn.TransformerEncoder, {layers} layers, hidden {hidden}, {heads} heads, FFN {4 * hidden}, "
                f"post-LN, GELU, dropout 0.1, seq {seq}, batch {batch}, vocab {vocab}, token-level cross-entropy")
        case = Case(name, desc, model, x, y, _token_loss,
                    dict(seq_len=seq, batch=batch, hidden=hidden, heads=heads, layers=layers))
    elif name == "gpt":
        vocab, hidden, layers, heads, seq, batch = (1000, 128, 2, 4, 64, 4) if not quick else (50, 16, 1, 2, 8, 2)
        batch *= scale
        model = TinyGPT(vocab=vocab, hidden=hidden, layers=layers, heads=heads, max_seq=seq, dropout=0.1)
        data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        desc = (f"memprof.demo.TinyGPT, {layers} layers, hidden {hidden}, {heads} heads, eager causal attention, "
                f"dropout 0.1, tied embeddings, seq {seq}, batch {batch}, vocab {vocab}")
        case = Case(name, desc, model, x, y, TinyGPT.loss,
                    dict(seq_len=seq, batch=batch, hidden=hidden, heads=heads, layers=layers))
    elif name == "vit":
        image, patch, hidden, layers, heads, batch = (32, 4, 128, 2, 4, 8) if not quick else (16, 8, 16, 1, 2, 2)
        batch *= scale
        model = ViT(image, patch, hidden, layers, heads, 10)
        x = torch.randn(batch, 3, image, image, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        n = (image // patch) ** 2 + 1
        desc = (f"ViT-style, patch {patch} on 3x{image}x{image} ({n} tokens), {layers} pre-LN blocks, hidden {hidden}, "
                f"{heads} heads, SDPA, no dropout, batch {batch}, cross-entropy")
        case = Case(name, desc, model, x, y, F.cross_entropy)
    else:
        raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    case.model = case.model.to(device)
    case.inputs, case.targets = case.inputs.to(device), case.targets.to(device)
    return case


def apply_precision(case: Case, precision: str) -> None:
    """``bf16``: parameters, buffers and floating inputs/targets in bf16; ``fp32``/``amp``: unchanged."""
    if precision == "bf16":
        case.model.to(torch.bfloat16)
        if case.inputs.is_floating_point():
            case.inputs = case.inputs.to(torch.bfloat16)
        if case.targets.is_floating_point():
            case.targets = case.targets.to(torch.bfloat16)


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    raise SystemExit(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def autocast_ctx(precision: str, device_type: str) -> Any:
    if precision == "amp":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_steps(case: Case, opt: torch.optim.Optimizer, steps: int, precision: str) -> None:
    dev = case.inputs.device.type
    for _ in range(steps):
        with autocast_ctx(precision, dev):
            loss = case.loss_fn(case.model(case.inputs), case.targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del loss  # as in estimate(): the loss is held through the step (a loop logs it) and released when the loop ends


# ---------------------------------------------------------------------------- one configuration


def _rows(rec: Any) -> dict[str, dict[str, Any]]:
    out = {}
    for r in rec.rows:
        cat = r.category.value
        out[cat] = {"formula": r.formula, "simulated": r.estimate, "measured": r.measured,
                    "gap": r.gap, "gap_pct": r.gap_pct, "unexplained": rec.unexplained(r.category)}
    return out


def _rec_dict(rec: Any) -> dict[str, Any]:
    return {
        "where": rec.where,
        "precision": rec.precision,
        "optimizer": rec.optimizer,
        "textbook_bytes_per_param": rec.textbook.bytes_per_param,
        "categories": _rows(rec),
        "causes": [{"category": c.category.value, "name": c.name, "bytes": c.bytes, "sentence": c.sentence}
                   for c in rec.causes],
        "explanations": [{"category": c.category.value, "name": c.name, "bytes": c.bytes}
                         for c in rec.explanations],
        "notes": list(rec.notes),
        "advice": rec.advice(),
    }


def _activations_end_of_forward(trace: Any) -> "int | None":
    fwd = [p for p in trace.phases if p.phase is memprof.Phase.FORWARD]
    return fwd[-1].end[memprof.Category.ACTIVATIONS] if fwd else None


def run_config(model: str, precision: str, optimizer: str, quick: bool, steps: int = 2) -> dict[str, Any]:
    case = build_case(model, quick)
    apply_precision(case, precision)
    opt = make_optimizer(optimizer, case.model.parameters())
    n_params = sum(p.numel() for p in {id(p): p for p in case.model.parameters()}.values())

    gc.collect()
    t0 = time.perf_counter()
    with memprof.profile(case.model, opt, mode="exact") as prof:
        train_steps(case, opt, steps, precision)
    rep = prof.report()
    t_measure = time.perf_counter() - t0

    # The estimate sees a fresh model and optimizer of the same configuration (state not yet created).
    est_case = build_case(model, quick)
    apply_precision(est_case, precision)
    t0 = time.perf_counter()
    est = memprof.estimate(est_case.model, lambda ps: make_optimizer(optimizer, ps), inputs=est_case.inputs,
                           targets=est_case.targets, loss_fn=est_case.loss_fn, device="cpu",
                           precision=precision if precision == "amp" else None, steps=steps)
    t_estimate = time.perf_counter() - t0

    recs = {at: rep.reconcile(at=at, estimate=est) for at in ("peak", "steady")}
    peak_m, peak_s = rep.peak.total, est.peak_bytes
    sim_tr = est.trace
    out = {
        "model": model,
        "precision": precision,
        "optimizer": optimizer,
        "description": case.description,
        "parameters": n_params,
        "steps": steps,
        "measured_peak": peak_m,
        "measured_peak_where": {"step": rep.trace.peak_step,
                                "phase": rep.trace.peak_phase.value if rep.trace.peak_phase else None,
                                "module": rep.trace.peak_module},
        "measured_peak_breakdown": {c: rep.peak[c] for c in TENSOR_CATEGORIES},
        "simulated_peak": peak_s,
        "simulated_peak_where": {"step": sim_tr.peak_step,
                                 "phase": sim_tr.peak_phase.value if sim_tr.peak_phase else None,
                                 "module": sim_tr.peak_module},
        "simulated_peak_breakdown": {c: est.peak[c] for c in TENSOR_CATEGORIES},
        "simulated_vs_measured_peak_pct": 100.0 * (peak_s - peak_m) / peak_m if peak_m else None,
        "formula_peak_breakdown": {c: est.formula[c] for c in TENSOR_CATEGORIES},
        "activations_formula": predict_activations(rep.trace).saved_bytes,
        "activations_measured_end_of_forward": _activations_end_of_forward(rep.trace),
        "activations_simulated_end_of_forward": _activations_end_of_forward(sim_tr),
        "modules_without_rule": list(predict_activations(rep.trace).modules_without_rule),
        "estimate_notes": list(est.notes),
        "reconcile": {at: _rec_dict(r) for at, r in recs.items()},
        "seconds_measure": t_measure,
        "seconds_estimate": t_estimate,
    }
    del case, est_case, opt, prof, rep, est
    gc.collect()
    return out


# ---------------------------------------------------------------------------- output


def fmt_bytes(n: "float | None") -> str:
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _pct(a: "float | None", b: "float | None") -> str:
    """(a - b) / b in percent, signed."""
    if a is None or not b:
        return "n/a"
    return f"{100.0 * (a - b) / b:+.1f} %"


def _gap_cell(v: "int | None") -> str:
    if v is None:
        return "n/a"
    return "0" if v == 0 else ("+" if v > 0 else "") + fmt_bytes(v)


def _model_states_gap(r: dict[str, Any], at: str) -> str:
    cats = r["reconcile"][at]["categories"]
    cells = [_gap_cell(cats[c]["gap"]) for c in ("weights", "gradients", "optimizer_states")]
    return " / ".join(cells)


def _unexplained_total(r: dict[str, Any], at: str) -> int:
    return sum(abs(v["unexplained"]) for v in r["reconcile"][at]["categories"].values() if v["unexplained"])


def summary_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | precision | optimizer | measured peak | simulated peak | sim. vs meas. "
        "| W / G / O formula gap, steady "
        "| activations: formula vs measured (end of forward) | unexplained at peak | unexplained at steady |",
        "| --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in results:
        act_f, act_m = r["activations_formula"], r["activations_measured_end_of_forward"]
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['optimizer']} | {fmt_bytes(r['measured_peak'])} | "
            f"{fmt_bytes(r['simulated_peak'])} | {_pct(r['simulated_peak'], r['measured_peak'])} | "
            f"{_model_states_gap(r, 'steady')} | {fmt_bytes(act_f)} vs {fmt_bytes(act_m)} ({_pct(act_f, act_m)}) | "
            f"{fmt_bytes(_unexplained_total(r, 'peak'))} | {fmt_bytes(_unexplained_total(r, 'steady'))} |")
    return "\n".join(lines) + "\n"


def detail_tables(results: list[dict[str, Any]]) -> str:
    out: list[str] = []
    for model in dict.fromkeys(r["model"] for r in results):
        rs = [r for r in results if r["model"] == model]
        out.append(f"#### {model}: {rs[0]['description']}, {rs[0]['parameters']:,} parameters")
        out.append("")
        out.append("At the peak, per category: formula / simulated / measured "
                   "(unexplained part of the gap in brackets, when not 0).")
        out.append("")
        out.append("| precision | optimizer | peak at | " + " | ".join(TENSOR_CATEGORIES) + " |")
        out.append("| --- | --- | --- | " + " | ".join("---" for _ in TENSOR_CATEGORIES) + " |")
        for r in rs:
            rec = r["reconcile"]["peak"]
            w = r["measured_peak_where"]
            cells = []
            for c in TENSOR_CATEGORIES:
                v = rec["categories"][c]
                cell = f"{fmt_bytes(v['formula'])} / {fmt_bytes(v['simulated'])} / {fmt_bytes(v['measured'])}"
                if v["unexplained"]:
                    cell += f" ({_gap_cell(v['unexplained'])})"
                cells.append(cell)
            out.append(f"| {r['precision']} | {r['optimizer']} | step {w['step']} {w['phase']} | "
                       + " | ".join(cells) + " |")
        out.append("")
        out.append("Named causes at the peak (bytes, as they add to measured − formula):")
        out.append("")
        for r in rs:
            causes = r["reconcile"]["peak"]["explanations"]
            txt = "; ".join(f"{c['category']}: {c['name']} {_gap_cell(c['bytes'])}" for c in causes) or "none"
            out.append(f"- {r['precision']}/{r['optimizer']}: {txt}")
        steady_odd = [r for r in rs if _unexplained_total(r, "steady")]
        if steady_odd:
            out.append("")
            out.append("Unexplained at steady (end of the last optimizer step):")
            out.append("")
            for r in steady_odd:
                causes = [c for c in r["reconcile"]["steady"]["explanations"]]
                txt = "; ".join(f"{c['category']}: {c['name']} {_gap_cell(c['bytes'])}" for c in causes)
                out.append(f"- {r['precision']}/{r['optimizer']}: {txt}")
        notes = sorted({n for r in rs for n in r["estimate_notes"]})
        if notes:
            out.append("")
            out.append("Notes of the estimate: " + " ".join(f"({i + 1}) {n}." for i, n in enumerate(notes)))
        out.append("")
    return "\n".join(out)


def machine_info() -> dict[str, Any]:
    cpu = cpu_model()
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "memprof": memprof.__version__,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------- main


def _split(arg: str, allowed: tuple[str, ...], what: str, ap: argparse.ArgumentParser) -> list[str]:
    items = [s.strip() for s in arg.split(",") if s.strip()]
    for s in items:
        if s not in allowed:
            ap.error(f"unknown {what} {s!r}; choose from {', '.join(allowed)}")
    return items


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma list of " + ",".join(MODELS))
    ap.add_argument("--precisions", default=None, help="comma list of fp32,bf16,amp (default all; --quick: fp32)")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma list of adamw,sgd")
    ap.add_argument("--steps", type=int, default=2, help="training steps measured and simulated (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, fp32 only unless --precisions is given")
    ap.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    args = ap.parse_args(argv)

    models = _split(args.models, MODELS, "model", ap)
    if args.precisions is None:
        args.precisions = "fp32" if args.quick else ",".join(PRECISIONS)
    precisions = _split(args.precisions, PRECISIONS, "precision", ap)
    optimizers = _split(args.optimizers, OPTIMIZERS, "optimizer", ap)
    torch.set_num_threads(args.threads)

    info = machine_info()
    info["command"] = command_line(__file__, argv)
    print(f"# {info['cpu']}, torch {info['torch']}, {args.threads} threads; {len(models)} models x "
          f"{len(precisions)} precisions x {len(optimizers)} optimizers", flush=True)
    t_all = time.perf_counter()
    results = []
    failed = []
    for m in models:
        for p in precisions:
            for o in optimizers:
                try:
                    r = run_config(m, p, o, args.quick, args.steps)
                except Exception as exc:  # e.g. a kernel this CPU's oneDNN cannot build: the same without memprof
                    failed.append({"model": m, "precision": p, "optimizer": o, "error": f"{type(exc).__name__}: {exc}"})
                    print(f"{m:5s} {p:5s} {o:6s} did not run: {type(exc).__name__}: {exc}", flush=True)
                    continue
                results.append(r)
                print(f"{m:5s} {p:5s} {o:6s} peak measured {fmt_bytes(r['measured_peak']):>11} simulated "
                      f"{fmt_bytes(r['simulated_peak']):>11} ({_pct(r['simulated_peak'], r['measured_peak'])}); "
                      f"W/G/O gap at steady {_model_states_gap(r, 'steady')}; unexplained peak "
                      f"{fmt_bytes(_unexplained_total(r, 'peak'))}  "
                      f"({r['seconds_measure']:.1f} s + {r['seconds_estimate']:.1f} s)", flush=True)
    info["seconds_total"] = round(time.perf_counter() - t_all, 1)

    md = "### Summary\n\n" + summary_table(results) + "\n### Per model\n\n" + detail_tables(results)
    if failed:
        md += "\n### Configurations that did not run\n\n" + "".join(
            f"- {f['model']} {f['precision']} {f['optimizer']}: {f['error'].splitlines()[0]}\n" for f in failed)
    info["failed"] = failed
    if args.quick or len(results) <= 6:
        print()
        print(summary_table(results))
    write_results(args.json, {"machine": info, "results": results}, args.markdown,
                  f"Command: `{info['command']}`; {info['cpu']}, torch {info['torch']}, {info['date']}, "
                  f"{info['seconds_total']} s.\n\n" + md, indent=1)
    print(f"# done in {info['seconds_total']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
