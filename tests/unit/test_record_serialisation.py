"""The record's file format does not move: traces saved before the serialisation was written once (from its
fields, memprof/record/fields.py) are written again to the same bytes and load back equal.

The fixtures under tests/data/serial/ were written by make_fixtures.py there with the hand-written readers and
writers: a hand-built full trace, a light-mode run, a run under a schedule, a simulated FSDP rank and a
generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memprof.record.trace import Trace

SERIAL = Path(__file__).resolve().parents[1] / "data" / "serial"
NAMES = ("full", "light", "schedule", "fsdp_rank", "generation")


def _written(trace: Trace) -> bytes:
    # What Report.save writes (memprof.record.files.write_json_atomic with indent=1).
    return (json.dumps(trace.to_dict(), indent=1, ensure_ascii=False) + "\n").encode("utf-8")


@pytest.mark.parametrize("name", NAMES)
def test_a_saved_trace_is_written_again_to_the_same_bytes(name):
    saved = (SERIAL / f"{name}.json").read_bytes()
    loaded = Trace.from_dict(json.loads(saved))
    assert _written(loaded) == saved
    again = Trace.from_dict(json.loads(_written(loaded)))
    assert again == loaded


def test_the_fixtures_hold_every_part_the_format_has():
    # A fixture set that lost a part (no rank, no generation, no statistics) would pin nothing of its format.
    data = {n: json.loads((SERIAL / f"{n}.json").read_bytes()) for n in NAMES}
    assert data["fsdp_rank"]["distributed"]["layout_detail"]["groups"]
    assert data["generation"]["generation"]["moments"] and data["generation"]["generation"]["cache"]
    assert data["full"]["operations"] and data["full"]["module_calls"] and data["full"]["optimizers"]
    assert data["schedule"]["recorded_steps"] and data["schedule"]["phase_stats"]
    assert data["light"]["mode"] == "light"
