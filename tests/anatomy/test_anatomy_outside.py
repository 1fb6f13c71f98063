"""Memory beside the tensors: CUDA context, cuBLAS/cuBLASLt/cuDNN workspaces, NCCL buffers, CUDA-graph pools."""

from __future__ import annotations

import pytest

from memprof.anatomy.outside import (
    CUDA_CONTEXT_BARE_LAZY_BYTES,
    CUDA_CONTEXT_EAGER_BYTES,
    CUDA_CONTEXT_EAGER_MAX_BYTES,
    cublas_workspace_bytes,
    cublas_workspaces,
    cublaslt_workspace_bytes,
    cuda_context,
    cuda_graph_pool,
    cudnn_workspace,
    nccl_buffer_sizes,
    nccl_communicator,
)
from memprof.errors import InvalidArgumentError

MiB = 2**20


def test_context_lazy_and_eager():
    lazy = cuda_context()
    # lazy loading: 256 MiB bare (RTX 3090) up to the eager ceiling 1343 MiB (V100, CUDA 11.2)
    assert (lazy.low, lazy.bytes) == (256 * MiB, 1343 * MiB) and not lazy.through_allocator
    eager = cuda_context(module_loading="EAGER")
    assert (eager.low, eager.bytes) == (CUDA_CONTEXT_EAGER_BYTES, CUDA_CONTEXT_EAGER_MAX_BYTES)
    # before CUDA 11.7 there is no lazy loading
    assert cuda_context(cuda_version=(11, 2)).low == 666_632_192
    assert cuda_context(cuda_version=(12, 4)).low == CUDA_CONTEXT_BARE_LAZY_BYTES
    assert "on H100" in cuda_context(gpu="H100").assumption and "PR #86509" in lazy.source
    with pytest.raises(InvalidArgumentError, match="LAZY"):
        cuda_context(module_loading="sometimes")


@pytest.mark.parametrize("cc,expected", [((7, 5), 8_519_680), ((8, 6), 8_519_680), ((9, 0), 33_554_432),
                                         ((11, 0), 33_554_432), ((12, 1), 33_554_432)])
def test_cublas_default_by_compute_capability(cc, expected):
    assert cublas_workspace_bytes(cc) == expected


def test_cublas_workspace_config_is_read_as_torch_reads_it():
    # ":SIZE:COUNT" pairs in KiB, summed: ":4096:8" = 32 MiB, ":16:8:4096:2" = 8,519,680 B, ":0:0" = none
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MiB
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8:4096:2"}) == 8_519_680
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}) == 0
    # no pair at all: torch warns and keeps the default
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": "big"}) == 32 * MiB
    with pytest.raises(InvalidArgumentError, match="compute_capability"):
        cublas_workspace_bytes(9.0)


def test_cublaslt_shares_the_cublas_workspace_unless_told_not_to():
    assert cublaslt_workspace_bytes((9, 0)) == 0
    assert cublaslt_workspace_bytes((9, 0), {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}) == 1024 * 1024
    separate = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0", "CUBLASLT_WORKSPACE_SIZE": "4096"}
    assert cublaslt_workspace_bytes((9, 0), separate) == 4 * MiB


def test_workspaces_of_a_training_step():
    # forward on the Python thread and backward on the autograd thread: 2 handles x 1 stream x 32 MiB
    term = cublas_workspaces((9, 0))
    assert term.bytes == 64 * MiB and term.through_allocator
    # with separate cuBLASLt workspaces of 1 MiB: 2 x 2 streams x (8,519,680 + 1,048,576)
    env = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}
    assert cublas_workspaces((8, 0), streams=2, env=env).bytes == 4 * (8_519_680 + 1_048_576)
    with pytest.raises(InvalidArgumentError, match="handles"):
        cublas_workspaces((8, 0), handles=0)


def test_cudnn_is_a_term_not_a_number():
    term = cudnn_workspace({"CUDNN_CONV_WSCAP_DBG": "256"})
    assert term.bytes == 0 and "capped at 256 MiB" in term.assumption and term.through_allocator
    assert "uncapped" in cudnn_workspace().assumption


def test_nccl_buffers_per_protocol():
    # LL 8 x 512 x 8 x 16 = 524,288; LL128 120 x 640 x 8 x 8 = 4,915,200; Simple 4 MiB
    assert nccl_buffer_sizes() == {"LL": 524_288, "LL128": 4_915_200, "Simple": 4_194_304}
    assert nccl_buffer_sizes({"NCCL_BUFFSIZE": "1048576"})["Simple"] == MiB
    with pytest.raises(InvalidArgumentError, match="NCCL_BUFFSIZE"):
        nccl_buffer_sizes({"NCCL_BUFFSIZE": "4MB"})


def test_nccl_communicator():
    assert nccl_communicator(1).bytes == 0
    # one node: 32 channels x 2 ring connections x 10 MiB (9,633,792 B of buffers in 2 MiB granules)
    # = 640 MiB; the 688 MiB measured on A100 for more than 2 ranks leaves 48 MiB of fixed overhead
    eight = nccl_communicator(8)
    assert (eight.low, eight.bytes) == (640 * MiB, 688 * MiB) and "#964" in eight.assumption
    assert nccl_communicator(2).bytes == 640 * MiB  # 544 MiB measured for 2 ranks: no overhead beyond
    # across nodes the tree adds 2 connections: 32 x 4 x 10 MiB = 1280 MiB, + 48 MiB
    assert nccl_communicator(16, nodes=2).bytes == 1328 * MiB
    # fewer channels and a smaller Simple buffer: 524,288 + 4,915,200 + 1,048,576 = 6,488,064 B -> 4 granules
    # = 8 MiB; 8 channels x 2 x 8 MiB = 128 MiB, + 48 MiB
    small = nccl_communicator(8, env={"NCCL_MAX_NCHANNELS": "8", "NCCL_BUFFSIZE": str(MiB)})
    assert (small.low, small.bytes) == (128 * MiB, 176 * MiB)
    # send/recv to 7 peers on NVLink, per peer and channel: LL + LL128 + 8 x 512 KiB = 9,633,792 B -> 10 MiB,
    # + 2 MiB + 3 MiB measured overhead = 15 MiB; 7 x 32 x 15 MiB = 3360 MiB (3.28 GiB, NVIDIA/nccl #1685)
    assert nccl_communicator(8, send_recv_peers=7).bytes == 688 * MiB + 3360 * MiB
    with pytest.raises(InvalidArgumentError, match="nodes"):
        nccl_communicator(2, nodes=3)


def test_cuda_graph_pool():
    term = cuda_graph_pool(300 * MiB)
    assert term.bytes == 300 * MiB and term.through_allocator and "Interaction with CUDA graph capture" in term.source
    with pytest.raises(InvalidArgumentError):
        cuda_graph_pool(-1)
