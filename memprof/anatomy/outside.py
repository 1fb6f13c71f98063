"""Device memory beside the tensors: the CUDA context, library workspaces, NCCL buffers, CUDA-graph pools.

Each function returns an :class:`OutsideTerm`: the bytes to budget (the upper end of what is published,
since an under-estimate costs an OOM), the lower end where a range is known, the assumption made and the
source. ``through_allocator`` tells whether the bytes are blocks of torch's caching allocator (they count
in ``reserved`` and belong in an allocation replay: cuBLAS/cuDNN workspaces, CUDA-graph pools) or sit
outside it (``outside_torch``: the context, NCCL).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InvalidArgumentError, is_interrupt

__all__ = [
    "OutsideTerm",
    "CUDA_CONTEXT_RANGE",
    "CUDA_CONTEXT_LAZY_BYTES",
    "CUDA_CONTEXT_EAGER_BYTES",
    "CUDA_CONTEXT_BARE_LAZY_BYTES",
    "CUDA_CONTEXT_EAGER_MAX_BYTES",
    "CUBLAS_WORKSPACE_DEFAULT",
    "CUBLAS_WORKSPACE_HOPPER",
    "CUBLASLT_WORKSPACE_DEFAULT",
    "cuda_context",
    "cublas_workspace_bytes",
    "cublaslt_workspace_bytes",
    "cublas_workspaces",
    "cudnn_workspace",
    "nccl_buffer_sizes",
    "nccl_communicator",
    "cuda_graph_pool",
]

MiB = 1_048_576


@dataclass(frozen=True)
class OutsideTerm:
    """One term of device memory: ``bytes`` to budget, ``low`` (the lower end, ``bytes`` if exact), what was
    assumed, where the figures come from, and whether torch's allocator hands out the bytes."""

    name: str
    bytes: int
    assumption: str
    source: str
    low: int | None = None
    through_allocator: bool = False

    def __post_init__(self) -> None:
        if self.low is None:
            object.__setattr__(self, "low", self.bytes)


# ---------------------------------------------------------------------------------------- CUDA context

# PyTorch PR #86509 (and #85692): cudaMemGetInfo total - free after one small tensor, torch 1.13 with CUDA 11.7:
# 287,047,680 B with CUDA_MODULE_LOADING=LAZY, 666,632,192 B with DEFAULT (eager). From 1.13 torch sets LAZY when
# the variable is unset.
CUDA_CONTEXT_LAZY_BYTES = 287_047_680
CUDA_CONTEXT_EAGER_BYTES = 666_632_192
# A bare context with lazy loading, before any kernel: 256 MiB on an RTX 3090 with torch 2.7.1+cu128
# (invoke-ai/InvokeAI issue #9413, nvidia-smi); 426 MiB on an RTX 6000 Ada with torch 2.10+cu130
# (unslothai/unsloth-zoo PR #1053, nvidia-smi after torch.cuda.mem_get_info).
CUDA_CONTEXT_BARE_LAZY_BYTES = 256 * MiB
# 1343 MiB on a V100 with CUDA 11.2, every kernel loaded (HF "Model training anatomy"): the largest published
# eager figure. Lazy loading loads a subset of the same kernels, so it is the ceiling for fit decisions.
CUDA_CONTEXT_EAGER_MAX_BYTES = 1343 * MiB
#: A per-process budget for the context in GB (1e9): 0.3-1.5 GB, depending on driver, libraries and lazy loading.
CUDA_CONTEXT_RANGE: tuple[int, int] = (300_000_000, 1_500_000_000)

_CONTEXT_SOURCE = ("PyTorch PR #86509; ptrblck in PyTorch issues #107667 ('~300MB', '>1000MB' before CUDA 11.7) "
                   "and #109888 ('around 400MB'); invoke-ai/InvokeAI #9413; unslothai/unsloth-zoo PR #1053; "
                   "HF 'Model training anatomy'; CUDA C++ Programming Guide, 'Lazy Loading'")


def cuda_context(*, cuda_version: tuple[int, int] | None = None, module_loading: str | None = None,
                 gpu: str | None = None) -> OutsideTerm:
    """The CUDA context with the kernels a run loads, per process and device.

    Lazy loading (CUDA >= 11.7; torch sets ``CUDA_MODULE_LOADING=LAZY`` when unset since 1.13) loads kernels
    as they are first used, so the context grows from the bare 256-426 MiB toward the eager figure as a
    step runs; ``bytes`` is the eager ceiling, ``low`` the bare context. ``module_loading="EAGER"`` or a
    CUDA version below 11.7 loads everything at start: 636 MiB-1343 MiB. The published figures do not
    separate GPU generations, so ``gpu`` only enters the assumption text.
    """
    if module_loading is not None and module_loading.upper() not in ("LAZY", "EAGER", "DEFAULT"):
        raise InvalidArgumentError(f"module_loading must be 'LAZY' or 'EAGER', got {module_loading!r}")
    eager = (cuda_version is not None and tuple(cuda_version) < (11, 7)) or (
        module_loading is not None and module_loading.upper() in ("EAGER", "DEFAULT"))
    where = f" on {gpu}" if gpu else ""
    if eager:
        return OutsideTerm("cuda_context", CUDA_CONTEXT_EAGER_MAX_BYTES,
                           f"CUDA context{where} with every kernel loaded at start (eager module loading): 636 MiB "
                           "(torch 1.13, CUDA 11.7) to 1343 MiB (V100, CUDA 11.2); the upper figure is used",
                           _CONTEXT_SOURCE, low=CUDA_CONTEXT_EAGER_BYTES)
    return OutsideTerm("cuda_context", CUDA_CONTEXT_EAGER_MAX_BYTES,
                       f"CUDA context{where} with lazy module loading: 256-426 MiB bare, growing as kernels are "
                       "first used (287 MB after one op); bounded by the eager figure, 1343 MiB, which is used",
                       _CONTEXT_SOURCE, low=CUDA_CONTEXT_BARE_LAZY_BYTES)


# ---------------------------------------------------------------------------------------- cuBLAS / cuDNN

# aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize: the default CUBLAS_WORKSPACE_CONFIG
# ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB, and 4096 KiB x 8 = 32 MiB for compute-capability majors 9, 10, 11
# and 12 (Hopper and Blackwell; newer releases list 9/10/12 and later ones add 11).
CUBLAS_WORKSPACE_DEFAULT = 2 * 4096 * 1024 + 8 * 16 * 1024  # 8,519,680 B
CUBLAS_WORKSPACE_HOPPER = 32 * 1024 * 1024  # 33,554,432 B
_CUBLAS_BIG_MAJORS = (9, 10, 11, 12)
# parseCUDABlasLtWorkspaceSize: CUBLASLT_WORKSPACE_SIZE in KiB, default 1024 ("according to #73328").
CUBLASLT_WORKSPACE_DEFAULT = 1024 * 1024
_CUBLAS_SOURCE = "aten/src/ATen/cuda/CublasHandlePool.cpp (parseChosenWorkspaceSize, parseCUDABlasLtWorkspaceSize, " \
                 "getCUDABlasLtWorkspace)"
_WORKSPACE_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return {} if env is None else env


def _check_cc(compute_capability: object) -> tuple[int, int]:
    if (not isinstance(compute_capability, tuple) or len(compute_capability) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in compute_capability)):
        raise InvalidArgumentError(
            f"compute_capability must be a (major, minor) tuple of ints, got {compute_capability!r}")
    return compute_capability


def cublas_workspace_bytes(compute_capability: tuple[int, int], env: Mapping[str, str] | None = None) -> int:
    """One cuBLAS workspace (``getChosenWorkspaceSize``): 32 MiB for majors 9-12, else 8,519,680 B.

    ``CUBLAS_WORKSPACE_CONFIG`` in ``env`` overrides it as torch reads it: the sum of every ``:SIZE:COUNT``
    pair (SIZE in KiB); a value with no pair falls back to the default (torch warns).
    """
    major = _check_cc(compute_capability)[0]
    default = CUBLAS_WORKSPACE_HOPPER if major in _CUBLAS_BIG_MAJORS else CUBLAS_WORKSPACE_DEFAULT
    config = _env(env).get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        return default
    pairs = _WORKSPACE_PAIR.findall(config)
    return sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else default


def cublaslt_workspace_bytes(compute_capability: tuple[int, int], env: Mapping[str, str] | None = None) -> int:
    """The extra bytes of one cuBLASLt workspace, beyond the cuBLAS one.

    With ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` unset or 1 (the default outside fbcode) cuBLASLt shares the
    cuBLAS workspace of its (handle, stream): 0 extra bytes. Set to 0 it gets its own
    ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024 KiB); an unparsable value keeps the default.
    """
    _check_cc(compute_capability)
    env = _env(env)
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1").strip().lower() not in ("0", "false", "off", "no"):
        return 0
    match = re.match(r"\s*[+-]?\d+", env.get("CUBLASLT_WORKSPACE_SIZE", ""))
    return int(match.group()) * 1024 if match else CUBLASLT_WORKSPACE_DEFAULT


def cublas_workspaces(compute_capability: tuple[int, int], *, handles: int = 2, streams: int = 1,
                      env: Mapping[str, str] | None = None) -> OutsideTerm:
    """Every cuBLAS (and cuBLASLt) workspace of a run: one per (handle, stream) that runs a matmul.

    A handle belongs to a thread (``DeviceThreadHandlePool``); a training step uses two, the Python thread
    for forward and the autograd engine's device thread for backward, hence ``handles=2``. The workspaces
    are blocks of the caching allocator, allocated at the first matmul and kept.
    """
    for name, value in (("handles", handles), ("streams", streams)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    each = cublas_workspace_bytes(compute_capability, env) + cublaslt_workspace_bytes(compute_capability, env)
    return OutsideTerm(
        "cublas_workspace", each * handles * streams,
        f"{handles} cuBLAS handle(s) x {streams} stream(s) x {each} B (compute capability "
        f"{compute_capability[0]}.{compute_capability[1]}; cuBLASLt shares the cuBLAS workspace unless "
        "TORCH_CUBLASLT_UNIFIED_WORKSPACE=0)", _CUBLAS_SOURCE, through_allocator=True)


def cudnn_workspace(env: Mapping[str, str] | None = None) -> OutsideTerm:
    """Where convolutions run: cuDNN asks the caching allocator for a workspace per convolution, of the size
    the chosen algorithm needs (plans that do not fit are skipped), and frees it after the call.

    The size is only known at run time, so the term is 0 bytes with a cap when ``CUDNN_CONV_WSCAP_DBG``
    (MiB) is set; a measured run shows the workspaces as temporaries.
    """
    cap = _env(env).get("CUDNN_CONV_WSCAP_DBG")
    match = re.match(r"\s*\d+", cap or "")
    capped = f"capped at {int(match.group())} MiB by CUDNN_CONV_WSCAP_DBG" if match else "uncapped"
    return OutsideTerm(
        "cudnn_workspace", 0,
        f"cuDNN convolution workspaces are temporary caching-allocator blocks sized by the algorithm ({capped}); "
        "not predicted here", "PyTorch docs, 'CUDA Environment Variables' (CUDNN_CONV_WSCAP_DBG); "
        "aten/src/ATen/native/cudnn/Conv_v8.cpp", through_allocator=True)


# ---------------------------------------------------------------------------------------- NCCL

# NVIDIA/nccl src/include/device.h and src/init.cc (computeBuffSizes): per connection and protocol,
# LL = NCCL_LL_LINES_PER_THREAD (8) x NCCL_LL_MAX_NTHREADS (512) x NCCL_STEPS (8) x 16 B = 512 KiB,
# LL128 = NCCL_LL128_ELEMS_PER_THREAD (120) x NCCL_LL128_MAX_NTHREADS (640) x NCCL_STEPS x 8 B = 4,915,200 B,
# Simple = DEFAULT_BUFFSIZE = 4 MiB; NCCL_LL_BUFFSIZE, NCCL_LL128_BUFFSIZE and NCCL_BUFFSIZE override them.
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8
NCCL_SIMPLE_BUFFSIZE = 4 * MiB
NCCL_STEPS = 8
# ringGraph->maxChannels = MAXCHANNELS / 2 (src/init.cc, MAXCHANNELS = 64 in device.h): at most 32 ring channels.
NCCL_MAX_RING_CHANNELS = 32
# cuMem allocations come in 2 MiB granules: 9.19 MiB of buffers showed as 10,485,760 B allocations
# (NVIDIA/nccl issue #1685).
_NCCL_GRANULE = 2 * MiB
# NVIDIA/nccl issue #1685: an all_to_all on 8 x H100 added 3.28 GB (read as GiB, the larger reading) over 7 peers
# x 32 channels: 15 MiB per peer and channel, 3 MiB more than the 12 MiB of buffers nccl_communicator counts.
NCCL_P2P_OVERHEAD = 3 * MiB
# NVIDIA/nccl issue #964: a process group on 4 x A100 (NVLink) took 544 MB for 2 ranks and 688 MB for more.
NCCL_OBSERVED_2_RANKS = 544 * MiB
NCCL_OBSERVED_MORE_RANKS = 688 * MiB
_NCCL_SOURCE = ("NVIDIA/nccl src/init.cc (computeBuffSizes, P2P_*_CHUNKSIZE), src/include/device.h; "
                "NCCL environment variables documentation; NVIDIA/nccl issues #964, #986 and #1685")


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None:
        return default
    try:
        number = int(value.strip())
    except ValueError as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise InvalidArgumentError(f"{name}={value!r} is not a whole number; NCCL reads it as an int") from None
    if number < 0:
        raise InvalidArgumentError(f"{name}={value!r} must not be negative")
    return number


def nccl_buffer_sizes(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """The buffer of each NCCL protocol per connection (``computeBuffSizes``), with the env overrides."""
    env = _env(env)
    return {"LL": _env_int(env, "NCCL_LL_BUFFSIZE", NCCL_LL_BUFFSIZE),
            "LL128": _env_int(env, "NCCL_LL128_BUFFSIZE", NCCL_LL128_BUFFSIZE),
            "Simple": _env_int(env, "NCCL_BUFFSIZE", NCCL_SIMPLE_BUFFSIZE)}


def nccl_communicator(world_size: int, *, nodes: int = 1, channels: int | None = None,
                      send_recv_peers: int = 0, env: Mapping[str, str] | None = None) -> OutsideTerm:
    """Device memory of one NCCL communicator (one process group) on one rank.

    Buffers: channels x connections x (LL + LL128 + Simple), each connection rounded to 2 MiB granules; a
    ring has 2 connections per channel (previous and next rank), a tree across nodes 2 more. ``channels``
    defaults to 32 (the most ring channels NCCL builds; ``NCCL_MAX_NCHANNELS`` lowers it). Send/recv
    (all_to_all, pipeline stages) adds, per peer and channel, LL and LL128 buffers and ``NCCL_STEPS`` P2P
    chunks (512 KiB over NVLink, 128 KiB across nodes; ``NCCL_P2P_*_CHUNKSIZE``): 15 MiB at the defaults.
    NCCL also keeps work queues and proxy state: what the measurements (#964, #1685) hold beyond the
    default buffers is added as a fixed overhead, and ``low`` leaves it out.
    """
    for name, value, least in (("world_size", world_size, 1), ("nodes", nodes, 1),
                               ("send_recv_peers", send_recv_peers, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidArgumentError(f"{name} must be an int >= {least}, got {value!r}")
    if nodes > world_size:
        raise InvalidArgumentError(f"nodes ({nodes}) cannot exceed world_size ({world_size})")
    if world_size == 1:
        return OutsideTerm("nccl", 0, "world size 1: no NCCL communicator", _NCCL_SOURCE)
    env = _env(env)
    if channels is None:
        channels = min(NCCL_MAX_RING_CHANNELS, _env_int(env, "NCCL_MAX_NCHANNELS", NCCL_MAX_RING_CHANNELS))
    elif isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
        raise InvalidArgumentError(f"channels must be a positive int or None, got {channels!r}")
    sizes = nccl_buffer_sizes(env)
    per_connection = -(-sum(sizes.values()) // _NCCL_GRANULE) * _NCCL_GRANULE
    connections = 2 + (2 if nodes > 1 else 0)
    collective = channels * connections * per_connection
    chunk_name, chunk = (("NCCL_P2P_NET_CHUNKSIZE", 128 * 1024) if nodes > 1
                         else ("NCCL_P2P_NVL_CHUNKSIZE", 512 * 1024))
    chunk = _env_int(env, chunk_name, chunk)
    chunk = min(chunk, sizes["Simple"] // NCCL_STEPS)  # computeBuffSizes caps the P2P chunk at Simple / NCCL_STEPS
    # A send/recv connection holds LL and LL128 buffers and a Simple one of NCCL_STEPS chunks, in granules,
    # plus the 2 MiB allocation #1685 saw beside each; what that measurement holds beyond (3 MiB) is added.
    p2p_each = -(-(sizes["LL"] + sizes["LL128"] + chunk * NCCL_STEPS) // _NCCL_GRANULE) * _NCCL_GRANULE + _NCCL_GRANULE
    p2p_buffers = send_recv_peers * channels * p2p_each
    p2p = p2p_buffers + send_recv_peers * channels * NCCL_P2P_OVERHEAD
    # What the A100 measurement (#964) holds beyond the default buffers of this formula (32 x 2 x 10 MiB =
    # 640 MiB) is taken as NCCL's fixed overhead (work queues, proxy state): 48 MiB for more than 2 ranks;
    # the 544 MiB of 2 ranks lies below the formula and adds nothing.
    measured = NCCL_OBSERVED_2_RANKS if world_size == 2 else NCCL_OBSERVED_MORE_RANKS
    default_granules = -(-(NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE + NCCL_SIMPLE_BUFFSIZE) // _NCCL_GRANULE)
    overhead = max(0, measured - NCCL_MAX_RING_CHANNELS * 2 * default_granules * _NCCL_GRANULE)
    return OutsideTerm(
        "nccl", collective + p2p + overhead,
        f"one communicator, {world_size} ranks on {nodes} node(s): {channels} channels x {connections} connections x "
        f"{per_connection} B buffers (LL {sizes['LL']} + LL128 {sizes['LL128']} + Simple {sizes['Simple']}, in 2 MiB "
        f"granules) = {collective} B" + (f", + {p2p} B send/recv buffers for {send_recv_peers} peers" if p2p else "")
        + f", + {overhead} B of overhead beyond the buffers in the {measured // MiB} MiB measured on A100 "
        "(NVIDIA/nccl #964). Each further process group adds its own, unless made with ncclCommSplit sharing "
        "resources", _NCCL_SOURCE, low=collective + p2p_buffers)


# ---------------------------------------------------------------------------------------- CUDA graphs

def cuda_graph_pool(pool_bytes: int) -> OutsideTerm:
    """A CUDA graph's private memory pool: the reserved high-water mark of the allocations made during its
    capture (replay the captured allocations through a ``CachingAllocator`` of their own to get it). It
    stays reserved, away from the default pools, while any graph using the pool lives (Note [Interaction
    with CUDA graph capture], ``c10/cuda/CUDACachingAllocator.cpp``)."""
    if isinstance(pool_bytes, bool) or not isinstance(pool_bytes, int) or pool_bytes < 0:
        raise InvalidArgumentError(f"pool_bytes must be a non-negative int, got {pool_bytes!r}")
    return OutsideTerm("cuda_graph_pool", pool_bytes,
                       "the capture's own reserved peak, held while the graph lives",
                       "c10/cuda/CUDACachingAllocator.cpp, Note [Interaction with CUDA graph capture]",
                       through_allocator=True)
