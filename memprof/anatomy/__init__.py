"""The analytic model of training memory: pure functions of shapes, dtypes and configuration.

No hooks and no profiler here. Every constant cites its primary source (a paper
and section, a documentation page or a source file); the derivations are collected
in ``docs/anatomy.md``:

* :mod:`.params` -- bytes per parameter by precision regime and optimizer (HF, ZeRO).
* :mod:`.optimizers` -- state and step-temporary bytes of real optimizer objects (the formulas of
  torch.optim's and bitsandbytes' classes: :mod:`.optimizer_rules`).
* :mod:`.activations` -- Korthikanti's transformer closed forms and per-module saved-bytes rules; they take a
  layer's shape and the parallel degrees as :mod:`.shapes`' records, which :mod:`.parallelism` (one rank's terms)
  shares.
* :mod:`.zero` -- ZeRO stage formulas and the DeepSpeed estimators.
* :mod:`.allocator` -- a model of torch's CUDA caching allocator (:mod:`.alloc_config` parses
  ``PYTORCH_CUDA_ALLOC_CONF``; :mod:`.alloc_replay` replays an allocation stream through it).
* :mod:`.outside` -- the CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers, CUDA-graph pools.
* :mod:`.gpus` -- GPUs by name: memory as the driver reports it, compute capability.
* :mod:`.predict` -- the per-module and optimizer formulas applied to a recorded run.
* :mod:`.inference`, :mod:`.caches`, :mod:`.cache_config` -- inference caches per layer, as implementations
  keep them, and the cache a transformers config describes.
"""

from __future__ import annotations

from .activations import (
    TensorMeta,
    cross_entropy_saved_bytes,
    module_saved_bytes,
    register_saved_rule,
    saved_bytes_rule,
    transformer_activations_total,
    transformer_layer_activations,
    transformer_layer_terms,
)
from . import hf_rules  # noqa: F401  (the transformers layer rules, registered by name)
from .alloc_config import AllocatorConfig
from .alloc_replay import ReplayResult, replay
from .allocator import (
    CUDA_CONTEXT_RANGE,
    CachingAllocator,
    cublas_workspace_bytes,
    pool_of,
    round_size,
    segment_size,
)
from .gpus import GpuSpec, gpu, known_gpus
from .outside import (
    OutsideTerm,
    cublas_workspaces,
    cublaslt_workspace_bytes,
    cuda_context,
    cuda_graph_pool,
    cudnn_workspace,
    nccl_buffer_sizes,
    nccl_communicator,
)
from .optimizers import (
    OptimizerFormula,
    optimizer_formula,
    optimizer_implementation,
    param_group_implementations,
    predict_optimizer_state_bytes,
    predict_optimizer_step_transient_bytes,
    register_optimizer_formula,
)
from .optimizer_rules import bitsandbytes_formula  # and torch.optim's formulas, registered on import
from .inference import kv_cache_bytes
from .caches import CacheSpec, Slot, bytes_at, cache_bytes, call_slots, latent_attention_dims, sliding_kept_tokens
from .cache_config import cache_spec
from .params import BytesPerParam, bytes_per_param, bytes_per_param_breakdown, textbook_regime
from .predict import ActivationPrediction, OptimizerPrediction, predict_activations, predict_optimizers
from .zero import DeepSpeedEstimate, deepspeed_zero2_estimate, deepspeed_zero3_estimate, zero_model_states
from .shapes import LayerShape, Parallelism

__all__ = [
    "kv_cache_bytes",
    "CacheSpec",
    "Slot",
    "cache_spec",
    "call_slots",
    "cache_bytes",
    "bytes_at",
    "sliding_kept_tokens",
    "latent_attention_dims",
    "BytesPerParam",
    "bytes_per_param",
    "bytes_per_param_breakdown",
    "textbook_regime",
    "OptimizerFormula",
    "register_optimizer_formula",
    "optimizer_formula",
    "optimizer_implementation",
    "param_group_implementations",
    "predict_optimizer_state_bytes",
    "predict_optimizer_step_transient_bytes",
    "bitsandbytes_formula",
    "TensorMeta",
    "LayerShape",
    "Parallelism",
    "transformer_layer_terms",
    "transformer_layer_activations",
    "transformer_activations_total",
    "register_saved_rule",
    "saved_bytes_rule",
    "module_saved_bytes",
    "cross_entropy_saved_bytes",
    "zero_model_states",
    "DeepSpeedEstimate",
    "deepspeed_zero2_estimate",
    "deepspeed_zero3_estimate",
    "round_size",
    "pool_of",
    "segment_size",
    "cublas_workspace_bytes",
    "CUDA_CONTEXT_RANGE",
    "CachingAllocator",
    "AllocatorConfig",
    "replay",
    "ReplayResult",
    "GpuSpec",
    "gpu",
    "known_gpus",
    "OutsideTerm",
    "cuda_context",
    "cublaslt_workspace_bytes",
    "cublas_workspaces",
    "cudnn_workspace",
    "nccl_buffer_sizes",
    "nccl_communicator",
    "cuda_graph_pool",
    "predict_activations",
    "predict_optimizers",
    "ActivationPrediction",
    "OptimizerPrediction",
]
