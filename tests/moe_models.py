"""Tiny mixture-of-experts, state-space and encoder-decoder configurations (no downloads), and what the tests
run on them for real: a training loop as ``memprof.estimate`` runs it, and a routing forced to a plan.

Every configuration has hidden size 32, a vocabulary of 64 and 4 experts with top-2 routing (Llama 4: top-1);
one decoder layer, or two where the architecture mixes kinds (gpt-oss's sliding and full attention, Jamba's
Mamba and attention layers): small enough that a real step and its simulation take well under a second.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = __import__("pytest").importorskip("transformers")
T = transformers

_COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64)
_TWO = {**_COMMON, "num_hidden_layers": 2}


def moe_configs():
    """(name, model class, config) of each MoE architecture tested."""
    c = _COMMON
    return {
        "mixtral": (T.MixtralForCausalLM, lambda: T.MixtralConfig(**c, intermediate_size=64, num_local_experts=4,
                                                                  num_experts_per_tok=2)),
        "qwen2_moe": (T.Qwen2MoeForCausalLM, lambda: T.Qwen2MoeConfig(
            **c, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2)),
        "qwen3_moe": (T.Qwen3MoeForCausalLM, lambda: T.Qwen3MoeConfig(
            **c, intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=8)),
        "deepseek_v3": (T.DeepseekV3ForCausalLM, lambda: T.DeepseekV3Config(
            **{**c, "num_key_value_heads": 4}, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16,
            q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
        "gpt_oss": (T.GptOssForCausalLM, lambda: T.GptOssConfig(
            **_TWO, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
            layer_types=["sliding_attention", "full_attention"])),
        "olmoe": (T.OlmoeForCausalLM, lambda: T.OlmoeConfig(**c, intermediate_size=32, num_experts=4,
                                                            num_experts_per_tok=2)),
        "granitemoe": (T.GraniteMoeForCausalLM, lambda: T.GraniteMoeConfig(
            **c, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
        "jamba": (T.JambaForCausalLM, lambda: T.JambaConfig(
            **_TWO, intermediate_size=64, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
            expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0, mamba_d_state=4, mamba_dt_rank=4,
            mamba_expand=2, use_mamba_kernels=False)),
        "llama4": (T.Llama4ForCausalLM, lambda: T.Llama4TextConfig(
            **c, intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
            head_dim=8, interleave_moe_layer_step=1)),
    }


def build(name, impl=None, seed=0):
    """The model ``name`` of :func:`moe_configs`, with experts implementation ``impl`` (None: transformers'
    default, grouped_mm), in eval mode off (training)."""
    cls, cfg = moe_configs()[name]
    torch.manual_seed(seed)
    model = cls(cfg())
    if impl is not None:
        model.set_experts_implementation(impl)
    return model


def train_steps(model, ids, steps=2, opt=None):
    """What ``memprof.estimate``'s loop runs: forward with labels, backward, step, zero_grad, the loss bound until
    the next step's replaces it and released when the loop ends."""
    opt = opt or torch.optim.AdamW(model.parameters())
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    del loss  # the loop has ended: its last loss is released, as the estimate's loop releases it


def estimate_training(model, ids, routing=None, steps=2):
    import memprof

    return memprof.estimate(model, lambda ps: torch.optim.AdamW(ps), inputs=dict(input_ids=ids, labels=ids),
                            loss_fn=lambda o: o.loss, device="cpu", steps=steps, routing=routing)


class ForcedRouting(TorchDispatchMode):
    """A real run whose routers choose as a simulation assumes: the indices of every ``topk`` over floating
    scores are overwritten with the plan's (its values stay the real top values: only which experts changes,
    which is what the experts' allocations depend on)."""

    def __init__(self, routing="balanced"):
        super().__init__()
        from memprof.simulate.routing import routing_of

        self.plan = routing_of(routing).plan()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.topk.default and args[0].is_floating_point():
            dim = (args[2] if len(args) > 2 else (kwargs or {}).get("dim", -1)) % args[0].dim()
            with torch._C._DisableTorchDispatch():
                out[1].copy_(self.plan.indices(tuple(out[1].shape), args[0].shape[dim], dim, "real"))
        return out


def forced(routing):
    return ForcedRouting(routing) if routing is not None else contextlib.nullcontext()
