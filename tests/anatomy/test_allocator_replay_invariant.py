"""The replay's invariant, on random ledger streams (storages made, resized and freed, from 1 byte to several GiB,
with and without expandable segments, under memory fractions and capacities): after every event the model's
allocated bytes are the live storages' bytes, each rounded as torch rounds it, plus the cuBLAS workspaces, plus
what torch leaves unsplit in a block (nothing in the small pool or an expandable segment, at most 1 MiB in the
large pool), and reserved never passes the memory fraction's cap. The replay's public entry points name a
malformed event and its index; a negative size is never read as a free."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from memprof.anatomy.alloc_audit import AuditedAllocator, audit
from memprof.anatomy.alloc_config import AllocatorConfig
from memprof.anatomy.alloc_replay import replay
from memprof.anatomy.allocator import CachingAllocator
from memprof.errors import InvalidArgumentError, SimulatedOutOfMemoryError
from memprof.simulate.alloc_stream import from_start, rank_step, replay_stream

MiB, GiB = 2**20, 2**30
CONFIGS = ["", "expandable_segments:True", "per_process_memory_fraction:0.5",
           "per_process_memory_fraction:0.3,garbage_collection_threshold:0.5",
           "expandable_segments:True,per_process_memory_fraction:0.7", "max_split_size_mb:64"]
WORKSPACES = [32 * MiB, 4 * MiB]


def _rounded(n: int) -> int:
    """torch's round_size for the configs above (no roundup_power2_divisions): 512-byte steps, at least 512."""
    return 0 if n == 0 else max(512, -(-n // 512) * 512)


def _unsplit_bound(conf: AllocatorConfig, blocks: list[int]) -> int:
    """What torch may leave unsplit in the large pool's blocks of these (rounded) sizes: under 1 MiB in a block
    split at kSmallSize, up to max_non_split_rounding (at least a new segment's 2 MiB) in an oversize one."""
    oversize = max(conf.max_non_split_rounding, 2 * MiB)
    return sum(oversize if n >= conf.split_limit else MiB for n in blocks if n > MiB)


sizes = st.one_of(st.integers(0, 4096), st.integers(4097, 2 * MiB), st.integers(2 * MiB, 96 * MiB),
                  st.integers(1 * GiB, 6 * GiB))
# (kind, key, size): a storage made or resized (a live key made again), or a free of a live key.
ops = st.lists(st.tuples(st.sampled_from(["make", "make", "make", "free", "free"]), st.integers(0, 12), sizes),
               min_size=1, max_size=80)


def _stream(ops_: list) -> list[tuple[int, int, int]]:
    """A well-formed ledger stream of ``ops_``: frees only of live keys, seqs 1, 2, ..."""
    live, out = set(), []
    for kind, key, size in ops_:
        if kind == "free":
            if key not in live:
                continue
            live.discard(key)
            out.append((len(out) + 1, key, -1))
        else:
            live.add(key)
            out.append((len(out) + 1, key, size))
    return out


@settings(max_examples=80, deadline=None)
# Three oversize blocks on new segments: each keeps up to 2 MiB of its segment's rounding unsplit (6 MiB in all).
@example(config="max_split_size_mb:64", capacity=None, first=0,
         ops_=[("make", 0, 3_084_910_593), ("make", 1, 3_084_910_593), ("make", 2, 75_497_473)])
@given(config=st.sampled_from(CONFIGS), ops_=ops, capacity=st.sampled_from([None, 8 * GiB, 20 * GiB]),
       first=st.integers(0, 10))
def test_allocated_is_the_live_storages_rounded_plus_workspaces_and_what_torch_leaves_unsplit(config, ops_, capacity,
                                                                                          first):
    stream = _stream(ops_)
    total = 24 * GiB  # the device a memory fraction is taken of
    conf = AllocatorConfig.parse(config)
    seqs = [seq for seq, _, _ in stream]
    at, alloc, oom = replay_stream(stream, seqs, conf, workspaces=WORKSPACES, workspace_seq=first,
                                   capacity=capacity, device_total=total, check=True)
    assert isinstance(alloc, AuditedAllocator)
    # The expectation, by independent arithmetic over the stream: after event seq, the live storages' bytes
    # rounded as torch rounds them, plus the workspaces once the run passed event ``first``. A replay that ran
    # out of memory stopped at an event: the shortest prefix that does too (every later moment reads the error).
    stop = len(stream) + 1
    if oom is not None:
        lo, hi = 0, len(stream)
        while lo < hi:
            mid = (lo + hi) // 2
            if replay_stream(stream[:mid + 1], [], conf, workspaces=WORKSPACES, workspace_seq=first,
                             capacity=capacity, device_total=total)[2] is None:
                lo = mid + 1
            else:
                hi = mid
        stop = stream[lo][0]
    live: dict[int, int] = {}
    cap = int(conf.per_process_memory_fraction * total) if conf.per_process_memory_fraction < 1 else None
    for seq, key, n in stream:
        if seq >= stop:
            break
        if n == -1:
            del live[key]
        else:
            live[key] = _rounded(n)
        allocated, reserved = at[seq]
        expected = sum(live.values()) + (sum(WORKSPACES) if first <= seq or first == 0 else 0)
        unsplit = allocated - expected
        # At most 1 MiB per live block in the large pool (torch splits a rest above kSmallSize), nothing elsewhere;
        # a block of max_split_size or more is never split (CUDACachingAllocator.cpp's shouldSplit): a new
        # segment's 2 MiB rounding, or a cached block up to max_non_split_rounding larger (get_free_block).
        bound = _unsplit_bound(conf, [*live.values(), *WORKSPACES])
        assert 0 <= unsplit <= (0 if conf.expandable_segments else bound)
        assert allocated <= reserved
        if cap is not None:
            assert reserved <= cap  # torch's allowed_memory_maximum, checked before every new segment
        if capacity is not None:
            assert reserved <= capacity


@settings(max_examples=40, deadline=None)
@given(config=st.sampled_from(CONFIGS), ops_=ops)
def test_the_public_replay_audited_after_every_event(config, ops_):
    # The same streams as tensors named by key, through replay(): a resize is a free and a new allocation.
    events, live = [], set()
    for kind, key, size in ops_:
        if kind == "free" and key in live:
            live.discard(key)
            events.append(("free", key))
        elif kind == "make":
            if key in live:
                events.append(("free", key))
            live.add(key)
            events.append(("alloc", key, size, key % 2))
    result = replay(events, AllocatorConfig.parse(config), device_total=24 * GiB, capacity=16 * GiB, check=True,
                    timeline=True)
    audit(result.allocator)
    assert result.events == (len(events) if result.oom is None else result.oom.index + 1)


def test_the_memory_fraction_is_truncated_as_torch_truncates_it():
    # setMemoryFraction: allowed_memory_maximum = static_cast<size_t>(fraction * totalGlobalMem). Half of
    # 4,194,303 B is 2,097,151.5 B: truncated, 2,097,151 B, one byte short of the 2 MiB segment a small request
    # takes (rounding half to even, 2,097,152 B, would let it through).
    alloc = CachingAllocator(AllocatorConfig.parse("per_process_memory_fraction:0.5"), device_total=4_194_303)
    with pytest.raises(SimulatedOutOfMemoryError):
        alloc.malloc(1)
    assert CachingAllocator(AllocatorConfig.parse("per_process_memory_fraction:0.5"),
                            device_total=4_194_304).malloc(1) == 1


def test_the_replay_starts_where_the_run_does():
    # Events 1-5 are the set-up (a rank registers the whole model, then shards it); the run starts at event 5.
    stream = [(1, "w1", 4000), (2, "w2", 8000), (3, "tmp", 100), (4, "tmp", -1), (5, "w1", 1000), (6, "x", 50),
              (7, "w2", 2000)]
    # What is live at event 5, at its size then, made at the seq it was first made; the rest as it was.
    assert from_start(stream, 5) == [(1, "w1", 1000), (2, "w2", 8000), (6, "x", 50), (7, "w2", 2000)]
    assert from_start(stream, 0) == stream and from_start([], 3) == []


def test_an_optimizer_step_of_a_rank_is_rewritten_as_the_rank_makes_it():
    # The step began after seq 10. It made the state s1, s2 at the whole parameters' size (4096, 2048 B) and two
    # temporaries; at its end the state was resized to the rank's part (1024, 512 B): events from index 7 on.
    stream = [(9, "loss", 4), (10, "old", 100), (11, "s1", 4096), (12, "s2", 2048), (13, "t1", 8192),
              (14, "t1", -1), (15, "t2", 1000), (16, "s1", 1024), (17, "s2", 512)]
    rank_step(stream, 10, 7, share=Fraction(1, 4), rounding=512)
    # The state is made at the rank's part and not resized; t1: a quarter of 8192 B; t2: a quarter of the 1024 B
    # the ledger counts for 1000 B (256 B); what the step did not make keeps its bytes.
    assert stream == [(9, "loss", 4), (10, "old", 100), (11, "s1", 1024), (12, "s2", 512), (13, "t1", 2048),
                      (14, "t1", -1), (15, "t2", 256)]


@pytest.mark.parametrize("events,message", [
    ([("alloc", "a", -4)], r"event 0 \('alloc', 'a', -4\): nbytes must be a non-negative int, got -4"),
    ([("alloc", "a", 10), ("alloc", "b", "20")], r"event 1 .*nbytes must be a non-negative int, got '20'"),
    ([("alloc", "a", 10), ("alloc", "b", 2.5)], r"event 1 .*got 2.5"),
    ([("alloc", "a")], r"event 0 .*an allocation is \('alloc', key, nbytes\)"),
    ([("alloc", "a", 10, 0, 7)], r"event 0 .*got 5 fields"),
    ([("free",)], r"event 0 .*a free is \('free', key\)"),
    ([5], r"event 0 5: an event is a tuple"),
    ([()], r"event 0 \(\): an event is a tuple"),
    ([("alloc", ["k"], 10)], r"event 0 .*not hashable"),
    ([("alloc", "a", 10), ("free", "a"), ("free", "a")], r"event 2 .*free of 'a', which is not allocated"),
    ([("alloc", "a", 10, "s")], r"event 0 .*stream must be an int"),
])
def test_the_public_replay_names_a_malformed_event(events, message):
    with pytest.raises(InvalidArgumentError, match=message):
        replay(events)


@pytest.mark.parametrize("stream,message", [
    # A negative size is no free: only -1 is (the ledger's mark), and a storage never has a negative size.
    ([(1, "a", 100), (2, "a", -5)], r"event 1 \(2, 'a', -5\): bytes -5 is negative"),
    ([(1, "a", -7)], r"event 0 .*bytes -7 is negative"),
    ([(1, "a", 100), (2, "a", -1), (3, "a", -1)], r"event 2 .*a free of key 'a', which is not live"),
    ([(1, "b", -1)], r"event 0 .*which is not live"),
    ([(1, "a")], r"event 0 .*an event is \(seq, key, bytes\)"),
    ([(1, "a", 100), (2, "b", 1.5)], r"event 1 .*bytes 1.5 is not an int"),
    ([(1, "a", 100), ("2", "b", 10)], r"event 1 .*seq '2' is not an int"),
    ([(1, ["a"], 100)], r"event 0 .*not hashable"),
])
def test_a_ledger_stream_replay_names_a_malformed_event(stream, message):
    with pytest.raises(InvalidArgumentError, match=message):
        replay_stream(stream, [1], AllocatorConfig())
    with pytest.raises(InvalidArgumentError, match=message):
        from_start(stream, 10**9)  # the set-up is read as strictly as the run


def test_the_audit_needs_no_torch():
    # Like the rest of the allocator model (tests/anatomy/test_anatomy_allocator.py): pure Python.
    import ast
    import pathlib

    import memprof.anatomy.alloc_audit as audited

    tree = ast.parse(pathlib.Path(audited.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
    assert imported <= {"__future__", "typing"}


@pytest.mark.parametrize("call", [
    lambda: replay(None), lambda: replay_stream(None, [1], AllocatorConfig()), lambda: from_start(7, 3)])
def test_what_is_no_stream_at_all_is_named(call):
    with pytest.raises(InvalidArgumentError, match="NoneType|int"):
        call()
