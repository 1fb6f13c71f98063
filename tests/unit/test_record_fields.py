"""The record parts' serialisation written once (memprof/record/fields.py): a frozen dataclass to its JSON dict
from its fields and back, each value checked against its annotation as strictly as the hand-written readers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from memprof.errors import TraceFormatError
from memprof.record import fields as fileform
from memprof.record.fields import form
from memprof.vocabulary import Phase


@dataclass(frozen=True)
class Inner:
    name: str
    size: int

    def to_dict(self) -> dict[str, Any]:
        return fileform.write(self)

    @classmethod
    def from_dict(cls, data: Any) -> "Inner":
        return fileform.read(cls, data, "an inner part")


@dataclass(frozen=True)
class Part:
    step: int
    phase: Phase
    pairs: tuple[tuple[str, int], ...] = ()
    inner: "Inner | None" = None
    flag: bool = False
    renamed: "int | None" = field(default=None, metadata=form(key="old_name", label="the old name"))
    when: "float | None" = field(default=None, metadata=form(read=lambda v, n: None if v is None else float(v)))


GOOD = {"step": 1, "phase": "backward", "pairs": [["a", 2]], "inner": {"name": "x", "size": 3}, "flag": True,
        "old_name": 4, "when": 1}


def test_a_part_is_written_from_its_fields_in_their_order_and_read_back():
    part = fileform.read(Part, GOOD, "a part")
    assert part == Part(1, Phase.BACKWARD, (("a", 2),), Inner("x", 3), True, 4, 1.0)
    # Field order, tuples as lists, the enum as its value, the nested part as its dict, the renamed key.
    assert list(fileform.write(part).items()) == [
        ("step", 1), ("phase", "backward"), ("pairs", [["a", 2]]), ("inner", {"name": "x", "size": 3}),
        ("flag", True), ("old_name", 4), ("when", 1.0)]


def test_absent_fields_take_their_defaults_and_a_required_one_is_named():
    assert fileform.read(Part, {"step": 0, "phase": "forward"}, "a part") == Part(0, Phase.FORWARD)
    with pytest.raises(TraceFormatError, match=r"a part lacks \['phase', 'step'\]"):
        fileform.read(Part, {"flag": False}, "a part")


@pytest.mark.parametrize("key, value, match", [
    ("step", True, "Part.step must be an int, got True"),
    ("step", -1, "Part.step must be between 0"),
    ("step", 2**63, "Part.step must be between 0"),
    ("phase", "Forward", "Part.phase must be one of forward"),
    ("phase", None, "Part.phase must be one of forward"),
    ("pairs", "ab", "Part.pairs must be a list, got 'ab'"),
    ("pairs", [["a", 2, 3]], "Part.pairs must be a list of 2 values"),
    ("pairs", [["a", "2"]], "Part.pairs must be an int"),
    ("inner", [], "an inner part must be a mapping"),
    ("inner", {"name": "x"}, r"an inner part lacks \['size'\]"),
    ("flag", "no", "Part.flag must be true or false, got 'no'"),
    ("old_name", "4", "the old name must be an int"),
])
def test_a_value_unlike_its_annotation_is_refused_naming_it(key, value, match):
    with pytest.raises(TraceFormatError, match=match):
        fileform.read(Part, {**GOOD, key: value}, "a part")


def test_null_is_none_for_an_optional_field_only():
    part = fileform.read(Part, {**GOOD, "inner": None, "old_name": None}, "a part")
    assert part.inner is None and part.renamed is None


def test_a_string_is_read_with_lone_surrogates_replaced():
    assert fileform.read(Inner, {"name": "a\ud800", "size": 0}, "x").name == "a\ufffd"


def test_a_field_the_mechanism_cannot_check_is_a_mistake_in_memprof_not_let_through():
    @dataclass(frozen=True)
    class Loose:
        ratio: float

    with pytest.raises(RuntimeError, match="cannot check"):
        fileform.read(Loose, {"ratio": 0.5}, "a loose part")


def test_a_string_in_a_generations_cache_spec_is_read_as_every_string_is():
    # Found by tests/integration/test_loader_properties.py: a lone surrogate in a string field of the cache spec
    # (not a list's item) was kept, and the trace then could not be printed or saved.
    from memprof.record.parts import GenerationFacts

    facts = GenerationFacts.from_dict({"cache": {"kind": "a\ud800", "layers": ["b\udfff"]}})
    assert facts.cache == (("kind", "a\ufffd"), ("layers", ("b\ufffd",)))


def test_a_field_left_unwritten_is_left_out_and_an_absent_value_stands_for_older_files():
    @dataclass(frozen=True)
    class Versioned:
        size: int = field(metadata=form(absent=7))
        version: int = field(default=3, metadata=form(written=False))

    assert fileform.write(Versioned(1, 5)) == {"size": 1}
    assert fileform.read(Versioned, {}, "a versioned part") == Versioned(7, 3)
