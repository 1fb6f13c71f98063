"""max_batch_size and memprof plan search the batch one way (plan_search.largest_batch over a Probe), so for the
same run they give the same answer: the same model from the same config, optimizer, precision, checkpointing,
loop, GPU and sequence, searched over every batch size (multiple_of=1, as a plan's rows are)."""

from __future__ import annotations

import json

import pytest
import torch

from memprof.simulate import hf, plan, planner

# One layer at long sequences on an A100-40GB: a few hundred sequences fit, so the search has room to differ.
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=32768)
SEQ, GPU = 16384, "a100-40gb"


@pytest.mark.parametrize(("precision", "checkpointing", "loop"), [("bf16", False, "plain"),
                                                                  ("mixed", True, "hf-trainer")])
def test_max_batch_size_and_the_plan_give_the_same_answer(tmp_path, precision, checkpointing, loop):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    grid = plan.plan_hf(tmp_path, seq_len=SEQ, gpu=GPU, precisions=(precision,), checkpointing=(checkpointing,),
                        loop=loop)
    (row,) = grid.rows
    built = hf.build_model(hf.load_config(tmp_path), checkpointing=checkpointing)
    found = planner.max_batch_size(built.model, lambda ps: torch.optim.AdamW(ps),
                                   lambda b: hf.token_batch(built, b, SEQ), multiple_of=1, precision=precision,
                                   gpu=GPU, loop=loop, loss_fn=hf.hf_loss if loop == "plain" else None)
    assert (found.batch_size, found.verified) == (row.max_batch_size, row.verified)
    assert found.batch_size > 100  # a search over hundreds of sizes, each answer confirmed by simulation
