"""FSDP1 (``FullyShardedDataParallel``) on the simulation's fake process group: the user's function builds its
units on fake CPU tensors (:func:`fsdp1_in_fake_mode`), and ``estimate(parallel="fsdp1")`` is such a function of
memprof's own (:func:`fsdp1_parallelize`).

FSDP1 flattens each unit's parameters into one ``FlatParameter``, shards it over the mesh, gathers it around the
unit's forward and backward and reduce-scatters its gradient (torch/distributed/fsdp/_flat_param.py,
_runtime_utils.py): all of it FSDP1's own code, run on the fake tensors, and measured by
:mod:`memprof.collect.flat_shards` as a real rank is.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from ..errors import SimulationError, is_interrupt

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel

    from .aliases import UserValue

__all__ = ["fsdp1_in_fake_mode", "fsdp1_notes", "fsdp1_parallelize", "has_meta", "unwrapped"]


def fsdp1_parallelize() -> "Callable[[nn.Module, DeviceMesh], nn.Module]":
    """The function ``estimate(parallel="fsdp1")`` runs: FSDP1 over the whole mesh, as accelerate's and Lightning's
    FSDP1 configurations wrap a transformer: each block of the repeated stack a unit (the blocks the other
    data-parallel layouts gather one at a time, memprof.simulate.ranks), the root for the rest, ``FULL_SHARD``,
    ``use_orig_params=True`` (both their defaults), ``limit_all_gathers=True`` and backward prefetching
    (``BACKWARD_PRE``), FSDP1's own defaults."""

    def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        from .ranks import unit_blocks

        blocks = {id(m) for m, _ in unit_blocks(model)}
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in blocks)
        return FullyShardedDataParallel(model, auto_wrap_policy=policy, device_mesh=mesh,
                                        device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD,
                                        use_orig_params=True, limit_all_gathers=True)

    parallelize.__qualname__ = "fsdp1"
    return parallelize


def fsdp1_notes(said: list[str]) -> list[str]:
    """What an estimate of FSDP1 assumes, after what the simulation did to its arguments (``said``)."""
    return [*said,
            "FSDP1 (FullyShardedDataParallel): each unit was built on fake CPU tensors (materialised before FSDP1 "
            "flattened them), its flat parameter sharded, gathered and reduce-scattered by FSDP1's own code, in the "
            "order FSDP1 runs on one stream: a unit's all-gather done before its forward, the next unit's prefetched "
            "as configured (forward_prefetch, backward_prefetch), what limit_all_gathers holds back held back",
            "FSDP1 on a GPU: its all-gather outputs are made on its unshard stream, the low-precision shards on its "
            "pre-unshard stream and the reduce-scatter outputs (the sharded gradients) on its post-backward stream; "
            "the allocator replay keeps each of those streams' blocks in a pool of its own, as the caching "
            "allocator does (the streams FSDP1 enters are noted as the run makes them current). A resharded unit's "
            "gathered parameter is marked used on the compute stream (record_stream) before FSDP1 frees it, so its "
            "block stays out of the cache until the GPU has used it: the replay holds each such block until the "
            "rate limiter would have waited for it (limit_all_gathers=True: two frees in flight, the oldest waited "
            "for before the next all-gather), the most the CPU can run ahead; with limit_all_gathers=False, until "
            "every unit has been gathered again (an upper bound: the CPU may run that far ahead). The other blocks "
            "FSDP1 marks so (the low-precision shards, gradients on their way to the reduce-scatter) are freed at "
            "once"]


def _off_cpu(device: "int | str | torch.device") -> bool:
    """Whether FSDP1's ``device_id`` names a device other than the CPU (an int is an accelerator's index, which
    ``torch.device`` cannot even read on a machine without one)."""
    if isinstance(device, int):
        return True
    try:
        return torch.device(device).type != "cpu"
    except (RuntimeError, TypeError, ValueError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return True


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def unwrapped(name: str) -> str:
    """A parameter's name without FSDP1's and activation checkpointing's wrapper modules
    (torch/distributed/fsdp/_common_utils.py, clean_tensor_name)."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def _to_empty_keeping_ties(module: nn.Module) -> None:
    """``module.to_empty(device="cpu")`` in the fake mode, its shared parameters shared still: ``nn.Module._apply``
    gives each module a new Parameter of its own when the tensor's type changes (meta to fake), which would untie a
    tied embedding and head, and FSDP1 would flatten it twice."""
    first: dict[int, tuple[nn.Module, str]] = {}
    shared: list[tuple[nn.Module, str, nn.Module, str]] = []
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                shared.append((m, name, *first[id(p)]))
            else:
                first[id(p)] = (m, name)
    module.to_empty(device="cpu")
    for m, name, owner, owner_name in shared:
        m._parameters[name] = owner._parameters[owner_name]


@contextlib.contextmanager
def fsdp1_in_fake_mode(fake_mode: FakeTensorMode, notes: list[str]) -> Iterator[None]:
    """While the user's function runs, FSDP1 (``FullyShardedDataParallel``) builds its units on fake CPU tensors.

    FSDP1 flattens a unit's parameters into one ``FlatParameter`` as it is constructed, and materialises a meta
    module itself on its ``device_id`` with real tensors (torch/distributed/fsdp/_init_utils.py,
    ``_materialize_meta_module``): on the meta twin that is the whole model's memory, for real. So its
    constructor is wrapped for the block (restored after it, also when it raises): the module it is given is
    materialised as fake CPU tensors first (``to_empty``, as the twin would be after the function), and FSDP1's
    own constructor runs in the fake mode, on the CPU (``device_id`` is the simulation's device: the model is
    simulated on fake CPU tensors whatever device the script names)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        yield
        return
    original = FullyShardedDataParallel.__init__

    def init(self: FullyShardedDataParallel, module: nn.Module, *args: UserValue, **kwargs: UserValue) -> None:
        if getattr(kwargs.get("cpu_offload"), "offload_params", False):
            raise SimulationError(
                "FSDP1 with cpu_offload=CPUOffload(offload_params=True) cannot be simulated: FSDP1 pins the host "
                "shards (pin_memory, torch/distributed/fsdp/_flat_param.py), which needs an accelerator and has no "
                "fake-tensor kernel. Estimate without cpu_offload (the offloaded shards, their gradients and the "
                "optimizer states then count on the device: an upper bound), or shard with FSDP2's fully_shard and "
                "CPUOffloadPolicy(pin_memory=False), which memprof simulates with host and device memory apart")
        device = kwargs.get("device_id")
        moved = f"FSDP1's device_id={device!r} was the CPU: the units are simulated on fake CPU tensors"
        if device is not None and _off_cpu(device) and moved not in notes:
            notes.append(moved)
        if "device_id" in kwargs:
            kwargs["device_id"] = torch.device("cpu")
        if kwargs.get("sync_module_states"):
            # FSDP1 refuses it for CPU tensors (_check_module_states_for_sync_module_states); it broadcasts rank 0's
            # states once, as the model is wrapped, before any training step.
            kwargs["sync_module_states"] = False
            said = ("FSDP1's sync_module_states=True was left out: it broadcasts rank 0's parameters and buffers once, "
                    "when the model is wrapped, before the step simulated (and FSDP1 does it only for GPU tensors)")
            if said not in notes:
                notes.append(said)
        with fake_mode:
            if has_meta(module):
                _to_empty_keeping_ties(module)
            original(self, module, *args, **kwargs)

    FullyShardedDataParallel.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        FullyShardedDataParallel.__init__ = original  # type: ignore[method-assign]
