"""A plan's table says which answers are confirmed: an answer whose next batch was not simulated (the search stopped
at its ceiling) is a lower bound, marked as one, and never described as verified."""

from memprof.record.plans import PlanGrid, PlanRow
from memprof.render.plan import plan_text


def _row(layout: str, batch: int, verified: bool) -> PlanRow:
    return PlanRow(layout, "bf16", True, batch, batch, 1 << 30, 4 << 30, 12 << 30, "activations", 1 << 29, 0,
                   "backward", {"activations": 1 << 29}, 5, verified)


def test_an_answer_at_the_search_ceiling_reads_as_a_lower_bound():
    # The search stopped at 4,096 with room to spare: 4,096 fits, and no larger batch was simulated.
    grid = PlanGrid((_row("ddp", 4096, False), _row("fsdp", 512, True)), "m", "t4", 16 << 30, 2, 32, 1.0)
    text = plan_text(grid)
    rows = [line[2:].split() for line in text.splitlines() if line[2:].startswith(("ddp ", "fsdp "))]
    cells = {r[0]: r for r in rows}
    assert "4096+" in cells["ddp"] and "512" in cells["fsdp"] and "512+" not in cells["fsdp"]
    assert "* the largest batch: ddp, bf16, checkpointing on: at least 4096 per rank" in text
    assert "+ an answer the batch above it was not simulated for" in text


def test_a_plan_whose_answers_are_all_confirmed_prints_no_mark():
    grid = PlanGrid((_row("ddp", 37, True),), "m", "t4", 16 << 30, 2, 32, 1.0)
    text = plan_text(grid)
    assert "37+" not in text and "at least" not in text and "not simulated for" not in text
    assert "* the largest batch: ddp, bf16, checkpointing on: 37 per rank" in text

