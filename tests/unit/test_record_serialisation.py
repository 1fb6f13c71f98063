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


def _parts():
    """Parts the trace fixtures leave out or leave empty (routing, an OOM, a DDP rank, an encoder-decoder's
    generation, a checkpointed call, a group's implementation); parts.json holds what the hand-written writers
    made of them."""
    from memprof.record.cache import CacheMoment
    from memprof.record.parts import GenerationFacts, OomRecord, RankInfo
    from memprof.record.routing import RouterCall, RoutingRecord
    from memprof.record.specs import ModuleCall, OptimizerSpec, ParamSpec, TensorSpec

    return (RoutingRecord((RouterCall("moe", 4, 2, (1, 3, 2, 2)), RouterCall("", 2, 1, (0, 4))), True),
            OomRecord("CUDA out of memory", 10, 20, 30, "snap.pickle"), RankInfo(1, 4, "nccl", "ddp", True),
            GenerationFacts(2, 2, 8, None, 2, 1, ((0, "prefill", 0, 4), (0, "decode", 0, 6)), None, 3, 16,
                            (CacheMoment(0, "decode", 0, "peak", 4, 5, 6, 2, True),), ((0, 0),)),
            ModuleCall("fc", ("torch.nn.Linear",), (("bias", True), ("in_features", 3), ("k", (1, 2))),
                       (("weight", True),), (TensorSpec((2, 3), "float32"),), None, True, True, True),
            OptimizerSpec(("torch.optim.AdamW",), (((("lr", 0.1),), (0,), "foreach"),),
                          (ParamSpec((3,), "bfloat16", "cpu", False, False),), (("min", 4),)))


def test_the_parts_the_traces_leave_out_are_written_as_before_and_read_back():
    parts = _parts()
    written = json.dumps([p.to_dict() for p in parts], indent=1) + "\n"
    assert written == (SERIAL / "parts.json").read_text(encoding="utf-8")
    for part, data in zip(parts, json.loads(written)):
        assert type(part).from_dict(data) == part
