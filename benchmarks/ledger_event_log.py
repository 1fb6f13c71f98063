"""Running totals against an event log: what exact mode's ledger pays per storage made and freed.

Run from the repository root::

    python benchmarks/ledger_event_log.py              # a few seconds
    python benchmarks/ledger_event_log.py --json out.json --markdown out.md

What is measured
----------------
memprof's :class:`~memprof.collect.ledger.Ledger` updates its totals, the peak and its composition as each
storage is made or freed. The alternative is to only append each event to a log in the dispatch handler and
the weak-reference callback, and to reduce the log (running total, peak, composition) when a reader needs
the totals. In exact mode a reader needs them at every module boundary: the module call's frame (its
temporaries peak) and the timeline sample both read the live total, so the log is reduced 4 times per
module call (forward entry and exit, backward entry and exit). On the benchmark GPT (``overhead.py``, 961
ops and 33 module calls per step; ``overhead_counts.py`` counts 287 storages freed per step, and about as
many are made) that is a reduction every 4 to 5 events, every 2 to 3 storages.

``EventLogLedger`` below is the smallest such log (adds and frees only: no allocation stream, tags or
moves, all of which only add to its cost). Both ledgers see the same steady stream: a storage made, one
made four events earlier freed, the log reduced every ``K`` storages. The figures are counted, not timed
(``sys.settrace`` opcode events and Python frames inside the ledgers' own functions), so they do not
depend on the load of the machine.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from typing import Any

from _machine import command_line, import_memprof, write_results  # benchmarks run as scripts from this folder

import torch

import_memprof()
from memprof.collect.frame_stack import push_frame  # noqa: E402  (after import_memprof)
from memprof.collect.ledger import TEMPORARIES, Entry, Ledger  # noqa: E402

#: Storages made per run; the first few fill the window and set the peak.
STORAGES = 3000
#: Storages alive at once (each new one frees the one made this many before).
WINDOW = 4


class EventLogLedger(Ledger):
    """A ledger whose hot paths only log: :meth:`add` and the free callback append the entry, and
    :meth:`reduce` applies the log to the totals, the peaks and the innermost frame's high mark."""

    def __init__(self, rounding: int = 1) -> None:
        super().__init__(rounding)
        self.log: list[Entry] = []

    def add(self, storage: Any, cat: int) -> Entry:
        key = storage._cdata
        entry = self.entries.get(key)
        if entry is not None:
            return entry
        nbytes = storage.nbytes()
        r = self.rounding
        if r > 1 and nbytes:
            nbytes = -(-nbytes // r) * r
        entry = Entry(storage, self._freed)
        entry.key, entry.nbytes, entry.cat = key, nbytes, cat
        entry.module, entry.phase_serial = self.module_of_new, self.phase_serial
        entry.saved = entry.tag_bytes = entry.where_bytes = entry.moved = entry.created = 0
        entry.tag = entry.where = -1
        entry.before = cat
        entry.savers = None
        self.entries[key] = entry
        self.log.append(entry)  # an entry's first event is its creation (created == 0 until reduced)
        return entry

    def _freed(self, ref: Entry) -> None:
        if self.closed:
            return
        entry = self.entries.pop(ref.key, None)
        if entry is not None:
            self.log.append(entry)  # its second event: freed

    def reduce(self) -> None:
        log = self.log
        if not log:
            return
        self.log = []
        totals, total, seq, top = self.totals, self.total, self.seq, self.top
        high = top.max if top is not None else 0
        for e in log:
            seq += 1
            n = e.nbytes
            if e.created == 0:
                e.created = seq
                totals[e.cat] += n
                total += n
                if total > high:
                    high = total
                if total > self.phase_peak_total:
                    self.total, self.seq = total, seq
                    self.check_peak()
            else:
                totals[e.cat] -= n
                total -= n
        self.total, self.seq = total, seq
        if top is not None:
            top.max = high


def count(ledger_type: type, every: int) -> tuple[float, float]:
    """Opcodes and Python frames per event inside the ledger's functions."""
    tensors: list[Any] = [torch.empty(4) for _ in range(STORAGES)]
    storages: list[Any] = [t.untyped_storage() for t in tensors]
    led = ledger_type()
    push_frame(led, 0, backward=False)
    reduce = getattr(led, "reduce", None)
    ours = {__file__, sys.modules[Ledger.__module__].__file__}
    opcodes = frames = 0

    def per_opcode(frame: Any, event: str, arg: Any) -> Any:
        nonlocal opcodes
        if event == "opcode":
            opcodes += 1
        return per_opcode

    def per_call(frame: Any, event: str, arg: Any) -> Any:
        nonlocal frames
        code = frame.f_code
        if code.co_filename in ours and code.co_name in ("add", "_freed", "settle", "reduce", "check_peak"):
            frames += 1
            frame.f_trace_opcodes = True
            return per_opcode
        return None

    sys.settrace(per_call)
    try:
        for i, st in enumerate(storages):
            led.add(st, TEMPORARIES)
            if i >= WINDOW:
                storages[i - WINDOW] = tensors[i - WINDOW] = None
            if reduce is not None and i % every == 0:
                reduce()
    finally:
        sys.settrace(None)
    events = 2 * STORAGES - WINDOW
    return opcodes / events, frames / events


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write results as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    args = ap.parse_args(argv)
    rows = []
    totals_ops, totals_frames = count(Ledger, 1)
    for every in (2, 3, 5, 10, 30):
        log_ops, log_frames = count(EventLogLedger, every)
        rows.append({"reduced_every": every, "running_totals_opcodes": totals_ops,
                     "running_totals_frames": totals_frames, "event_log_opcodes": log_ops,
                     "event_log_frames": log_frames})
    lines = ["| log reduced every | running totals: opcodes / event | frames / event | "
             "event log: opcodes / event | frames / event |", "| ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['reduced_every']} storages | {r['running_totals_opcodes']:.1f} | "
                     f"{r['running_totals_frames']:.2f} | {r['event_log_opcodes']:.1f} | {r['event_log_frames']:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": command_line(__file__, argv), "torch": torch.__version__, "rows": rows}
    write_results(args.json, result, args.markdown, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
