"""What a CUDA target holds beyond its tensors: the allocation stream replayed through the caching-allocator
model, the memory outside torch, and the fit on a named GPU (memprof.simulate.device_memory)."""

import pytest
import torch
from torch import nn

import memprof
from memprof.anatomy.alloc_config import AllocatorConfig
from memprof.anatomy.gpus import GpuSpec, known_gpus
from memprof.cli import main
from memprof.errors import AllocatorConfigError, InvalidArgumentError, UnknownNameError
from memprof.render.text import device_measured_lines
from memprof.simulate import device_memory as dm
from memprof.vocabulary import TENSOR_CATEGORIES

MiB = 1 << 20
# A GPU of our own: compute capability 8.0 (cuBLAS workspaces of 8,519,680 B), a context of exactly 300 MiB.
SMALL_GPU = GpuSpec("test-gpu", capacity_bytes=1 << 30, compute_capability=(8, 0), context_bytes=300 * MiB)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _estimate(monkeypatch=None, **options):
    """An estimate of the MLP; with ``monkeypatch`` also the stream and moments the replay read."""
    seen = {}
    if monkeypatch is not None:
        real = dm.on_device

        def spy(est, recorded, **kw):
            seen["stream"], seen["moments"] = list(recorded.events), list(recorded.moments)
            return real(est, recorded, **kw)
        monkeypatch.setattr(dm, "on_device", spy)
    m = _mlp()
    est = memprof.estimate(m, lambda ps: torch.optim.AdamW(ps), inputs=torch.randn(32, 64), **options)
    return est, seen


def _tensors(b):
    return sum(b[c] for c in TENSOR_CATEGORIES)


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "roundup_power2_divisions:4,max_split_size_mb:40"])
def test_at_every_moment_tensors_and_cache_fill_whole_segments(monkeypatch, conf):
    est, seen = _estimate(monkeypatch, gpu=SMALL_GPU, alloc_conf=conf)
    config = AllocatorConfig.parse(conf)
    stream, moments = seen["stream"], seen["moments"]
    workspaces = [8_519_680, 8_519_680]  # two cuBLAS handles (forward's thread, autograd's), compute capability 8.0
    placed = dm._place(est.trace, [(s, a, p, e) for s, a, p, e in moments])
    records = [(step.index, i, rec) for step in est.trace.steps for i, rec in enumerate(step.phases)]
    assert len(placed) == len(records) == 10  # 2 steps x (forward, backward, other, optimizer, other)
    first = moments[0][1]
    for index, i, rec in records:
        for seq, b in zip(placed[(index, i)], (rec.start, rec.peak, rec.end)):
            prefix = [e for e in stream if e[0] <= seq]
            at, allocator, oom = dm.replay_stream(prefix, [seq], config, workspaces=workspaces, workspace_seq=first)
            assert oom is None
            allocated, reserved = at[seq]
            # The replay's reserved bytes are its segments, whole; its allocated bytes are blocks inside them.
            assert reserved == sum(size for size, _ in allocator.segments())
            assert reserved >= allocated
            if not conf.startswith("roundup"):  # 512-byte rounding: the blocks are the tensors as the ledger counts
                assert allocated == _tensors(b) + (sum(workspaces) if seq >= first else 0)
            else:  # power-of-two divisions round some blocks further
                assert allocated >= _tensors(b) + sum(workspaces)
            assert b["allocator_overhead"] == reserved - _tensors(b)
            assert b["outside_torch"] == 300 * MiB
            assert b.total == reserved + 300 * MiB


def test_the_fit_and_headroom_are_exact_on_a_small_model():
    est, _ = _estimate(gpu=SMALL_GPU)
    # The tensors (under 120 KiB, every block <= 1 MiB) take one 2 MiB small-pool segment. The first cuBLAS
    # workspace (8,519,680 B < 10 MiB) gets a 20 MiB large segment and is split from it; the second fits the
    # 12,451,840 B left: 22 MiB reserved. The context is the GPU's 300 MiB, and no NCCL (one rank).
    assert est.device_memory.peak_reserved == 22 * MiB
    assert est.device_peak == 22 * MiB + 300 * MiB
    assert est.fits is True
    assert est.headroom == (1 << 30) - (322 * MiB)
    text = str(est)
    assert "fits test-gpu (1.0 GiB), headroom 702.0 MiB" in text
    assert "cuda_context 314572800 B, outside torch" in text
    assert "cublas_workspace 17039360 B, in the replay" in text
    tight = GpuSpec("tight", capacity_bytes=322 * MiB - 1, compute_capability=(8, 0), context_bytes=300 * MiB)
    over, _ = _estimate(gpu=tight)
    assert over.fits is False and over.headroom is not None
    assert "does NOT fit tight" in str(over)


def test_a_named_gpu_sets_the_target_and_the_capacity():
    est, _ = _estimate(gpu="h100-80gb")
    assert est.device == "cuda"
    assert est.device_memory.gpu.name == "h100-80gb-sxm"
    assert est.device_memory.capacity == memprof.anatomy.gpus.gpu("h100").allocatable_bytes
    # Hopper: 32 MiB per cuBLAS workspace, each a large segment of its own.
    assert est.device_memory.workspace_bytes == 64 * MiB
    assert est.headroom == est.device_memory.capacity - est.device_peak


def test_a_cuda_target_without_a_gpu_has_figures_but_no_verdict():
    est, _ = _estimate(device="cuda")
    assert est.peak["allocator_overhead"] is not None and est.peak["outside_torch"] is not None
    assert est.fits is None and est.headroom is None and est.device_peak is not None
    assert "no GPU given" in str(est)


def test_a_cpu_target_keeps_the_device_rows_unmeasured():
    est, _ = _estimate(device="cpu")
    assert est.peak["allocator_overhead"] is None and est.peak["outside_torch"] is None
    assert est.device_memory is None and est.fits is None and est.device_peak is None


def test_bad_gpu_names_and_confs_are_refused_before_simulating():
    with pytest.raises(UnknownNameError) as info:
        memprof.estimate(_mlp(), None, inputs=torch.randn(2, 64), gpu="h900")
    assert all(name in str(info.value) for name in known_gpus())
    with pytest.raises(AllocatorConfigError):
        memprof.estimate(_mlp(), None, inputs=torch.randn(2, 64), device="cuda", alloc_conf="expandable_segments:maybe")
    with pytest.raises(InvalidArgumentError):
        memprof.estimate(_mlp(), None, inputs=torch.randn(2, 64), device="cpu", alloc_conf="expandable_segments:True")
    with pytest.raises(InvalidArgumentError):
        memprof.estimate(_mlp(), None, inputs=torch.randn(2, 64), device="cpu", gpu="h100")


def test_the_planner_judges_the_device_peak_against_the_gpu():
    m = _mlp()
    gpu = GpuSpec("planner-gpu", capacity_bytes=400 * MiB, compute_capability=(8, 0), context_bytes=300 * MiB)
    plan = memprof.max_batch_size(m, lambda ps: torch.optim.AdamW(ps), lambda b: torch.empty(b, 64, device="meta"),
                                  gpu=gpu)
    assert plan.budget == 400 * MiB and plan.batch_size > 0
    est = memprof.estimate(m, lambda ps: torch.optim.AdamW(ps), inputs=torch.empty(plan.batch_size, 64), gpu=gpu)
    assert est.fits and est.device_peak == plan.peak_bytes
    bigger = memprof.estimate(m, lambda ps: torch.optim.AdamW(ps), inputs=torch.empty(plan.batch_size + 8, 64),
                              gpu=gpu)
    assert not bigger.fits
    with pytest.raises(InvalidArgumentError):
        memprof.max_batch_size(m, None, lambda b: torch.empty(b, 64))  # neither a budget nor a GPU


def test_the_cli_takes_a_gpu(tmp_path, monkeypatch, capsys):
    (tmp_path / "gpu_zoo.py").write_text(
        "import torch\n"
        "def build(batch_size):\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))\n"
        "    return {'model': model, 'inputs': torch.randn(batch_size, 16)}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["estimate", "gpu_zoo:build", "--batch-size", "4", "--gpu", "t4"]) == 0
    out = capsys.readouterr().out
    assert "fits t4-16gb" in out and "headroom" in out
    assert main(["estimate", "gpu_zoo:build", "--batch-size", "4", "--gpu", "t4", "--budget", "100 MiB"]) == 1
    assert "does NOT fit in 100.0 MiB" in capsys.readouterr().out
    assert main(["estimate", "gpu_zoo:build", "--batch-size", "4", "--gpu", "t5"]) == 1
    assert "known: a10-24gb" in capsys.readouterr().err
    assert main(["estimate", "gpu_zoo:build", "--batch-size", "4", "--alloc-conf", "max_split_size_mb:1"]) == 1


def _profiled(**options):
    m = _mlp()
    opt = torch.optim.AdamW(m.parameters())
    x = torch.randn(32, 64)
    with memprof.profile(m, opt, mode="exact", **options) as prof:
        for _ in range(2):
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
    return prof.report()


def test_a_cpu_run_shows_what_a_gpu_would_reserve_for_its_stream():
    report = _profiled(record_allocations=True)
    on_gpu = report.what_a_gpu_would_reserve(SMALL_GPU)
    # The run's storages are each under 1 MiB: one 2 MiB small segment, and the two cuBLAS workspaces share
    # one 20 MiB segment (as in the estimate of the same step above).
    assert on_gpu.peak_reserved == 22 * MiB
    assert on_gpu.device_peak == 322 * MiB and on_gpu.fits is True
    peak = on_gpu.peak
    # At the tensors' peak the model had reserved at most its peak; the CPU's tensors are counted unrounded.
    assert 0 < peak["allocator_overhead"] + _tensors(peak) <= on_gpu.peak_reserved
    assert peak["outside_torch"] == 300 * MiB
    # The report itself stays as measured on the CPU: nothing there is invented.
    assert report.peak["allocator_overhead"] is None
    assert on_gpu.measured_reserved is None and on_gpu.outside_split() is None
    assert "fits test-gpu" in str(on_gpu)


def test_without_the_stream_the_question_says_how_to_record_it():
    report = _profiled()
    with pytest.raises(memprof.errors.NotMeasuredError, match="record_allocations=True"):
        report.what_a_gpu_would_reserve("a100")
    with pytest.raises(InvalidArgumentError, match="mode='exact'"):
        memprof.profile(_mlp(), None, mode="light", record_allocations=True)


def test_a_measured_cuda_run_is_split_where_the_terms_are_known():
    # Hand-built: what a CUDA run's replay gives beside its measured reserved bytes and NVML's outside figure.
    from memprof.anatomy.outside import nccl_communicator

    nccl = nccl_communicator(8)
    terms = (SMALL_GPU.context(), nccl)
    summary = dm.DeviceMemory(gpu=SMALL_GPU, alloc_conf="", terms=terms, peak_allocated=10 * MiB,
                              peak_reserved=22 * MiB, outside_bytes=300 * MiB + nccl.bytes, segments=2,
                              capacity=1 << 30, measured_reserved=24 * MiB, measured_outside=nccl.bytes + 350 * MiB)
    # NCCL's formula first, then the context up to its figure (300 MiB); 50 MiB are left unexplained.
    assert summary.outside_split() == [("nccl", nccl.bytes), ("cuda_context", 300 * MiB), ("unexplained", 50 * MiB)]
    lines = device_measured_lines(summary)
    assert lines[0] == f"reserved: model {22 * MiB} B (peak), measured {24 * MiB} B (at the end), measured - model " \
                       f"+{2 * MiB} B"
    small = dataclasses_replace(summary, measured_outside=100 * MiB)
    assert small.outside_split() == [("nccl", 100 * MiB), ("cuda_context", 0), ("unexplained", 0)]


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)
