"""A recorded allocation stream written as tokens that name no storage by its key (which no two runs share), so
that the streams of a model cut to different depths can be compared token by token
(:mod:`memprof.simulate.depth_stream`).

A storage made is written with its bytes, the category the ledger made it in and whether it moved to another while
it lived; a free or a resize names *which* live storage of its bytes by the nearest of five positions
(:class:`Classes`: from the newest or the oldest of those made in its epoch, the span between two markers; from the
newest or the oldest of all; from the one freed last), every other way beside it; each phase's start, peak and end
is a marker where it falls, and so is each switch of the current CUDA stream. Asked for, each move of a live storage
to another category is a token too, written as a resize to its own bytes with the category it moved to and whether
the ledger applied the move to its phase's peak (``memprof.collect.moves``' ``retro``).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from ..collect.simulated import RecordedStream
    from .aliases import ByKind

__all__ = ["FREE", "ORDER", "Token", "Ways", "Tokens", "tokens_of", "marker", "MovedCategories", "made_categories",
           "Classes"]

FREE = -1

#: A token of a stream (see the module's docstring): its kind first ("a", "f", "r", "x", "m", "s"), then its numbers;
#: a storage's move to another category is a resize to its own bytes with the category and whether the move was
#: retroactive in its phase's peak (1 or 0) last (8 items).
Token = tuple["ByKind", ...]
#: Every way a free or a resize could name its storage: (way, epochs ago) -> position.
Ways = dict[tuple[str, int], int]
#: A stream's tokens, and beside each the ways it could be written (its Ways; None for a kind that names no storage).
Tokens = tuple[list[Token], list["ByKind"]]

#: Which way names a storage when two are as near: the ends of its epoch's list first.
ORDER = {"T": 0, "B": 1, "t": 2, "b": 3, "d": 4}

def tokens_of(recorded: "RecordedStream", moved: "MovedCategories | None" = None, moves: bool = False) -> Tokens:
    """``recorded``'s events and moments as tokens (see the module's docstring), and beside each free or resize
    every way it could be written ((way, epochs ago) -> position). A storage made is written with its bytes, the
    category it was made in (-1: not known) and whether it moved to another while it lived. With ``moves``, each
    move of a storage to another category is a token too (a resize to its own bytes, with the category), so that
    the composition of every moment of a stream extended from them is known (:mod:`memprof.simulate.stream_peaks`);
    they cost the extension time, and only a phase whose peak moves with depth needs them."""
    # The moments, and each switch of the current stream, where they fall between two events: (seq, 0, moment,
    # which of its three) and (seq, 1, stream, 0), a moment first where both fall at one seq; each move of a live
    # storage to another category, (seq, -1, key, category), before both (a moment's record counts the storage in
    # the category it moved to).
    marks = sorted([(seq, 0, i, f) for i, m in enumerate(recorded.moments) for f, seq in enumerate(m[1:])]
                   + [(seq, 1, stream, 0) for seq, stream in recorded.streams.switches]
                   + [(seq, -1, key, cat) for seq, key, cat in (recorded.moves if moves else ())])
    retro = set(recorded.retro)
    made, cats = made_categories(recorded)
    live: dict[int, tuple[int, int]] = {}  # key -> (bytes, the n-th of its bytes made)
    classes = Classes()
    out: list[Token] = []
    options: "list[Ways | None]" = []
    at = 0

    def side(mark: tuple[int, int, int, int]) -> None:
        if mark[1] >= 0:
            out.append(marker(mark, classes, moved))
            options.append(None)
        elif mark[2] in live:  # a move: the storage re-made in its class, as a resize to its own bytes
            size, n = live[mark[2]]
            ways = classes.take(size, n, False)
            (way, ago), value = min(ways.items(), key=lambda kv: (abs(kv[1]), ORDER[kv[0][0]]))
            out.append(("r", size, way, ago, value, size, mark[3], int(mark[0] in retro)))
            live[mark[2]] = (size, classes.make(size))
            options.append(ways)

    for index, (seq, key, nbytes) in enumerate(recorded.events):
        while at < len(marks) and marks[at][0] < seq:
            side(marks[at])
            at += 1
        if nbytes == FREE and key not in live:
            out.append(("x",))  # a storage the stream never made
            options.append(None)
        elif nbytes == FREE or key in live:
            size, n = live.pop(key)
            ways = classes.take(size, n, nbytes == FREE)
            (way, ago), value = min(ways.items(), key=lambda kv: (abs(kv[1]), ORDER[kv[0][0]]))
            if nbytes == FREE:
                out.append(("f", size, way, ago, value))
                if moved is not None:
                    moved.tracked.pop(key, None)
            else:
                out.append(("r", size, way, ago, value, nbytes))
                live[key] = (nbytes, classes.make(nbytes))
            options.append(ways)
        else:
            live[key] = (nbytes, classes.make(nbytes))
            if moved is not None and index in made:
                moved.made(key, len(out), cats.get(index, -1))
            out.append(("a", nbytes, cats.get(index, -1), index in made))
            options.append(None)
    for mark in marks[at:]:
        side(mark)
    return out, options


def marker(mark: tuple[int, int, int, int], classes: "Classes", moved: "MovedCategories | None") -> Token:
    """The token of a moment, ``("m", moment, which)``, which starts an epoch, or of a switch of the current stream
    to another, ``("s", stream)``: the storages made after it are made on that stream (their allocator's pool)."""
    seq, kind, a, b = mark
    if kind == 1:
        return ("s", a)
    classes.epoch += 1
    if moved is not None:
        moved.marker(seq, a, b)
    return ("m", a, b)


class MovedCategories:
    """The category of each storage that moves to another while it lives, at every moment of its life, by the
    position of the token that made it (:attr:`at_moments`: position -> (moment, which) -> category). What the
    figures' line misses of such a storage, where its bytes grow with the blocks, goes to the category it is in at
    each moment (the clipping's stack of norms, made a temporary, then a collective's input under FSDP2)."""

    def __init__(self, moves: "Sequence[tuple[int, int, int]]") -> None:
        self.moves = sorted(moves)
        self.next = 0
        self.tracked: dict[int, list[int]] = {}  # key -> [position, its category now]
        self.at_moments: dict[int, dict[tuple[int, int], int]] = {}

    def made(self, key: int, position: int, category: int) -> None:
        self.tracked[key] = [position, category]
        self.at_moments[position] = {}

    def marker(self, seq: int, moment: int, which: int) -> None:
        while self.next < len(self.moves) and self.moves[self.next][0] <= seq:  # the moves before the moment
            _seq, key, category = self.moves[self.next]
            if key in self.tracked:
                self.tracked[key][1] = category
            self.next += 1
        for position, category in self.tracked.values():
            self.at_moments[position][(moment, which)] = category


def made_categories(recorded: "RecordedStream") -> tuple[set[int], dict[int, int]]:
    """Of the events of ``recorded`` that make a storage: those whose storage moved to another category while it
    lived, and each one's category when made (none where the stream and the categories do not pair up)."""
    moves = sorted(recorded.moves)
    live: dict[int, int] = {}
    moved: set[int] = set()
    made: list[int] = []
    at = 0
    for index, (seq, key, nbytes) in enumerate(recorded.events):
        while at < len(moves) and moves[at][0] < seq:
            where = live.get(moves[at][1])
            if where is not None:
                moved.add(where)
            at += 1
        if nbytes == FREE:
            live.pop(key, None)
        elif key not in live:
            live[key] = index
            made.append(index)
    cats = dict(zip(made, recorded.cats)) if len(made) == len(recorded.cats) else {}
    return moved, cats


class Classes:
    """The live storages of each size, by the order they were made in (the n-th of that size), both all of them and
    those made in each span between two markers (an *epoch*: a phase's start, peak or end is the same moment at
    any depth), and the one of each size freed last: how a free names the storage it frees without its key. Of the
    five ways to name it the nearest is taken: from the newest or the oldest of its size made in its epoch (which a
    block more moves only where the storage is in the middle of the blocks), from the newest or the oldest of its
    size, or from the one freed last."""

    def __init__(self) -> None:
        self.epoch = 0
        self.live: dict[int, list[int]] = {}
        self.spans: dict[tuple[int, int], list[int]] = {}
        self.made_in: dict[tuple[int, int], int] = {}
        self.made: dict[int, int] = {}
        self.last: dict[int, int] = {}

    def make(self, size: int) -> int:
        n = self.made.get(size, 0)
        self.made[size] = n + 1
        self.live.setdefault(size, []).append(n)
        self.spans.setdefault((size, self.epoch), []).append(n)
        self.made_in[(size, n)] = self.epoch
        return n

    def take(self, size: int, n: int, free: bool) -> dict[tuple[str, int], int]:
        """Storage ``n`` of ``size`` leaves the class: every way to name it, (way, epochs ago) -> position."""
        live = self.live[size]
        i = bisect_left(live, n)
        epoch = self.made_in[(size, n)]
        span = self.spans[(size, epoch)]
        j = bisect_left(span, n)
        ago = self.epoch - epoch
        ways = {("T", ago): len(span) - 1 - j, ("B", ago): j, ("t", 0): len(live) - 1 - i, ("b", 0): i}
        last = self.last.get(size)
        if last is not None:
            ways[("d", 0)] = n - last
        self._remove(size, n)
        if free:
            self.last[size] = n
        return ways

    def find(self, size: int, way: str, value: int, ago: int, free: bool) -> int:
        """The storage of ``size`` that ``way``, ``value`` and ``ago`` name (:meth:`take` undone); it leaves the
        class."""
        if way in ("T", "B"):
            live = self.spans[(size, self.epoch - ago)]
            i = len(live) - 1 - value if way == "T" else value
        elif way == "d":
            live = self.live[size]
            n = self.last[size] + value
            i = bisect_left(live, n)
            if i == len(live) or live[i] != n:
                raise KeyError(n)
        else:
            live = self.live[size]
            i = len(live) - 1 - value if way == "t" else value
        if not 0 <= i < len(live):
            raise IndexError(i)
        n = live[i]
        self._remove(size, n)
        if free:
            self.last[size] = n
        return n

    def _remove(self, size: int, n: int) -> None:
        live = self.live[size]
        del live[bisect_left(live, n)]
        span = self.spans[(size, self.made_in.pop((size, n)))]
        del span[bisect_left(span, n)]
