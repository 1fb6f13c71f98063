"""PYTORCH_CUDA_ALLOC_CONF as torch 2.13 parses it (c10/core/AllocatorConfig.cpp, AcceleratorAllocatorConfig::
parseArgs; c10/cuda/CUDAAllocatorConfig.cpp). The expected values are those of torch's own
c10/test/core/AllocatorConfig_test.cpp where it has them."""

from __future__ import annotations

import pytest

from memprof.anatomy.alloc_config import K_LARGE_BUFFER, AllocatorConfig
from memprof.errors import AllocatorConfigError, InvalidArgumentError

MiB = 2**20


def test_defaults_are_torch_defaults():
    config = AllocatorConfig.parse("")
    assert config == AllocatorConfig(text="")
    # no split limit, max_non_split_rounding = large_segment_size = 20 MiB, no rounding, no collection
    assert (config.max_split_size, config.split_limit) == (None, 2**64 - 1)
    assert config.large_segment_size == config.max_non_split_rounding == K_LARGE_BUFFER == 20 * MiB
    assert config.roundup_power2_divisions == (0,) * 16
    assert (config.garbage_collection_threshold, config.expandable_segments) == (0.0, False)


def test_the_full_example_of_torchs_test():
    config = AllocatorConfig.parse(
        "max_split_size_mb:40, max_non_split_rounding_mb:30,garbage_collection_threshold:0.5,"
        "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],expandable_segments:True,"
        "pinned_use_background_threads:True")
    assert config.max_split_size == 40 * MiB and config.max_non_split_rounding == 30 * MiB
    assert config.garbage_collection_threshold == 0.5 and config.expandable_segments is True
    # 64:8 also fills every interval below 64 MiB; ">" fills the intervals after the last one named (1024)
    expected = {32: 8, 64: 8, 128: 2, 256: 4, 512: 2, 1024: 4, 2048: 1, 4096: 1, 8192: 1}
    assert {mb: config.divisions_for(mb * MiB) for mb in expected} == expected
    # the pinned host allocator's key is accepted and set aside: it changes no device byte
    assert config.ignored == (("pinned_use_background_threads", "True"),)


def test_list_with_a_gap_and_the_single_value_form():
    config = AllocatorConfig.parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]")
    # 1024 MiB lies between two named intervals and keeps 0 (no power-of-two rounding)
    expected = {64: 8, 128: 8, 256: 16, 512: 1, 1024: 0, 2048: 8, 4096: 2}
    assert {mb: config.divisions_for(mb * MiB) for mb in expected} == expected
    assert AllocatorConfig.parse("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16


def test_interval_index_is_log2_size_minus_20_clamped():
    config = AllocatorConfig(roundup_power2_divisions=(0, 2, 4, 8) + (16,) * 12)
    # 1 KiB and 1 MiB both fall in interval 0; [2 MiB, 4 MiB) is interval 1; 64 GiB and more is interval 15
    assert [config.divisions_for(n) for n in (1024, MiB, 2 * MiB, 4 * MiB, 8 * MiB, 2**40)] == [0, 0, 2, 4, 8, 16]


def test_large_segment_size_is_read_first_and_sets_the_minimums():
    config = AllocatorConfig.parse("max_split_size_mb:20,large_segment_size_mb:15,max_non_split_rounding_mb:40")
    assert (config.large_segment_size, config.max_split_size, config.max_non_split_rounding) == (15 * MiB, 20 * MiB, 40 * MiB)
    # max_non_split_rounding follows large_segment_size unless given
    assert AllocatorConfig.parse("large_segment_size_mb:30").max_non_split_rounding == 30 * MiB
    with pytest.raises(AllocatorConfigError, match="max_split_size_mb must be >= large_segment_size_mb"):
        AllocatorConfig.parse("max_split_size_mb:20,large_segment_size_mb:25")
    with pytest.raises(AllocatorConfigError, match="large_segment_size_mb must be > 10"):
        AllocatorConfig.parse("large_segment_size_mb:10")


def test_cuda_keys_and_whitespace():
    config = AllocatorConfig.parse(" per_process_memory_fraction : 0.5 ,throw_on_cudamalloc_oom:True, backend:native ")
    assert (config.per_process_memory_fraction, config.throw_on_cudamalloc_oom, config.backend) == (0.5, True, "native")
    assert AllocatorConfig.parse("backend:cudaMallocAsync").backend == "cudaMallocAsync"
    # std::stoull reads the leading digits, as torch does
    assert AllocatorConfig.parse("max_split_size_mb:200MB").max_split_size == 200 * MiB


@pytest.mark.parametrize("text,message", [
    ("foo:123,bar:456", "unrecognised key 'foo'"),
    ("max_split_size_mb", "expected ':' after max_split_size_mb"),
    ("max_split_size_mb:", "max_split_size_mb has no value"),
    ("roundup_power2_divisions:[64:8", "expected ',' or ']'"),
    ("garbage_collection_threshold:", "has no value"),
    ("garbage_collection_threshold:1.0", r"in \(0.0, 1.0\)"),
    ("expandable_segments:true", "only True or False.*expandable_segments:True"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:[96:4]", "interval .* power of 2"),
    ("roundup_power2_divisions:[64:3]", "power of 2, or 0"),
    ("backend:jemalloc", "native and cudaMallocAsync"),
    ("per_process_memory_fraction:1.5", r"\[0.0, 1.0\]"),
    ("max_split_size_mb:abc", "not a whole number"),
    ("max_split_size_mb:100 max_non_split_rounding_mb:40", "expected ','"),
    ("pinned_num_register_threads:3", "power of two"),
])
def test_strings_torch_refuses(text, message):
    with pytest.raises(AllocatorConfigError, match=message):
        AllocatorConfig.parse(text)


def test_environment_lookup_order():
    # CUDAAllocatorConfig::instance() reads PYTORCH_CUDA_ALLOC_CONF first, then PYTORCH_ALLOC_CONF
    both = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}
    assert AllocatorConfig.from_env(both).expandable_segments is True
    assert AllocatorConfig.from_env(both).max_split_size is None
    assert AllocatorConfig.from_env({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}).max_split_size == 64 * MiB
    assert AllocatorConfig.from_env({}) == AllocatorConfig()


def test_hand_built_configs_are_checked():
    with pytest.raises(InvalidArgumentError, match="max_split_size"):
        AllocatorConfig(max_split_size=10 * MiB)  # below large_segment_size, which torch refuses too
    with pytest.raises(InvalidArgumentError, match="roundup_power2_divisions"):
        AllocatorConfig(roundup_power2_divisions=(3,) * 16)
    with pytest.raises(InvalidArgumentError, match="garbage_collection_threshold"):
        AllocatorConfig(garbage_collection_threshold=1.0)
    with pytest.raises(InvalidArgumentError, match="string of PYTORCH_CUDA_ALLOC_CONF"):
        AllocatorConfig.parse(None)
