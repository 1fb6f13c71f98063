"""How fast does the caching-allocator model replay an allocation stream?

Run from the repository root::

    python benchmarks/allocator_replay.py                    # 10^6 events, default and expandable configs
    python benchmarks/allocator_replay.py --events 100000 --repeat 1
    python benchmarks/allocator_replay.py --json benchmarks/results/allocator-replay.json

What is replayed
----------------
A synthetic stream shaped like transformer training steps (a 32-layer decoder, hidden 4096, bf16,
micro-batches of 1-2 sequences of 1024-2048 tokens that vary per step): the weights once; per step a
forward that allocates each layer's saved activations (kept) and many short-lived temporaries (small
norms and reductions, medium attention scores), a backward that frees the activations in reverse order
while allocating gradient temporaries (the parameter gradients stay after the first step), and an
optimizer step with a parameter-sized foreach temporary. Sizes come from a seeded ``random.Random``, so
the stream is the same on every run. The time is ``memprof.anatomy.alloc_replay.replay`` over the
prepared list of events (building the list is not timed), best of ``--repeat`` runs, as wall-clock and as
CPU time of the process (the latter moves less on a shared machine); the load average is recorded.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import time

from _machine import command_line, cpu_model, import_memprof, write_results  # run as a script

HIDDEN, LAYERS, FFN, BYTES = 4096, 32, 11008, 2


def transformer_events(n_events: int, seed: int = 0) -> list[tuple]:
    """At least ``n_events`` events of whole training steps (see the module docstring)."""
    rng = random.Random(seed)
    events: list[tuple] = []
    key = 0

    def alloc(nbytes: int) -> int:
        nonlocal key
        key += 1
        events.append(("alloc", key, nbytes, 0))
        return key

    def free(k: int) -> None:
        events.append(("free", k))

    weights = [alloc(n * BYTES) for _ in range(LAYERS) for n in (4 * HIDDEN * HIDDEN, 3 * HIDDEN * FFN, HIDDEN, HIDDEN)]
    grads: list[int] = []
    while len(events) < n_events:
        tokens = rng.choice((1, 2)) * rng.randrange(1024, 2049, 64)
        act = tokens * HIDDEN * BYTES
        saved: list[list[int]] = []
        for _ in range(LAYERS):  # forward
            layer = [alloc(act), alloc(3 * act), alloc(tokens * FFN * BYTES * 2), alloc(act)]
            for _ in range(12):  # small temporaries: norm statistics, scalars, masks
                free(alloc(rng.randrange(4, 64 * 1024)))
            scores = alloc(tokens * rng.randrange(128, 512) * BYTES)  # a medium temporary
            layer.append(alloc(tokens * 4))  # logsumexp, saved
            free(scores)
            saved.append(layer)
        for layer in reversed(saved):  # backward
            for _ in range(8):
                free(alloc(rng.randrange(4, 64 * 1024)))
            grad_in = alloc(act)
            for k in reversed(layer):
                free(k)
            free(grad_in)
        if not grads:
            grads = [alloc(n * BYTES) for _ in range(LAYERS)
                     for n in (4 * HIDDEN * HIDDEN, 3 * HIDDEN * FFN, HIDDEN, HIDDEN)]
        step_tmp = alloc(sum(4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN for _ in range(LAYERS)) * BYTES // 8)
        free(step_tmp)
    del weights
    return events


def main(argv: "list[str] | None" = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    import_memprof()
    from memprof.anatomy.alloc_config import AllocatorConfig
    from memprof.anatomy.alloc_replay import replay

    events = transformer_events(args.events)
    rows = []
    for label, text in (("default", ""), ("expandable_segments:True", "expandable_segments:True")):
        config = AllocatorConfig.parse(text)
        best = best_cpu = float("inf")
        result = None
        for _ in range(args.repeat):
            start, start_cpu = time.perf_counter(), time.process_time()
            result = replay(events, config, device_total=141 * 10**9)
            best = min(best, time.perf_counter() - start)
            best_cpu = min(best_cpu, time.process_time() - start_cpu)
        rows.append(dict(config=label, events=len(events), seconds=round(best, 3), cpu_seconds=round(best_cpu, 3),
                         events_per_second=round(len(events) / best), peak_allocated=result.peak_allocated,
                         peak_reserved=result.peak_reserved, segments=len(result.allocator.segments())))
    lines = ["| config | events | seconds (wall) | seconds (CPU) | events/s (wall) | peak allocated (GiB) | "
             "peak reserved (GiB) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['events']:,} | {r['seconds']} | {r['cpu_seconds']} "
                     f"| {r['events_per_second']:,} | "
                     f"{r['peak_allocated'] / 2**30:.2f} | {r['peak_reserved'] / 2**30:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    data = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=command_line(__file__, argv), cpu=cpu_model(), python=platform.python_version(),
                load_average=open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else None,
                rows=rows)
    write_results(args.json, data, args.markdown, table)


if __name__ == "__main__":
    sys.exit(main())
