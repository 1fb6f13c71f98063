"""Writes the byte-identity fixtures of tests/unit/test_record_serialisation.py (run once, with the code whose
format they pin: ``python tests/data/serial/make_fixtures.py`` from the repository root). Each is a trace as
``Report.save`` writes it: a hand-built full one, a light-mode run, a simulated FSDP rank, a generation and a run
under a schedule."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import memprof  # noqa: E402
from memprof.record.files import write_json_atomic  # noqa: E402

from factories import full_trace  # noqa: E402
from models import MLP  # noqa: E402

HERE = Path(__file__).resolve().parent


def _step(model, opt, x):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


def light():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 32)
    opt = torch.optim.AdamW(model.parameters())
    with memprof.profile(model, opt, mode="light") as prof:
        _step(model, opt, x)
    return prof.report().trace


def scheduled():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with memprof.profile(model, opt, schedule=memprof.schedule(wait=1, warmup=1, active=2, repeat=1)) as prof:
        for _ in range(6):
            _step(model, opt, x)
            prof.step()
    return prof.report().trace


def fsdp_rank():
    from tests.integration.test_parallelize import IDS, build, fsdp_bf16, loss_fn

    return memprof.estimate(build(), lambda ps: torch.optim.AdamW(ps), inputs=IDS, targets=IDS, loss_fn=loss_fn,
                            world_size=2, rank=1, parallelize=fsdp_bf16).trace


def generation():
    import transformers as T

    torch.manual_seed(0)
    gemma = T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return memprof.estimate_generation(gemma, batch_size=1, prompt_len=4, max_new_tokens=2, device="cpu").trace


if __name__ == "__main__":
    for name, make in (("full", full_trace), ("light", light), ("schedule", scheduled), ("fsdp_rank", fsdp_rank),
                       ("generation", generation)):
        write_json_atomic(HERE / f"{name}.json", make().to_dict(), indent=1)
        print(name, (HERE / f"{name}.json").stat().st_size)
