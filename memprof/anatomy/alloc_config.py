"""``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` as torch 2.13 reads it, and the allocator's constants.

The grammar and every check follow ``c10/core/AllocatorConfig.h`` (``ConfigTokenizer``) and
``c10/core/AllocatorConfig.cpp`` (``AcceleratorAllocatorConfig::parseArgs`` and its ``parse*`` helpers),
plus the CUDA keys of ``c10/cuda/CUDAAllocatorConfig.cpp`` (``CUDAAllocatorConfig::parseArgs``): a comma-
separated list of ``key:value`` pairs, list values in ``[...]``, whitespace ignored, sizes in MiB. A string
torch would refuse at start-up raises :class:`~memprof.errors.AllocatorConfigError` naming the key and the
fix; keys that only steer the pinned host allocator are accepted and kept in ``ignored``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypedDict

from ..errors import AllocatorConfigError, InvalidArgumentError

__all__ = [
    "K_MIN_BLOCK_SIZE",
    "K_SMALL_SIZE",
    "K_SMALL_BUFFER",
    "K_MIN_LARGE_ALLOC",
    "K_LARGE_BUFFER",
    "K_ROUND_LARGE",
    "ROUNDUP_INTERVALS",
    "AllocatorConfig",
]

# c10/core/AllocatorConfig.h (torch 2.13, installed headers): the size classes of the caching allocator.
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes round up to multiples of 512
K_SMALL_SIZE = 1_048_576  # kSmallSize: largest "small" request, 1 MiB
K_SMALL_BUFFER = 2_097_152  # kSmallBuffer: small-pool segment (and expandable page) size, 2 MiB
K_MIN_LARGE_ALLOC = 10_485_760  # kMinLargeAlloc: requests below 10 MiB get a large_segment_size segment
K_ROUND_LARGE = 2_097_152  # kRoundLarge: larger segments round up to 2 MiB
# AcceleratorAllocatorConfig::large_segment_size_ default (20971520, "20 MB"), the old kLargeBuffer.
K_LARGE_BUFFER = 20_971_520
# AllocatorConfig.cpp: kRoundUpPowerOfTwoIntervals = 16 intervals, [1 MiB, 2 MiB) ... [32 GiB, 64 GiB].
ROUNDUP_INTERVALS = 16
_MB = 1_048_576
_SIZE_MAX = 2**64 - 1  # std::numeric_limits<size_t>::max(): "no limit" in torch

# Keys torch accepts (AcceleratorAllocatorConfig::getMutableKeys plus CUDAAllocatorConfig::getKeys of the
# 2.13 header) that change only the pinned host allocator or locking, not device bytes.
_HOST_ONLY_KEYS = frozenset({
    "pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
    "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb", "pinned_free_catch_all", "graph_capture_record_stream_reuse",
    "release_lock_on_hipmalloc",
})
_KEYS = frozenset({
    "large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb",
    "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments", "backend",
    "release_lock_on_cudamalloc", "per_process_memory_fraction", "throw_on_cudamalloc_oom",
}) | _HOST_ONLY_KEYS
_BOOL_KEYS = frozenset({"expandable_segments", "release_lock_on_cudamalloc", "throw_on_cudamalloc_oom",
                        "pinned_use_background_threads", "pinned_use_cuda_host_register",
                        "pinned_use_hip_host_register", "pinned_free_catch_all",
                        "graph_capture_record_stream_reuse", "release_lock_on_hipmalloc"})


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class AllocatorConfig:
    """The device-allocator settings of one ``PYTORCH_CUDA_ALLOC_CONF`` string, in bytes.

    ``max_split_size`` is ``None`` for torch's default "no limit". ``roundup_power2_divisions`` holds one
    division count per power-of-two interval (index k covers sizes in [2^(20+k), 2^(21+k)) bytes; index 0
    also covers everything below 2 MiB, index 15 everything from 32 GiB); 0 or 1 means plain 512-byte
    rounding. ``per_process_memory_fraction`` is the config key of that name; the model's
    ``set_memory_fraction`` mirrors ``torch.cuda.set_per_process_memory_fraction`` on top of it.
    """

    max_split_size: int | None = None
    max_non_split_rounding: int = K_LARGE_BUFFER
    large_segment_size: int = K_LARGE_BUFFER
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    expandable_segments: bool = False
    per_process_memory_fraction: float = 1.0
    throw_on_cudamalloc_oom: bool = False
    backend: str = "native"
    release_lock_on_cudamalloc: bool = False
    text: str = ""
    ignored: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        # The same bounds the parser enforces, so that a hand-built config cannot be one torch refuses.
        for name in ("max_non_split_rounding", "large_segment_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"AllocatorConfig.{name} must be a positive int of bytes, got {value!r}")
        if self.max_split_size is not None and (isinstance(self.max_split_size, bool)
                                                or not isinstance(self.max_split_size, int)
                                                or self.max_split_size < self.large_segment_size):
            raise InvalidArgumentError(f"AllocatorConfig.max_split_size must be None (no limit) or an int >= "
                                       f"large_segment_size ({self.large_segment_size}), got {self.max_split_size!r}")
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise InvalidArgumentError("AllocatorConfig.garbage_collection_threshold must be 0 (off) or in (0, 1), "
                                       f"got {self.garbage_collection_threshold!r}")
        if not 0.0 <= self.per_process_memory_fraction <= 1.0:
            raise InvalidArgumentError("AllocatorConfig.per_process_memory_fraction must be in [0, 1], "
                                       f"got {self.per_process_memory_fraction!r}")
        divisions = self.roundup_power2_divisions
        if (len(divisions) != ROUNDUP_INTERVALS
                or any(isinstance(d, bool) or not isinstance(d, int) or (d and not _power_of_two(d))
                       for d in divisions)):
            raise InvalidArgumentError(f"AllocatorConfig.roundup_power2_divisions must be {ROUNDUP_INTERVALS} "
                                       f"ints, each 0 or a power of two, got {divisions!r}")

    @property
    def split_limit(self) -> int:
        """``max_split_size`` in bytes, with torch's ``SIZE_MAX`` standing for "no limit"."""
        return _SIZE_MAX if self.max_split_size is None else self.max_split_size

    def divisions_for(self, size: int) -> int:
        """``AcceleratorAllocatorConfig::roundup_power2_divisions(size)``: the interval index is
        ``log2(size) - 20``, clamped to [0, 15]."""
        index = min(max(size.bit_length() - 1 - 20, 0), ROUNDUP_INTERVALS - 1)
        return self.roundup_power2_divisions[index]

    @classmethod
    def parse(cls, text: str) -> "AllocatorConfig":
        """The settings of ``text`` as torch 2.13 parses them; an empty string gives the defaults."""
        if not isinstance(text, str):
            raise InvalidArgumentError(f"AllocatorConfig.parse takes the string of PYTORCH_CUDA_ALLOC_CONF, got "
                                       f"{type(text).__name__}")
        return _Parser(text).run()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "AllocatorConfig":
        """The config a CUDA build of torch 2.13 reads at start-up: ``PYTORCH_CUDA_ALLOC_CONF`` if set, else
        ``PYTORCH_ALLOC_CONF`` (``CUDAAllocatorConfig::instance()`` in ``c10/cuda/CUDAAllocatorConfig.h``,
        which reads the older name first). ``environ`` defaults to ``os.environ``."""
        if environ is None:
            import os

            environ = os.environ
        for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            if name in environ:
                return cls.parse(environ[name])
        return cls()


_NUMBER = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


class _Parsed(TypedDict, total=False):
    """The :class:`AllocatorConfig` fields a string sets."""

    max_split_size: "int | None"
    max_non_split_rounding: int
    large_segment_size: int
    garbage_collection_threshold: float
    roundup_power2_divisions: tuple[int, ...]
    expandable_segments: bool
    per_process_memory_fraction: float
    throw_on_cudamalloc_oom: bool
    backend: str
    release_lock_on_cudamalloc: bool


# The boolean keys that set a field of the same name.
_BOOL_FIELDS: dict[str, Literal["expandable_segments", "release_lock_on_cudamalloc", "throw_on_cudamalloc_oom"]] = {
    "expandable_segments": "expandable_segments", "release_lock_on_cudamalloc": "release_lock_on_cudamalloc",
    "throw_on_cudamalloc_oom": "throw_on_cudamalloc_oom"}


class _Parser:
    """One pass of ``AcceleratorAllocatorConfig::parseArgs`` then ``CUDAAllocatorConfig::parseArgs`` over the
    tokens of ``ConfigTokenizer`` (``,`` ``:`` ``[`` ``]`` are tokens, whitespace is dropped)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[str] = []
        buffer = ""
        for ch in text:
            if ch in ",:[]":
                if buffer:
                    self.tokens.append(buffer)
                    buffer = ""
                self.tokens.append(ch)
            elif not ch.isspace():
                buffer += ch
        if buffer:
            self.tokens.append(buffer)
        self.values: _Parsed = {}
        self.ignored: list[tuple[str, str]] = []

    def fail(self, message: str) -> AllocatorConfigError:
        return AllocatorConfigError(f"allocator config {self.text!r} (PYTORCH_CUDA_ALLOC_CONF): {message}")

    def token(self, i: int, key: str) -> str:
        if i >= len(self.tokens):
            return self._missing(key)
        return self.tokens[i]

    def _missing(self, key: str) -> str:
        raise self.fail(f"{key} has no value; write {key}:<value>")

    def expect(self, i: int, want: str, key: str) -> None:
        if i >= len(self.tokens) or self.tokens[i] != want:
            got = "the end" if i >= len(self.tokens) else repr(self.tokens[i])
            raise self.fail(f"expected {want!r} after {key}, found {got}")

    def size_t(self, i: int, key: str) -> int:
        # std::stoull reads the leading digits and ignores what follows ("20MB" reads as 20).
        token = self.token(i, key)
        match = _NUMBER.match(token)
        if match is None:
            raise self.fail(f"{key}:{token} is not a whole number")
        value = int(match.group())
        if value < 0:
            raise self.fail(f"{key}:{token} must not be negative")
        return value

    def double(self, i: int, key: str) -> float:
        token = self.token(i, key)
        match = _FLOAT.match(token)
        if match is None:
            raise self.fail(f"{key}:{token} is not a number")
        return float(match.group())

    def boolean(self, i: int, key: str) -> bool:
        # ConfigTokenizer::toBool accepts exactly "True" and "False".
        token = self.token(i, key)
        if token not in ("True", "False"):
            raise self.fail(f"{key}:{token}: torch accepts only True or False (capitalised); write {key}:"
                            f"{'True' if token.lower() in ('true', '1', 'yes') else 'False'}")
        return token == "True"

    def skip(self, i: int, key: str) -> int:
        """``ConfigTokenizer::skipKey``: the index of the value, or of the ``]`` closing a list value."""
        self.expect(i + 1, ":", key)
        i += 2
        self.token(i, key)
        if self.tokens[i] != "[":
            return i
        while i + 1 < len(self.tokens) and self.tokens[i + 1] != "]":
            i += 1
        if i + 1 >= len(self.tokens):
            raise self.fail(f"the list of {key} has no closing ']'")
        return i + 1

    def run(self) -> AllocatorConfig:
        tokens = self.tokens
        large = K_LARGE_BUFFER
        # large_segment_size_mb is read first: the minimums of max_split_size_mb and
        # max_non_split_rounding_mb depend on it (AcceleratorAllocatorConfig::parseArgs).
        i = 0
        while i < len(tokens):
            if tokens[i] == "large_segment_size_mb":
                self.expect(i + 1, ":", tokens[i])
                mb = self.size_t(i + 2, "large_segment_size_mb")
                if mb <= K_MIN_LARGE_ALLOC // _MB:
                    raise self.fail(f"large_segment_size_mb must be > {K_MIN_LARGE_ALLOC // _MB} (MiB), got {mb}")
                large = min(mb, _SIZE_MAX // _MB) * _MB
                i += 2
            i += 1
        self.values.update({"large_segment_size": large, "max_non_split_rounding": large})
        i = 0
        while i < len(tokens):
            i = self.key(i, large)
            if i + 1 < len(tokens):
                self.expect(i + 1, ",", tokens[i] if tokens[i] not in ",:[]" else "a value")
                i += 1
            i += 1
        return AllocatorConfig(**self.values, text=self.text, ignored=tuple(self.ignored))

    def key(self, i: int, large: int) -> int:
        """Parse the ``key:value`` starting at ``i``; returns the index of its last token."""
        key = self.tokens[i]
        if key not in _KEYS:
            raise self.fail(f"unrecognised key {key!r} (torch raises 'Unrecognized key'); the keys are "
                            f"{', '.join(sorted(_KEYS))}")
        if key == "large_segment_size_mb":
            return self.skip(i, key)
        if key == "roundup_power2_divisions":
            return self.divisions(i)
        self.expect(i + 1, ":", key)
        j = i + 2
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mb = self.size_t(j, key)
            if mb < large // _MB:
                raise self.fail(f"{key} must be >= large_segment_size_mb ({large // _MB} MiB), got {mb}")
            if key == "max_split_size_mb":
                self.values["max_split_size"] = min(mb, _SIZE_MAX // _MB) * _MB
            else:
                self.values["max_non_split_rounding"] = min(mb, _SIZE_MAX // _MB) * _MB
        elif key == "garbage_collection_threshold":
            value = self.double(j, key)
            if not 0.0 < value < 1.0:
                raise self.fail(f"garbage_collection_threshold must be in (0.0, 1.0), got {value}")
            self.values["garbage_collection_threshold"] = value
        elif key == "per_process_memory_fraction":
            value = self.double(j, key)
            if not 0.0 <= value <= 1.0:
                raise self.fail(f"per_process_memory_fraction must be in [0.0, 1.0], got {value}")
            self.values["per_process_memory_fraction"] = value
        elif key == "backend":
            backend = self.token(j, key)
            if backend not in ("native", "cudaMallocAsync"):
                raise self.fail(f"backend:{backend} is unknown; the backends are native and cudaMallocAsync")
            self.values["backend"] = backend
        elif key in _BOOL_KEYS:
            value = self.boolean(j, key)
            if key in _HOST_ONLY_KEYS:
                self.ignored.append((key, str(value)))
            else:
                self.values[_BOOL_FIELDS[key]] = value
        else:
            j = self.host_value(i, key)
        return j

    def host_value(self, i: int, key: str) -> int:
        # The remaining pinned-host keys take a whole number; torch checks two of them.
        j = i + 2
        value = self.size_t(j, key)
        if key == "pinned_num_register_threads" and (not _power_of_two(value) or value > 128):
            raise self.fail(f"pinned_num_register_threads must be a power of two <= 128, got {value}")
        if key == "pinned_reserve_segment_size_mb" and value == 0:
            raise self.fail("pinned_reserve_segment_size_mb must be greater than 0")
        self.ignored.append((key, str(value)))
        return j

    def divisions(self, i: int) -> int:
        """``parseRoundUpPower2Divisions``: one power of two for every interval, or a ``[MB:divisions, ...,
        >:divisions]`` list where the first entry also fills the intervals below it and ``>`` fills those
        after the last named one."""
        key: Literal["roundup_power2_divisions"] = "roundup_power2_divisions"
        self.expect(i + 1, ":", key)
        i += 2
        divisions = [0] * ROUNDUP_INTERVALS
        if self.token(i, key) != "[":
            value = self.size_t(i, key)
            if not _power_of_two(value):
                raise self.fail(f"{key}:{value}: the divisions have to be a power of 2")
            self.values[key] = (value,) * ROUNDUP_INTERVALS
            return i
        first, last_index = True, 0
        i += 1
        while i < len(self.tokens) and self.tokens[i] != "]":
            bound = self.tokens[i]
            self.expect(i + 1, ":", f"{key} entry {bound!r}")
            value = self.size_t(i + 2, key)
            if value and not _power_of_two(value):
                raise self.fail(f"{key} entry {bound}:{value}: divisions have to be a power of 2, or 0 to disable")
            if bound == ">":
                divisions[last_index + 1:] = [value] * (ROUNDUP_INTERVALS - last_index - 1)
            else:
                match = _NUMBER.fullmatch(bound)
                if match is None or not _power_of_two(int(bound)):
                    raise self.fail(f"{key} entry {bound}:{value}: the interval (MiB) has to be a power of 2 or '>'")
                index = min(int(bound).bit_length() - 1, ROUNDUP_INTERVALS - 1)
                if first:
                    divisions[:index] = [value] * index
                    first = False
                divisions[index] = value
                last_index = index
            i += 3
            if i < len(self.tokens) and self.tokens[i] == ",":
                i += 1
            elif i >= len(self.tokens) or self.tokens[i] != "]":
                raise self.fail(f"expected ',' or ']' in the list of {key}")
        if i >= len(self.tokens):
            raise self.fail(f"the list of {key} has no closing ']'")
        self.values[key] = tuple(divisions)
        return i
