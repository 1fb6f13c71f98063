"""ZeRO model-state formulas and the DeepSpeed memory estimators.

Sources: Rajbhandari et al. 2019, "ZeRO" (arXiv 1910.02054), §3.1 (model
states), §5 (ZeRO-DP stages), Fig. 1 and Table I; DeepSpeed
``runtime/zero/stage_1_and_2.py::estimate_zero2_model_states_mem_needs``
and ``runtime/zero/stage3.py::estimate_zero3_model_states_mem_needs``
(``docs/code-docs/source/memory.rst``). Derivations and oracles:
``docs/anatomy.md#zero-and-deepspeed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..errors import InvalidArgumentError
from ..units import as_count, round_half_away

__all__ = [
    "STAGES",
    "ZERO_OPTIMIZER_BYTES",
    "DEEPSPEED_BUFFER_FACTOR",
    "DeepSpeedEstimate",
    "zero_model_states",
    "deepspeed_zero2_estimate",
    "deepspeed_zero3_estimate",
]

#: The ZeRO stage of each parallel layout memprof measures or simulates (Rajbhandari et al. 2019 (ZeRO), §5:
#: 1 partitions the optimizer states, 2 the gradients too, 3 the parameters too; DDP partitions nothing, and
#: FSDP's full sharding partitions all three, as stage 3). "tp", tensor parallelism without a data-parallel
#: wrapper, shards by placements, not by stage, and has none.
STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "fsdp2": 3, "fsdp1": 3}

#: K for mixed-precision Adam: fp32 params + momentum + variance, 4 B each (Rajbhandari et al. 2019 (ZeRO), §3.1).
ZERO_OPTIMIZER_BYTES = 12
#: DeepSpeed's ``additional_buffer_factor`` default on CPU memory, 1.5 (DeepSpeed runtime/zero/stage_1_and_2.py,
#: runtime/zero/stage3.py; docs/code-docs/source/memory.rst).
DEEPSPEED_BUFFER_FACTOR = Fraction(3, 2)

# 16-bit parameters and 16-bit gradients, 2 B each (Rajbhandari et al. 2019 (ZeRO), §3.1).
_FP16_PARAM_BYTES = 2
_FP16_GRAD_BYTES = 2


def _counts(**values: object) -> list[int]:
    # Whole-number floats are counts too: people write 7.5e9 parameters. GPUs and nodes start at 1.
    return [as_count(name, value, 1 if name.startswith("num_") and name != "num_params" else 0)
            for name, value in values.items()]


def zero_model_states(num_params: int, world_size: int, stage: int, *,
                      optimizer_bytes: int = ZERO_OPTIMIZER_BYTES) -> int:
    """Model-state bytes per GPU under ZeRO data parallelism (ZeRO §5, Fig. 1, Table I).

    ``stage`` 0 is the DP baseline ``(2+2+K)Ψ``; 1 (P_os) ``4Ψ + KΨ/N_d``;
    2 (P_os+g) ``2Ψ + (2+K)Ψ/N_d``; 3 (P_os+g+p) ``(2+2+K)Ψ/N_d``. Fractions of
    a byte are rounded half up at the end.
    """
    num_params, optimizer_bytes = _counts(num_params=num_params, optimizer_bytes=optimizer_bytes)
    world_size = as_count("world_size", world_size, 1)
    psi, k, nd = Fraction(num_params), Fraction(optimizer_bytes), world_size
    p, g = _FP16_PARAM_BYTES, _FP16_GRAD_BYTES
    if stage == 0:
        value = (p + g + k) * psi
    elif stage == 1:
        value = (p + g) * psi + k * psi / nd
    elif stage == 2:
        value = p * psi + (g + k) * psi / nd
    elif stage == 3:
        value = (p + g + k) * psi / nd
    else:
        raise InvalidArgumentError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    return round_half_away(value)


@dataclass(frozen=True)
class DeepSpeedEstimate:
    """Bytes per GPU and per CPU (host) that a DeepSpeed estimator prints (it prints GiB as "GB")."""

    per_gpu: int
    per_cpu: int


def deepspeed_zero2_estimate(
    num_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    *,
    offload_optimizer: bool,
    buffer_factor: Fraction = DEEPSPEED_BUFFER_FACTOR,
) -> DeepSpeedEstimate:
    """DeepSpeed's ``estimate_zero2_model_states_mem_needs`` (stage_1_and_2.py).

    GPU: ``2Ψ`` with the optimizer offloaded, else ``4Ψ + int(16Ψ/total_gpus)``.
    CPU: ``Ψ·max(4·gpus_per_node, 16)·1.5`` offloaded, else
    ``Ψ·4·gpus_per_node·1.5`` (needed at initialisation only).
    """
    num_params, num_gpus_per_node, num_nodes = _counts(
        num_params=num_params, num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes)
    total_gpus = num_nodes * num_gpus_per_node
    psi = num_params
    if offload_optimizer:
        gpu = 2 * psi
        cpu = psi * max(4 * num_gpus_per_node, 16) * buffer_factor
    else:
        gpu = 4 * psi + int(16 * psi / total_gpus)
        cpu = psi * 4 * num_gpus_per_node * buffer_factor
    return DeepSpeedEstimate(per_gpu=gpu, per_cpu=round_half_away(Fraction(cpu)))


def deepspeed_zero3_estimate(
    num_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    *,
    offload_params: bool,
    offload_optimizer: bool,
    zero_init: bool,
    buffer_factor: Fraction = DEEPSPEED_BUFFER_FACTOR,
) -> DeepSpeedEstimate:
    """DeepSpeed's ``estimate_zero3_model_states_mem_needs`` (stage3.py).

    ``largest_layer_memory = 4·largest_layer_params`` (gathered fp16 params and
    fp16 grads). GPU: no offload ``LLM + int(18Ψ/total_gpus)``; params and
    optimizer offloaded ``LLM``; optimizer only ``LLM + int(2Ψ/total_gpus)``.
    CPU uses ``gpus_factor = 1/num_nodes`` and 1.5 headroom (DeepSpeed stage3.py). Offloading
    parameters without the optimizer is not a DeepSpeed configuration and raises.
    """
    num_params, largest_layer_params, num_gpus_per_node, num_nodes = _counts(
        num_params=num_params,
        largest_layer_params=largest_layer_params,
        num_gpus_per_node=num_gpus_per_node,
        num_nodes=num_nodes,
    )
    if offload_params and not offload_optimizer:
        raise InvalidArgumentError(
            "offload_params=True needs offload_optimizer=True (DeepSpeed offloads parameters only with the optimizer)"
        )
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = Fraction(1, num_nodes)
    psi = num_params
    llm = 4 * largest_layer_params
    n = num_gpus_per_node
    if offload_optimizer:
        # 18 = fp32 params, grads, m, v (16) + 2 B fp16 params; 16 without the fp16 copy (DeepSpeed stage3.py,
        # docs/code-docs/source/memory.rst)
        per_param = 18 if offload_params else 16
        gpu = llm if offload_params else llm + int(2 * psi / total_gpus)
        if zero_init:
            cpu = psi * per_param * gpus_factor * buffer_factor
        else:
            cpu = psi * max(Fraction(4 * n), per_param * gpus_factor) * buffer_factor
    else:
        gpu = llm + int(18 * psi / total_gpus)
        cpu = (largest_layer_params if zero_init else psi) * 4 * n * buffer_factor
    return DeepSpeedEstimate(per_gpu=gpu, per_cpu=round_half_away(Fraction(cpu)))
