"""Published GPU memory measurements, reproduced as memprof CUDA-target estimates.

Usage::

    python benchmarks/published.py                      # every row of benchmarks/published_rows.json
    python benchmarks/published.py --quick              # 3 rows, a smoke test (the smallest set-ups)
    python benchmarks/published.py --quick --layers 2   # the same rows' code paths on 2-layer models (the suite's)
    python benchmarks/published.py --rows bert-l-fp32-b4 --json out.json --markdown out.md

Each row of ``published_rows.json`` is one figure a public source measured on a GPU, with its set-up (model
dimensions, precision, optimizer, batch, sequence, checkpointing, layout and world size, the GPU), the counter it
reported and the loop its authors ran. The script builds the model from the written dimensions on the meta device
(no download), runs the authors' loop as ``memprof.estimate(..., train_step=fn, gpu=...)`` (the HF Trainer of
January 2022 with torch 1.10's softmax, torchtitan's model, train.py and parallelize_llama of December 2024 on a
fake process group, litgpt's GPT and finetune/full.py of March 2024; each written from its source, below) and
reads memprof's figure for the SAME counter:

- ``nvidia-smi`` (NVML used): ``est.device_memory.device_peak``, the peak reserved plus memprof's figure for the
  memory outside torch (CUDA context, libraries). NVML's figure also holds other processes; the sources ran one.
- ``reserved_bytes.all.peak`` (torch.cuda.max_memory_reserved): ``est.device_memory.peak_reserved``.
- ``max_memory_allocated``: ``est.device_memory.peak_allocated``.

Beside it, the estimators users would pick instead:

- closed forms: bytes per parameter (``memprof.anatomy.bytes_per_param``: 16 fp32 AdamW, 18 mixed AdamW; ZeRO's
  ``zero_model_states`` for sharded rows) plus Korthikanti et al. 2022's activations
  (``memprof.anatomy.transformer_activations_total``);
- DeepSpeed's model-state estimators (``deepspeed_zero2_estimate`` for one GPU, ``deepspeed_zero3_estimate`` for
  sharded rows), as memprof.anatomy reproduces them;
- accelerate's arithmetic: ``accelerate estimate-memory``'s "Training using Adam" column
  (accelerate/commands/estimate.py, ``estimate_training_usage``): the model's fp32 size ``S`` (parameters and
  buffers of the meta model) times 4 for float32 (model S, gradients S, optimizer 2S, step 4S: the max is 4S), and
  2S for float16/bfloat16 (optimizer states 2S, the largest of model S, gradients 1.5S, step 2S); batch 1, one GPU,
  no activations.

Results: ``--json`` and ``--markdown`` (default ``benchmarks/results/published.{json,md}``): per row the published
figure, memprof's, the error in %, the others'; then the median absolute error, the worst, the under-estimates;
then the data file's ``not_reproduced`` rows (figures whose code paths memprof does not simulate) with the reason.
The rows are simulated whole: ``--extrapolate`` gives no device figures, which every counter here needs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable, Iterator

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import import_memprof  # noqa: E402

ROWS = HERE / "published_rows.json"
QUICK = ("bert-l-fp32-b1-ga4-gc", "bert-l-fp16-b1-ga4-gc", "bert-l-fp32-b1-ga4")
UNITS = {"MiB": 2**20, "GiB": 2**30, "MB": 10**6, "GB": 10**9}


# --------------------------------------------------------------------------- models from written dimensions


def bert(dims: dict[str, Any]) -> Any:
    """BertForSequenceClassification from the row's dimensions, on the meta device, eager attention (the only
    attention BERT had in transformers 4.16, which the source ran)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(hidden_size=dims["hidden_size"], num_hidden_layers=dims["num_hidden_layers"],
                     num_attention_heads=dims["num_attention_heads"], intermediate_size=dims["intermediate_size"],
                     vocab_size=dims["vocab_size"], max_position_embeddings=dims["max_position_embeddings"],
                     type_vocab_size=dims["type_vocab_size"],
                     hidden_act=dims["hidden_act"], hidden_dropout_prob=dims["hidden_dropout_prob"],
                     attention_probs_dropout_prob=dims["attention_probs_dropout_prob"])
    cfg.num_labels = dims["num_labels"]
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        return BertForSequenceClassification(cfg)


def _llama_norm_and_rope(dim: int) -> tuple[Any, Any]:
    """torchtitan's RMSNorm (models/norms.py: normalised over an fp32 copy, cast back, times the weight) and its
    apply_rotary_emb (models/llama/model.py: q or k viewed as complex64 pairs, times freqs_cis)."""
    import torch
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.eps, self.weight = 1e-5, nn.Parameter(torch.ones(dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            f = x.float()
            return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        f = freqs[: x.shape[1]].view(1, x.shape[1], 1, xc.shape[-1])
        return torch.view_as_real(xc * f).flatten(3).type_as(x)

    return RMSNorm, rope


def llama(dims: dict[str, Any], seq: int = 8192) -> Any:
    """torchtitan's Llama 3 at 9dec370 (torchtitan/models/llama/model.py, models/norms.py), written from its code:
    RMSNorm over an fp32 copy, RoPE on complex64 views of q and k (freqs_cis a persistent complex64 buffer of
    ``seq`` rows: train.py sets max_seq_len to the training seq_len), GQA by expand + reshape, SwiGLU, an untied
    output returning bf16 logits under FSDP's mixed precision (the loss upcasts them)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    dim, heads, kv = dims["hidden_size"], dims["num_attention_heads"], dims["num_key_value_heads"]
    hd = dim // heads
    RMSNorm, rope = _llama_norm_and_rope(dim)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq = nn.Linear(dim, heads * hd, bias=False)
            self.wk = nn.Linear(dim, kv * hd, bias=False)
            self.wv = nn.Linear(dim, kv * hd, bias=False)
            self.wo = nn.Linear(heads * hd, dim, bias=False)

        def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q = self.wq(x).view(b, s, -1, hd)
            k = self.wk(x).view(b, s, -1, hd)
            v = self.wv(x).view(b, s, -1, hd)
            q, k = rope(q, freqs), rope(k, freqs)
            rep = q.shape[2] // k.shape[2]
            k, v = (t.unsqueeze(3).expand(b, s, t.shape[2], rep, hd).reshape(b, s, -1, hd) for t in (k, v))
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            return self.wo(y.transpose(1, 2).contiguous().view(b, s, -1))

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(dim, dims["intermediate_size"], bias=False)
            self.w2 = nn.Linear(dims["intermediate_size"], dim, bias=False)
            self.w3 = nn.Linear(dim, dims["intermediate_size"], bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm, self.attention = RMSNorm(), Attention()
            self.ffn_norm, self.feed_forward = RMSNorm(), FeedForward()

        def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
            h = x + self.attention(self.attention_norm(x), freqs)
            return h + self.feed_forward(self.ffn_norm(h))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(dims["vocab_size"], dim)
            self.register_buffer("freqs_cis", torch.empty(seq, hd // 2, dtype=torch.complex64), persistent=True)
            self.layers = nn.ModuleList(Block() for _ in range(dims["num_hidden_layers"]))
            self.norm = RMSNorm()
            self.output = nn.Linear(dim, dims["vocab_size"], bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.tok_embeddings(ids)
            for layer in self.layers:
                h = layer(h, self.freqs_cis)
            return self.output(self.norm(h))

    with torch.device("meta"):
        return Transformer()


def litgpt_gpt(dims: dict[str, Any]) -> Any:
    """litgpt's GPT as its fine-tuning table ran it (litgpt/model.py at 4a9b7e62, 2024-03-14, the commit that
    published the row), written from its code: one fused q/k/v projection viewed as query groups, k and v expanded
    to every head and copied by ``reshape`` (its comment: "training: flash attention requires it"), RoPE applied
    by ``apply_rope`` (halves rotated with ``cat``, ``x * cos + rotated * sin``, cast back) and ``cat`` with the
    unroped rest, SDPA with ``is_causal``, the heads' output transposed and copied, RMSNorm over an fp32 copy cast
    back before the weight, SwiGLU (``LLaMAMLP``), an untied head. cos and sin are fp32: finetune/full.py sets
    ``model.max_seq_length`` after Fabric has cast the model to bf16, and that setter rebuilds them from
    ``arange(...).float()``, so ``x * cos`` runs in fp32. They are made here at each forward (256 KiB at 512
    tokens); the run kept them as buffers."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    dim, heads, groups = dims["hidden_size"], dims["num_attention_heads"], dims["num_key_value_heads"]
    hs, per_group = dim // heads, dims["num_attention_heads"] // dims["num_key_value_heads"]

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.eps, self.weight = 1e-5, nn.Parameter(torch.ones(dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            f = x.float()
            normed = f * torch.rsqrt(torch.mean(f * f, dim=-1, keepdim=True) + self.eps)
            return normed.to(dtype=x.dtype) * self.weight

    def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated = torch.cat((-x[..., hs // 2:], x[..., : hs // 2]), dim=-1)
        return ((x * cos) + (rotated * sin)).to(dtype=x.dtype)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Linear(dim, (heads + 2 * groups) * hs, bias=False)
            self.proj = nn.Linear(heads * hs, dim, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            qkv = self.attn(x).view(b, t, groups, per_group + 2, hs).permute(0, 2, 3, 1, 4)
            q, k, v = qkv.split((per_group, 1, 1), dim=2)
            k, v = (z.expand(b, groups, per_group, t, hs) for z in (k, v))
            q, k, v = (z.reshape(b, -1, t, hs) for z in (q, k, v))
            q = torch.cat((apply_rope(q, cos, sin), q[..., hs:]), dim=-1)
            k = torch.cat((apply_rope(k, cos, sin), k[..., hs:]), dim=-1)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=1.0 / hs ** 0.5, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, heads * hs))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc_1 = nn.Linear(dim, dims["intermediate_size"], bias=False)
            self.fc_2 = nn.Linear(dim, dims["intermediate_size"], bias=False)
            self.proj = nn.Linear(dims["intermediate_size"], dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm_1, self.attn, self.norm_2, self.mlp = RMSNorm(), Attention(), RMSNorm(), MLP()

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            x = self.attn(self.norm_1(x), cos, sin) + x
            return self.mlp(self.norm_2(x)) + x

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(dim, dims["vocab_size"], bias=False)
            self.wte = nn.Embedding(dims["vocab_size"], dim)
            self.h = nn.ModuleList(Block() for _ in range(dims["num_hidden_layers"]))
            self.ln_f = RMSNorm()

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            t = idx.size(1)
            theta = 1.0 / (10000 ** (torch.arange(0, hs, 2, device=idx.device).float() / hs))
            angles = torch.outer(torch.arange(t, device=idx.device) / 1, theta).repeat(1, 2)
            cos, sin = torch.cos(angles), torch.sin(angles)
            x = self.wte(idx)
            for block in self.h:
                x = block(x, cos, sin)
            return self.lm_head(self.ln_f(x))

    with torch.device("meta"):
        return GPT()


# --------------------------------------------------------------------------- the authors' loops


def torch110_softmax() -> Any:
    """A context under which ``F.softmax`` keeps for backward what torch 1.10's autograd kept: its input as well as its
    output. torch up to 1.10 generated ``SoftmaxBackward`` with ``self`` saved beside ``result`` although the kernel
    reads only the output (pytorch/pytorch#49600); torch 1.11 saves the input's dtype instead (pytorch/pytorch#65242,
    relanded as #66018, October 2021). Under CUDA autocast softmax runs in fp32 (autocast's fp32 list in both
    versions), so the input kept is the fp32 copy autocast made. The BERT rows' run used torch 1.10: with this mode
    their step keeps one more ``batch x heads x seq x seq`` tensor per layer (64 MiB in fp32 at batch 4, heads 16,
    seq 512), as the run did."""
    import torch
    import torch.nn.functional as F

    class SoftmaxKeepingInput(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, dim: int) -> Any:
            # a half input is autocast's (the BERT rows' fp16 is amp): softmax ran on its fp32 copy
            kept = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
            out = torch._softmax(kept, dim, False)
            ctx.save_for_backward(kept, out)
            ctx.dim, ctx.dtype = dim, x.dtype
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            _kept, out = ctx.saved_tensors
            return torch._softmax_backward_data(grad, out, ctx.dim, out.dtype).to(ctx.dtype), None

    @contextlib.contextmanager
    def patched() -> Iterator[None]:
        # F.softmax replaced for the step, not a TorchFunctionMode: the non-reentrant checkpoint's recomputation
        # runs in backward, where a mode entered around the step is not on the stack, and it must keep what the
        # forward kept
        native = F.softmax

        def softmax(x: Any, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> Any:
            if dtype is None and dim is not None and torch.is_grad_enabled() and x.requires_grad:
                return SoftmaxKeepingInput.apply(x, dim)
            return native(x, dim, _stacklevel, dtype)

        F.softmax = softmax
        try:
            yield
        finally:
            F.softmax = native

    return patched()


class HFTrainer2022:
    """One optimizer step of the HF Trainer of January 2022 (transformers 4.16, torch 1.10), as the source ran
    it: ``grad_accum`` micro-batches of ``model(**inputs).loss / grad_accum`` backward (through a GradScaler with
    fp16), then ``clip_grad_norm_(1.0)`` (torch 1.10's per-parameter norms: foreach=False), the optimizer step,
    the scheduler, and ``model.zero_grad()`` (set_to_none=False on torch 1.10: the gradients stay allocated)."""

    def __init__(self, grad_accum: int, fp16: bool) -> None:
        self.grad_accum, self.fp16 = grad_accum, fp16
        self.opt: Any = None

    def __call__(self, model: Any, opt: Any, inputs: Any) -> Any:
        import torch

        if opt is not self.opt:  # a new twin: the Trainer builds its scaler and scheduler once
            self.opt = opt
            self.scaler = torch.amp.GradScaler("cuda") if self.fp16 else None
            self.sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        with torch110_softmax():  # the run's torch 1.10 kept softmax's input for backward (see there)
            for _ in range(self.grad_accum):
                loss = model(**inputs).loss / self.grad_accum
                (self.scaler.scale(loss) if self.scaler else loss).backward()
        if self.scaler:
            self.scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        if self.scaler:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()
        self.sched.step()
        model.zero_grad(set_to_none=False)
        return loss.detach()


class Torchtitan2024:
    """One step of torchtitan's train.py at 9dec370 (2024-12-26): zero_grad, forward, the loss on logits upcast to
    fp32 (its loss_fn: ``cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))``),
    ``del pred`` before backward, ``clip_grad_norm_(1.0, foreach=True)``, the step, the scheduler."""

    def __init__(self) -> None:
        self.opt: Any = None

    def __call__(self, model: Any, opt: Any, inputs: Any, targets: Any) -> Any:
        import torch
        import torch.nn.functional as F

        if opt is not self.opt:
            self.opt = opt
            self.sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        opt.zero_grad()
        pred = model(inputs)
        loss = F.cross_entropy(pred.flatten(0, 1).float(), targets.flatten(0, 1))
        del pred  # torchtitan: "need to free to before bwd to avoid peaking memory"
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        self.sched.step()
        return loss.detach()


class LitGPTFull:
    """One optimizer step of litgpt's finetune/full.py on one device: ``grad_accum`` micro-batches of
    ``logits = model(input_ids)``, ``chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])`` (litgpt/utils.py:
    128-row chunks, no upcast), ``fabric.backward(loss / grad_accum)``; then ``optimizer.step()``,
    ``optimizer.zero_grad()``, ``scheduler.step()``. The loop's ``logits`` variable keeps the last logits alive
    through the optimizer step and the next forward, until ``model(...)`` returns the next ones: held here too."""

    def __init__(self, grad_accum: int) -> None:
        self.grad_accum = grad_accum
        self.opt: Any = None
        self.logits: Any = None

    def __call__(self, model: Any, opt: Any, inputs: Any, targets: Any) -> Any:
        import torch
        import torch.nn.functional as F

        if opt is not self.opt:
            self.opt, self.logits = opt, None
            self.sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        for _ in range(self.grad_accum):
            self.logits = model(inputs)  # the previous logits are freed only now
            flat = self.logits[..., :-1, :].reshape(-1, self.logits.size(-1))
            target = targets[..., 1:].reshape(-1)
            chunks = [F.cross_entropy(lc, tc, ignore_index=-100, reduction="none")
                      for lc, tc in zip(flat.split(128), target.split(128))]
            loss = torch.cat(chunks).sum() / max(1, target.numel())  # litgpt: (targets != ignore).sum()
            del flat, chunks
            (loss / self.grad_accum).backward()
        opt.step()
        opt.zero_grad()
        self.sched.step()
        return None


def torchtitan_parallelize(model: Any, mesh: Any) -> Any:
    """torchtitan's parallelize_llama for 1D FSDP at 9dec370 (torchtitan/parallelisms/parallelize_llama.py):
    selective op activation checkpointing on every block (save the outputs of mm, the SDPA kernels,
    reduce_scatter, abs and max, except every second mm), then fully_shard each block (the last one not resharded
    after forward) and the root, param bf16 / reduce fp32."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops.aten.abs.default,
            torch.ops.aten.max.default}

    def context() -> Any:
        counts = {"forward": 0, "recompute": 0}

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            mode = "recompute" if ctx.is_recompute else "forward"
            if func == torch.ops.aten.mm.default:
                counts[mode] += 1
            keep = func in save and not (func == torch.ops.aten.mm.default and counts[mode] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, context_fn=context, preserve_rng_state=False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):  # the last block stays unsharded after forward (prefetched anyway)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(model.layers) - 1)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


# --------------------------------------------------------------------------- one row


def optimizer_factory(name: str) -> Callable[[Any], Any]:
    import torch

    if name == "adamw":  # adamw_hf / torchtitan's AdamW: the HF rows' per-parameter loop, torchtitan's foreach
        return lambda ps: torch.optim.AdamW(ps, lr=5e-5)
    if name == "adafactor":  # Trainer's optim="adafactor" (trainer.py, 4.16): no scaling, no relative step
        from transformers.optimization import Adafactor
        return lambda ps: Adafactor(ps, scale_parameter=False, relative_step=False, lr=5e-5)
    raise ValueError(f"no optimizer {name!r}")


def simulate(row: dict[str, Any], dims: dict[str, Any], extrapolate: "int | None") -> Any:
    """The memprof estimate of the row's run (an ``Estimate``)."""
    memprof = import_memprof()
    import torch

    if row["loop"] == "hf-trainer-2022":
        model = bert(dims)
        if row["checkpointing"]:
            model.gradient_checkpointing_enable()
        inputs = {"input_ids": torch.empty(row["batch"], row["seq"], dtype=torch.long, device="meta"),
                  "labels": torch.empty(row["batch"], dtype=torch.long, device="meta")}
        step = HFTrainer2022(row["grad_accum"], row["precision"] == "mixed-fp16")
        opt = optimizer_factory(row["optimizer"])
        if row["optimizer"] == "adamw":  # transformers.AdamW (adamw_hf): a Python loop over the parameters
            opt = lambda ps: torch.optim.AdamW(ps, lr=5e-5, foreach=False)  # noqa: E731
        return memprof.estimate(model, opt, inputs=inputs, train_step=step, gpu=row["gpu"],
                                precision=row["precision"], extrapolate=extrapolate)
    if row["loop"] == "torchtitan-2024-12":
        ids = torch.empty(row["batch"], row["seq"], dtype=torch.long, device="meta")
        return memprof.estimate(llama(dims, row["seq"]), lambda ps: torch.optim.AdamW(ps, lr=3e-4, foreach=True),
                                inputs=ids, targets=ids, train_step=Torchtitan2024(), gpu=row["gpu"],
                                # flash: torch of 2024-12 ran flash attention (cuDNN's was deprioritized), and
                                # torchtitan's save list names flash and efficient attention, not cuDNN's
                                attention="flash",
                                world_size=row["world_size"], mesh={"dp": row["world_size"]},
                                parallelize=torchtitan_parallelize, extrapolate=extrapolate)
    if row["loop"] == "litgpt-full":
        ids = torch.empty(row["batch"], row["seq"], dtype=torch.long, device="meta")
        return memprof.estimate(litgpt_gpt(dims), lambda ps: torch.optim.AdamW(ps, lr=2e-4, weight_decay=0.0,
                                                                             betas=(0.9, 0.95)),
                                inputs=ids, targets=ids, train_step=LitGPTFull(row["grad_accum"]), gpu=row["gpu"],
                                precision="bf16", extrapolate=extrapolate)
    raise ValueError(f"no loop {row['loop']!r}")


def memprof_counter(est: Any, counter: str) -> int:
    """memprof's figure for the counter the source reported."""
    dm = est.device_memory
    if counter == "nvidia-smi":
        return int(dm.device_peak)
    if counter in ("reserved_bytes.all.peak", "max_memory_reserved"):
        return int(dm.peak_reserved)
    if counter == "max_memory_allocated":
        return int(dm.peak_allocated)
    raise ValueError(f"no counter {counter!r}")


# --------------------------------------------------------------------------- the estimators users pick instead


def closed_form(row: dict[str, Any], dims: dict[str, Any], n_params: int) -> int:
    """Bytes per parameter (HF: 16 fp32 AdamW, 18 mixed; 8 fp32 Adafactor as memprof.anatomy counts it; ZeRO-3's
    16Ψ/N_d for FSDP) plus Korthikanti et al. 2022's activations of every layer and the output (fp32 logits)."""
    from memprof.anatomy import LayerShape, bytes_per_param, transformer_activations_total, zero_model_states

    mixed = row["precision"] != "fp32"
    if row["layout"] == "fsdp2":
        states = zero_model_states(n_params, row["world_size"], 3)
    elif row["precision"] == "bf16":  # bf16 parameters, gradients and AdamW states: 2 + 2 + 4 (HF)
        states = int(bytes_per_param("bf16", row["optimizer"]) * n_params)
    else:
        states = int(bytes_per_param("mixed" if mixed else "fp32", row["optimizer"]) * n_params)
    shape = LayerShape(seq_len=row["seq"], batch=row["batch"], hidden=dims["hidden_size"],
                       heads=dims["num_attention_heads"], ffn_hidden=dims["intermediate_size"],
                       kv_heads=dims["num_key_value_heads"])
    llama_like = row["loop"] != "hf-trainer-2022"
    recompute = {True: "full", False: None, "selective-op": "selective", "full": "full"}[row["checkpointing"]]
    acts = transformer_activations_total(
        shape, dims["num_hidden_layers"], dropout=not llama_like, attention="flash" if llama_like else "eager",
        bytes_per_element=2 if mixed else 4, mlp="swiglu" if llama_like else "gelu", recompute=recompute,
        # the logits term only where the model has an LM head (BERT's classifier has 2 outputs)
        outside_layers=llama_like, vocab_size=dims["vocab_size"] if llama_like else None)
    return states + acts


def deepspeed_estimate(row: dict[str, Any], n_params: int, largest_layer: int) -> int:
    """DeepSpeed's model-state estimator for the layout: ZeRO-2 on one GPU, ZeRO-3 for FSDP (8 GPUs a node)."""
    from memprof.anatomy import deepspeed_zero2_estimate, deepspeed_zero3_estimate

    if row["layout"] == "fsdp2":
        nodes = max(1, row["world_size"] // 8)
        return deepspeed_zero3_estimate(n_params, largest_layer, min(8, row["world_size"]), nodes,
                                        offload_params=False, offload_optimizer=False, zero_init=True).per_gpu
    return deepspeed_zero2_estimate(n_params, 1, 1, offload_optimizer=False).per_gpu


def accelerate_estimate(row: dict[str, Any], model: Any) -> int:
    """``accelerate estimate-memory``'s "Training using Adam" for the row's dtype, computed by accelerate's own
    functions (accelerate/commands/estimate.py: calculate_maximum_sizes on the fp32 meta model, then
    estimate_training_usage): 4 x the fp32 size for float32, 2 x for float16/bfloat16; batch 1, no activations."""
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    total, _ = calculate_maximum_sizes(model.float())
    dtype = "float32" if row["precision"] == "fp32" else ("float16" if "fp16" in row["precision"] else "bfloat16")
    return int(max(estimate_training_usage(total, dtype).values()))


def sizes(model: Any) -> tuple[int, int]:
    """Parameters (tied ones once) and the largest layer's (DeepSpeed's largest_layer_params: one module's own)."""
    seen = {id(p): p.numel() for p in model.parameters()}
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return sum(seen.values()), largest


# --------------------------------------------------------------------------- driver


def run_row(row: dict[str, Any], data: dict[str, Any], extrapolate: "int | None") -> dict[str, Any]:
    dims = data["models"][row["model"]]
    published = round(row["published"] * UNITS[row["unit"]])
    probe = {"hf-trainer-2022": bert, "torchtitan-2024-12": llama, "litgpt-full": litgpt_gpt}[row["loop"]](dims)
    n_params, largest = sizes(probe)
    t0 = time.perf_counter()
    est = simulate(row, dims, extrapolate)
    seconds = time.perf_counter() - t0
    ours = memprof_counter(est, row["counter"])
    dm = est.device_memory

    def err(x: int) -> float:
        return round(100.0 * (x - published) / published, 2)

    others = {"closed_form": closed_form(row, dims, n_params),
              "deepspeed": deepspeed_estimate(row, n_params, largest),
              "accelerate": accelerate_estimate(row, probe)}
    return {"id": row["id"], "source": row["source"], "section": row["section"], "counter": row["counter"],
            "published_bytes": published, "memprof_bytes": ours, "memprof_error_pct": err(ours),
            "memprof_parts": {"peak_allocated": int(dm.peak_allocated), "peak_reserved": int(dm.peak_reserved),
                              "outside_torch": int(dm.outside_bytes), "device_peak": int(dm.device_peak),
                              "peak_at": f"step {est.trace.peak_step} {est.trace.peak_phase.value}",
                              "categories": {c.value: int(v) for c, v in est.peak.items() if v}},
            "others": {k: {"bytes": int(v), "error_pct": err(int(v))} for k, v in others.items()},
            "same_code_paths": row["same_code_paths"], "code_paths": row["code_paths"],
            "parameters": n_params, "seconds": round(seconds, 1), "notes": list(est.notes)}


def summary(results: list[dict[str, Any]], key: Callable[[dict[str, Any]], float]) -> dict[str, Any]:
    errors = [key(r) for r in results]
    if not errors:
        return {}
    return {"median_abs_error_pct": round(statistics.median(abs(e) for e in errors), 2),
            "worst_pct": max(errors, key=abs), "under_estimates": sum(e < 0 for e in errors),
            "under_by_more_than_2pct": sum(e < -2 for e in errors), "rows": len(errors)}


def other_error(name: str) -> Callable[[dict[str, Any]], float]:
    """The error of the estimator ``name`` in a result row."""
    return lambda r: float(r["others"][name]["error_pct"])


def gib(b: int) -> str:
    return f"{b / 2**30:.2f}"


def markdown(out: dict[str, Any], data: dict[str, Any]) -> str:
    lines = [f"Command: `{out['command']}`; {out['machine']}, {out['date']}.", "",
             "Figures in GiB (2^30 B); error = (estimate - published) / published.", "",
             "| row | source, section | counter | published | memprof | error | closed form | DeepSpeed | accelerate |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    if out["layers_override"] is not None:
        lines[1:1] = ["", f"**Smoke run: every model cut to {out['layers_override']} layers (`--layers`); the errors "
                      "below are not the published rows' errors.**"]
    for r in out["results"]:
        o = r["others"]
        lines.append(f"| {r['id']} | {r['source']}, {r['section']} | {r['counter']} | {gib(r['published_bytes'])} | "
                     f"{gib(r['memprof_bytes'])} | {r['memprof_error_pct']:+.1f} % | "
                     + " | ".join(f"{gib(o[k]['bytes'])} ({o[k]['error_pct']:+.0f} %)"
                                  for k in ("closed_form", "deepspeed", "accelerate")) + " |")
    lines += ["", "| estimator | median abs. error | worst | under-estimates | under by more than 2 % |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for name, s in out["summary"].items():
        if s:
            lines.append(f"| {name} | {s['median_abs_error_pct']:.1f} % | {s['worst_pct']:+.1f} % | "
                         f"{s['under_estimates']} of {s['rows']} | {s['under_by_more_than_2pct']} |")
    lines += ["", "Code paths (rows whose library code memprof does not run as the source ran it):", ""]
    lines += [f"- {r['id']}: {r['code_paths']}" for r in out["results"] if not r["same_code_paths"]]
    lines += ["", "Not reproduced (need code paths memprof does not simulate):", "",
              "| row | source, section | published | reason |", "| --- | --- | ---: | --- |"]
    for r in data["not_reproduced"]:
        lines.append(f"| {r['id']} | {r['source']}, {r['section']} | {r['published']} {r['unit']} | {r['reason']} |")
    lines += ["", "Sources:", ""] + [f"- {k}: {s['url']} ({s['title']}); counter: {s['counter']}"
                                     for k, s in data["sources"].items()]
    for r in out["failures"]:
        lines.append(f"- FAILED {r['id']}: {r['error']}")
    return "\n".join(lines) + "\n"


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)} (a smoke test)")
    ap.add_argument("--rows", help="comma-separated row ids")
    ap.add_argument("--extrapolate", type=int, default=None,
                    help="simulate this many layers (and the next two) and extend the line; memprof then gives no "
                         "device figures, so the default simulates the whole model")
    ap.add_argument("--layers", type=int, default=None,
                    help="build every model with this many layers instead of its own: the same code paths in a "
                         "fraction of the time, for smoke runs (the figures then say nothing about the published "
                         "ones, and the output says so)")
    ap.add_argument("--json", default=str(HERE / "results" / "published.json"))
    ap.add_argument("--markdown", default=str(HERE / "results" / "published.md"))
    args = ap.parse_args(argv)
    import_memprof()
    data = json.loads(ROWS.read_text())
    if args.layers is not None:
        if args.layers < 1:
            raise SystemExit("--layers: give 1 or more")
        data["models"] = {k: {**dims, "num_hidden_layers": args.layers} for k, dims in data["models"].items()}
    wanted = QUICK if args.quick else (args.rows.split(",") if args.rows else [r["id"] for r in data["rows"]])
    rows = [r for r in data["rows"] if r["id"] in wanted]
    if len(rows) != len(wanted):
        raise SystemExit(f"unknown rows: {sorted(set(wanted) - {r['id'] for r in rows})}")
    results, failures = [], []
    for row in rows:
        try:
            results.append(run_row(row, data, args.extrapolate))
            r = results[-1]
            print(f"{row['id']}: published {gib(r['published_bytes'])} GiB, memprof {gib(r['memprof_bytes'])} GiB "
                  f"({r['memprof_error_pct']:+.1f} %) in {r['seconds']} s", flush=True)
        except Exception as exc:  # a row that fails is reported, the others still run
            failures.append({"id": row["id"], "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(f"{row['id']}: FAILED {failures[-1]['error'][:300]}", flush=True)
    import torch
    import transformers

    out = {"command": " ".join(["python", "benchmarks/published.py", *(argv or sys.argv[1:])]),
           "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
                      f"transformers {transformers.__version__}, Python {platform.python_version()}",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results, "failures": failures,
           # Models cut to this many layers (a smoke run): the errors are not the published rows' errors.
           "layers_override": args.layers,
           "summary": {"memprof": summary(results, lambda r: r["memprof_error_pct"]),
                       "memprof, rows on the source's code paths": summary(
                           [r for r in results if r["same_code_paths"]], lambda r: r["memprof_error_pct"]),
                       **{k: summary(results, other_error(k)) for k in ("closed_form", "deepspeed", "accelerate")}}}
    pathlib.Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    pathlib.Path(args.markdown).write_text(markdown(out, data))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
