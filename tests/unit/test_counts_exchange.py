"""What an expert-parallel rank receives in the all-to-all of per-expert counts, by routing assumption
(``memprof.simulate.experts.CountsExchange``), on hand-made counts: no process group, no model."""

from __future__ import annotations

import torch

from memprof.record.routing import RouterCall, RoutingRecord
from memprof.simulate.experts import CountsExchange


class Group:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


# 8 experts over 4 ranks, 2 each; this rank routed 10, 2 | 3, 1 | 0, 4 | 2, 2 tokens to them.
SENT = torch.tensor([10, 2, 3, 1, 0, 4, 2, 2])


def test_balanced_every_source_sends_this_rank_its_share_as_this_rank_would():
    got = CountsExchange("balanced").received(SENT, Group(4, 2), [], [])
    assert got.tolist() == [0, 4] * 4  # rank 2's experts 4 and 5, from each of 4 sources


def test_worst_and_capacity_every_source_sends_its_heaviest_share():
    for policy in ("worst", "capacity"):
        got = CountsExchange(policy).received(SENT, Group(4, 2), [], [])
        assert got.tolist() == [10, 2] * 4  # the 12-token chunk of experts 0 and 1, whoever this rank is


def test_every_rank_s_record_gives_what_each_source_sent():
    calls = [(10, 2, 3, 1, 0, 4, 2, 2), (1, 1, 1, 1, 5, 5, 5, 5), (0, 0, 0, 0, 8, 8, 2, 2), (3, 3, 3, 3, 3, 3, 3, 3)]
    records = [RoutingRecord(calls=(RouterCall("moe", 8, 2, c),)) for c in calls]
    exchange = CountsExchange("replay", records)
    # Rank 0 sent SENT (its record's call 0); from source s it gets s's counts for experts 0 and 1.
    assert exchange.received(SENT, Group(4, 0), [], []).tolist() == [10, 2, 1, 1, 0, 0, 3, 3]
    assert exchange.notes()[0].count("every source sent what its recorded run's router chose") == 1
    # Laid out (ep, experts per rank), as transformers' AllToAllEP sends them: the same counts by row.
    two_d = CountsExchange("replay", records).received(SENT.view(4, 2), Group(4, 0), [], [])
    assert two_d.tolist() == [[10, 2], [1, 1], [0, 0], [3, 3]]
    assert CountsExchange("balanced").received(SENT.view(4, 2), Group(4, 2), [], []).tolist() == [[0, 4]] * 4
    # Counts that are not this rank's record: answered as if the others routed alike, and the notes say so.
    other = CountsExchange("replay", records)
    assert other.received(SENT + 1, Group(4, 0), [], []).tolist() == [11, 3] * 4
    assert "did not match the ranks' records" in other.notes()[0]


def test_splits_that_do_not_fit_get_no_answer():
    assert CountsExchange("balanced").received(SENT, Group(3, 0), [], []) is None  # 8 counts in 3 equal chunks
    assert CountsExchange("balanced").received(SENT, Group(4, 0), [], [3, 3, 1, 1]) is None
