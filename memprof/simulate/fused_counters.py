"""A fused torch optimizer's step counters on the device, in the unfused twin a simulation steps.

torch's fused Adam, AdamW and Adagrad keep each parameter's ``step`` counter on the parameter's device
(``_init_group`` makes it ``torch.zeros((), dtype=_get_scalar_dtype(is_fused=True), device=p.device)``,
torch/optim/adam.py), where the for-loop step keeps it on the host. A simulation steps a fused optimizer unfused
(fused kernels do not run on shape-only tensors: :func:`memprof.simulate.twin._rebuilt`), so on a CUDA target its
counters were host tensors and no device bytes: the estimate from the first step on was under the real run's by a
512-byte allocator block per parameter tensor (149 KB for Llama-3-8B's 291 tensors). The twin keeps its host
counter, which its for-loop step reads, and is given a device tensor like the fused step's beside it, made as the
group's states are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.optim.optimizer as _optimizer_module

if TYPE_CHECKING:
    from collections.abc import Callable, Collection

__all__ = ["counters_on_device", "KEY"]

#: The twin's state key of the device counter (a real optimizer's state has no such key).
KEY = "memprof_fused_step"


def counters_on_device(optimizer: torch.optim.Optimizer, fused: "Collection[int]") -> bool:
    """Give the parameters of ``optimizer``'s groups at the indices ``fused`` a device counter beside each host
    ``step`` counter, as each group's states are made (its ``_init_group``). False where the class makes its states
    otherwise (no ``_init_group``: nothing to follow), True where the counters will be made."""
    original: "Callable[..., object] | None" = getattr(optimizer, "_init_group", None)
    if original is None or not fused:
        return False
    groups = [optimizer.param_groups[i] for i in fused]
    # torch's dtype for a fused step's counter (fp32 since torch 2.1), read where that torch names it.
    scalar_dtype = getattr(_optimizer_module, "_get_scalar_dtype", None)
    dtype = torch.float32 if scalar_dtype is None else scalar_dtype(is_fused=True)

    def init_group(group: "dict[str, object]", *args: object, **kwargs: object) -> object:
        out = original(group, *args, **kwargs)
        if any(group is g for g in groups):
            for p in group["params"]:  # type: ignore[attr-defined]  # a param group's list of tensors
                state = optimizer.state.get(p)
                if state is None or KEY in state:
                    continue
                counter = state.get("step")
                if isinstance(counter, torch.Tensor) and counter.device.type == "cpu":
                    state[KEY] = torch.zeros((), dtype=dtype, device=p.device)
        return out

    # This optimizer's alone (the twin's): its class keeps torch's. Optimizer declares no _init_group; its
    # subclasses that make states in groups do.
    optimizer._init_group = init_group  # type: ignore[attr-defined]
    return True
