"""An estimate on fake tensors (a CPU target; a ``parallelize=`` function, here FSDP2 with its mixed-precision
policy, on a GPU target) is the same to the byte whether the meta kernels' answers are kept for its fake tensors
(memprof.simulate.meta_kernels) or the fake mode answers every call."""

from __future__ import annotations

import pytest
import torch

import memprof
from memprof.simulate import meta_kernels

transformers = pytest.importorskip("transformers")

from memprof.simulate.plan_precision import fsdp_parallelize  # noqa: E402

from test_depth_default import _identical  # noqa: E402  (every figure, to the byte)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


CASES = {
    "cpu mixed": dict(precision="mixed"),
    "fsdp2 policy on h100": dict(precision="fp32", world_size=4, parallelize=fsdp_parallelize(), gpu="h100-80gb"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_estimate_on_fake_tensors_is_the_same_with_the_answers_kept(case, monkeypatch):
    model = _llama()
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")

    def estimate():
        return memprof.estimate(model, torch.optim.AdamW, inputs={"input_ids": ids, "labels": ids},
                                loss_fn=lambda out: out.loss, **CASES[case])

    monkeypatch.setattr(meta_kernels, "_FAKE_ANSWERS", {})
    kept = estimate()
    answered = len(meta_kernels._FAKE_ANSWERS)
    # Every call to the fake mode: no op is answered from the kept ones.
    monkeypatch.setattr(meta_kernels, "_fake_kind", lambda func: meta_kernels._NEVER)
    monkeypatch.setattr(meta_kernels, "_FAKE_KINDS", {})
    plain = estimate()
    assert answered > 100  # the first estimate did keep answers (fresh outputs, in-place ops and views)
    _identical(kept, plain)
    assert kept.notes == plain.notes
