"""The allocation stream of a model at its full depth, from the streams of three cuts of it.

The allocator replay (:mod:`memprof.simulate.device_memory`) needs the whole model's stream: its cache moves in whole
segments, so its figures are no line in depth (:mod:`memprof.simulate.depth`). A stream of identical blocks is
itself regular, though: each block adds the same events, at the same places. So the stream is extended, not the
figures, and replayed whole.

A stream's events name storages by key, which no two runs share, so each is first written as a token that does
not (:func:`_tokens`): a storage made (its bytes, the category the ledger made it in, whether it moved to another
while it lived), or freed or resized, naming *which* live storage of its bytes by the nearest of five positions
(:class:`_Classes`: from the newest or the oldest of those made in its epoch, the span between two markers; from the
newest or the oldest of all; from the one freed last: a backward frees its block's activations newest first, a
``foreach`` step frees its outputs oldest first); and each phase's start, peak and end as a marker where it falls.
A token stream names exactly one stream (keys aside), :func:`_decoded`. The tokens of the
cut to ``k + 1`` blocks are those of ``k`` with runs of tokens inserted and some numbers grown (a storage of one
norm per parameter; a storage named from the end of a list that grows): they are found (:func:`_change`), and the
check is that inserting each run once more where it was inserted, and growing each grown number once more, gives the
tokens of the cut to ``k + 2``, exactly (:func:`_agreed`). Then each run inserted ``more`` times again gives the
tokens of the model at full depth, decoded into a stream whose events are numbered one by one, the moments placed
at their markers. A switch of the current CUDA stream (FSDP2's copy-in and reduce-scatter streams:
:class:`~memprof.collect.streams.StreamUse`) is a marker too, so each block's run carries its own switches and the
whole model's stream places every storage on the stream the whole model's run made it on; storages a library holds
for another stream (``record_stream``, FSDP1) are not placed, and such a run is simulated whole. Where a check
fails the reason is returned instead, and the caller simulates the whole model.

What the figures extended in a line miss, the stream shows: a storage whose bytes grow with the depth is rounded by
the target's allocator (512 B), which no line follows; :func:`corrected` adds the difference to the category the
storage was made in, at every moment it is live.
"""

from __future__ import annotations

import difflib
from bisect import bisect_left
from typing import Any, NamedTuple, Sequence

from ..errors import is_interrupt

__all__ = ["extended_stream", "corrected", "HELD"]

_FREE = -1


#: Why a run's stream is not extended whatever its cuts: storages held for another stream.
HELD = ("the run holds storages a library uses on another CUDA stream (record_stream), which the extended stream "
        "does not place")


class _Stop(Exception):
    """A stream that the tokens cannot extend (the reason is the message)."""


def extended_stream(cuts: Sequence[Any], more: int, rounding: int) -> Any:
    """The :class:`~memprof.collect.simulated.RecordedStream` of the model at full depth from the three cuts'
    (``k``, ``k + 1`` and ``k + 2`` blocks): the change from the cut to ``k`` to that to ``k + 1`` made once more
    must give the cut to ``k + 2``, exactly; it is then made ``more`` times more. With it, what the figures
    extended in a line miss (:func:`_decoded`): seq -> category -> bytes. A str where it cannot: why."""
    from ..collect.simulated import RecordedStream
    from ..collect.streams import StreamUse

    if any(r.streams.held for r in cuts):
        return HELD
    try:
        moved = _MovedCategories(cuts[2].moves)
        a, b, c = _tokens(cuts[0]), _tokens(cuts[1]), _tokens(cuts[2], moved)
        steps = [tuple(m[0] for m in r.moments) for r in cuts]
        if not steps[0] == steps[1] == steps[2]:
            return "its phases differ between the cuts"
        change = _change(a, b)
        predicted, _, origin = _apply(b[0], change, 1)
        if len(predicted) != len(c[0]):
            return "its allocation stream did not grow by the same events per block"
        tokens = _agreed(b, c, predicted, origin, change)
        if tokens is None:
            return "its allocation stream did not grow by the same events per block"
        predicted, change, _ = _apply(tokens, change, 1)  # the cut to k + 2's tokens, position by position
        whole, change, origin = _apply(predicted, change, more)
        at_moments = {p: moved.at_moments[q] for p, q in enumerate(origin) if q in moved.at_moments}
        events, moments, switches, missed = _decoded(whole, len(cuts[2].moments), change.grew, more, rounding,
                                                     at_moments)
    except _Stop as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return str(exc)
    except (KeyError, IndexError, ValueError) as exc:  # a token naming no live storage: not this stream's shape
        if is_interrupt(exc):
            raise
        return "its extended allocation stream frees a storage it never made"
    # The ledger's own peak is where the replay looks only when no phase record holds the run's peak (depth.py
    # checks one does): it is the moment of the largest cut's that it falls on, else none.
    last = cuts[2]
    at = next(((i, f) for i, m in enumerate(last.moments) for f, seq in enumerate(m[1:]) if seq == last.peak_seq),
              None)
    peak = moments[at[0]][at[1]] if at is not None else 0
    return RecordedStream(tuple(events), tuple[Any, ...]((s, *m) for s, m in zip(steps[2], moments)), peak,
                          StreamUse(switches=tuple(switches))), missed


class _Change(NamedTuple):
    """From one cut to the next: the runs of tokens inserted (``[start, end)`` in the next cut), and the tokens
    that grew (position in the next cut -> what each of its numbers grew by: bytes, position, new bytes)."""

    runs: list[tuple[int, int]]
    grew: dict[int, tuple[Any, tuple[int, int, int]]]


def _change(a: tuple[list[Any], list[Any]], b: tuple[list[Any], list[Any]]) -> _Change:
    """How ``b``'s tokens are ``a``'s with runs inserted and some numbers grown (a storage of bytes in proportion
    to the parameters, a free naming its storage from an end of a list that grew). Each token of ``b`` is written
    in full (:func:`_full`), a grown free named the way that both cuts share and that moved least."""
    runs: list[tuple[int, int]] = []
    grew: dict[int, tuple[Any, tuple[int, int, int]]] = {}
    ops = difflib.SequenceMatcher(None, a[0], b[0], autojunk=False).get_opcodes()
    for op, i1, i2, j1, j2 in ops:
        if op == "equal":
            continue
        if op == "insert":
            runs.append((j1, j2))
            continue
        if op == "delete":
            raise _Stop("its allocation stream lost events with a block more")
        pairs = _paired(a, b, i1, i2, j1, j2)
        y = j1
        for x, yx in pairs:
            if yx > y:
                runs.append((y, yx))
            grew[yx] = _grown(a[0][x], a[1][x], b[0][yx], b[1][yx])
            y = yx + 1
        if j2 > y:
            runs.append((y, j2))
    return _Change(runs, grew)


def _paired(a: tuple[list[Any], list[Any]], b: tuple[list[Any], list[Any]], i1: int, i2: int, j1: int,
            j2: int) -> list[tuple[int, int]]:
    """Each token of ``a[i1:i2]`` paired, in order, with one of ``b[j1:j2]`` (the others inserted), the pairs that
    differ least in their numbers (a storage whose bytes grow with the parameters among others of one size)."""
    n, m = i2 - i1, j2 - j1
    if n > m or n * m > 250_000:
        raise _Stop("its allocation stream changed, not only grew, with a block more")
    inf = float("inf")
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    cost[0] = [0.0] * (m + 1)
    for x in range(1, n + 1):
        row, above = cost[x], cost[x - 1]
        for y in range(x, m + 1):
            row[y] = min(row[y - 1], above[y - 1] + _apart(a, i1 + x - 1, b, j1 + y - 1))
    if cost[n][m] == inf:
        raise _Stop("its allocation stream changed, not only grew, with a block more")
    pairs, x, y = [], n, m
    while x:
        if cost[x][y] == cost[x][y - 1] and y > x:
            y -= 1
        else:
            pairs.append((i1 + x - 1, j1 + y - 1))
            x, y = x - 1, y - 1
    return pairs[::-1]


def _apart(a: tuple[list[Any], list[Any]], x: int, b: tuple[list[Any], list[Any]], y: int) -> float:
    """How far token ``x`` of ``a`` is from token ``y`` of ``b`` in its numbers (infinite: another kind)."""
    ta, tb = a[0][x], b[0][y]
    if ta[0] != tb[0] or ta[0] in ("m", "s", "x"):
        return float("inf")
    far = abs(tb[1] - ta[1])
    if ta[0] == "a":
        return float(far) if ta[2:] == tb[2:] else float("inf")
    common = a[1][x].keys() & b[1][y].keys()
    if not common:
        return float("inf")
    far += min(abs(b[1][y][w] - a[1][x][w]) for w in common)
    return float(far + (abs(tb[5] - ta[5]) if ta[0] == "r" else 0))


def _grown(ta: tuple[Any, ...], oa: Any, tb: tuple[Any, ...], ob: Any) -> tuple[Any, tuple[int, int, int]]:
    """Token ``tb`` written the way it and ``ta`` share that moved least, and how much each number grew."""
    if ta[0] != tb[0] or ta[0] in ("m", "s", "x"):
        raise _Stop("its allocation stream changed, not only grew, with a block more")
    if ta[0] == "a":
        if ta[2:] != tb[2:]:
            raise _Stop("its allocation stream changed, not only grew, with a block more")
        return (tb, (tb[1] - ta[1], 0, 0))
    ways = [(abs(ob[w] - oa[w]), abs(ob[w]), w) for w in oa.keys() & ob.keys()]
    if not ways:
        raise _Stop("its allocation stream frees a storage no way named alike in both cuts")
    _, _, (way, ago) = min(ways)
    full = (tb[0], tb[1], way, ago, ob[(way, ago)], *tb[5:])
    grown = (tb[1] - ta[1], ob[(way, ago)] - oa[(way, ago)], (tb[5] - ta[5]) if tb[0] == "r" else 0)
    return (full, grown)


def _apply(tokens: list[Any], change: _Change, times: int) -> tuple[list[Any], _Change, list[int]]:
    """``tokens`` with ``change`` made ``times`` more times: each run inserted again after itself, each grown
    token's numbers grown again; the change as it stands in the result (its runs the last copy); and where in
    ``tokens`` each token of the result came from."""
    starts = {start: end for start, end in change.runs}
    out: list[Any] = []
    runs: list[tuple[int, int]] = []
    grew: dict[int, tuple[Any, tuple[int, int, int]]] = {}
    origin: list[int] = []
    i = 0
    while i < len(tokens):
        end = starts.get(i)
        if end is not None:
            out.extend(tokens[i:end] * (times + 1))
            origin.extend(list(range(i, end)) * (times + 1))
            runs.append((len(out) - (end - i), len(out)))
            i = end
            continue
        grown = change.grew.get(i)
        origin.append(i)
        if grown is None:
            out.append(tokens[i])
        else:
            full, (size, value, new) = grown
            token = (full[0], full[1] + times * size, *full[2:4], full[4] + times * value, *full[5:]) \
                if full[0] != "a" else ("a", full[1] + times * size, *full[2:])
            if full[0] == "r":
                token = (*token[:5], full[5] + times * new)
            grew[len(out)] = (token, (size, value, new))
            out.append(token)
        i += 1
    return out, _Change(runs, grew), origin


def _agreed(b: tuple[list[Any], list[Any]], c: tuple[list[Any], list[Any]], predicted: list[Any], origin: list[int],
            change: _Change) -> "list[Any] | None":
    """``b``'s tokens, each free or resize that did not grow written the way that names its storage alike
    wherever the change puts a copy of it in ``c`` (a block's own storages, which each copy of a run names,
    move in the lists of their bytes from copy to copy, so the nearest way in one cut need not be the one that
    holds); None where a token has no such way, or the prediction differs from ``c`` otherwise."""
    allowed: dict[int, set[Any]] = {}
    for p, q in enumerate(origin):
        token, want = predicted[p], c[0][p]
        if q in change.grew or token[0] not in ("f", "r"):
            if not _same(token, want, c[1][p]):
                return None
            continue
        if want[0] != token[0] or want[1] != token[1] or (token[0] == "r" and want[5] != token[5]):
            return None
        theirs, ours = c[1][p], b[1][q]
        fits = {w for w, v in ours.items() if theirs.get(w) == v}
        allowed[q] = allowed[q] & fits if q in allowed else fits
    tokens = list(b[0])
    for q, fits in allowed.items():
        if not fits:
            return None
        way, ago = min(fits, key=lambda w: (abs(b[1][q][w]), _ORDER[w[0]]))
        t = tokens[q]
        tokens[q] = (t[0], t[1], way, ago, b[1][q][(way, ago)], *t[5:])
    return tokens


def _same(predicted: tuple[Any, ...], token: tuple[Any, ...], options: Any) -> bool:
    """Does ``predicted`` name what ``token`` (with the ways it could be written, ``options``) does?"""
    if predicted == token:
        return True
    if predicted[0] != token[0] or predicted[0] not in ("f", "r") or predicted[1] != token[1]:
        return False
    if predicted[0] == "r" and predicted[5] != token[5]:
        return False
    return bool(options.get((predicted[2], predicted[3])) == predicted[4])


def _tokens(recorded: Any, moved: "_MovedCategories | None" = None) -> tuple[list[Any], list[Any]]:
    """``recorded``'s events and moments as tokens (see the module's docstring), and beside each free or resize
    every way it could be written ((way, epochs ago) -> position). A storage made is written with its bytes, the
    category it was made in (-1: not known) and whether it moved to another while it lived."""
    # The moments, and each switch of the current stream, where they fall between two events: (seq, 0, moment,
    # which of its three) and (seq, 1, stream, 0), a moment first where both fall at one seq.
    marks = sorted([(seq, 0, i, f) for i, m in enumerate(recorded.moments) for f, seq in enumerate(m[1:])]
                   + [(seq, 1, stream, 0) for seq, stream in recorded.streams.switches])
    made, cats = _made(recorded)
    live: dict[Any, tuple[int, int]] = {}  # key -> (bytes, the n-th of its bytes made)
    classes = _Classes()
    out: list[Any] = []
    options: list[Any] = []
    at = 0
    for index, (seq, key, nbytes) in enumerate(recorded.events):
        while at < len(marks) and marks[at][0] < seq:
            out.append(_marker(marks[at], classes, moved))
            options.append(None)
            at += 1
        if nbytes == _FREE and key not in live:
            out.append(("x",))  # a storage the stream never made
            options.append(None)
        elif nbytes == _FREE or key in live:
            size, n = live.pop(key)
            ways = classes.take(size, n, nbytes == _FREE)
            (way, ago), value = min(ways.items(), key=lambda kv: (abs(kv[1]), _ORDER[kv[0][0]]))
            if nbytes == _FREE:
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
        out.append(_marker(mark, classes, moved))
        options.append(None)
    return out, options


def _marker(mark: tuple[int, int, int, int], classes: "_Classes", moved: "_MovedCategories | None") -> tuple[Any, ...]:
    """The token of a moment, ``("m", moment, which)``, which starts an epoch, or of a switch of the current stream
    to another, ``("s", stream)``: the storages made after it are made on that stream (their allocator's pool)."""
    seq, kind, a, b = mark
    if kind == 1:
        return ("s", a)
    classes.epoch += 1
    if moved is not None:
        moved.marker(seq, a, b)
    return ("m", a, b)


class _MovedCategories:
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


def _made(recorded: Any) -> tuple[set[int], dict[int, int]]:
    """Of the events of ``recorded`` that make a storage: those whose storage moved to another category while it
    lived, and each one's category when made (none where the stream and the categories do not pair up)."""
    moves = sorted(recorded.moves)
    live: dict[Any, int] = {}
    moved: set[int] = set()
    made: list[int] = []
    at = 0
    for index, (seq, key, nbytes) in enumerate(recorded.events):
        while at < len(moves) and moves[at][0] < seq:
            where = live.get(moves[at][1])
            if where is not None:
                moved.add(where)
            at += 1
        if nbytes == _FREE:
            live.pop(key, None)
        elif key not in live:
            live[key] = index
            made.append(index)
    cats = dict(zip(made, recorded.cats)) if len(made) == len(recorded.cats) else {}
    return moved, cats


#: Which way names a storage when two are as near: the ends of its epoch's list first.
_ORDER = {"T": 0, "B": 1, "t": 2, "b": 3, "d": 4}


def _decoded(tokens: list[Any], moments: int, grew: Any, more: int, rounding: int,
             at_moments: "dict[int, dict[tuple[int, int], int]]",
             ) -> tuple[list[tuple[int, int, int]], list[list[int]], list[tuple[int, int]], dict[int, dict[int, int]]]:
    """The stream ``tokens`` name: its events numbered 1, 2, ... (keys too), each moment's (start, peak, end)
    seq: the seq of the last event before its marker, and each switch of the current stream as ``(seq, stream)``,
    the seq of the last event before it (:class:`~memprof.collect.streams.StreamUse`). And what the figures
    extended in a line miss at each marker's seq, by category: a storage whose bytes grew by ``d`` per block
    (``grew``, by position) is ``rounding(x + more d)`` at full depth, where the line through the cuts'
    ``rounding(x - d)`` and ``rounding(x)`` says ``rounding(x) + more (rounding(x) - rounding(x - d))``, in the
    category it is in at each moment (``at_moments``: by the position of the token that made a storage that moved,
    (moment, which) -> category). A storage whose category is not known at a moment stops it where it misses
    anything."""
    classes = _Classes()
    keys: dict[tuple[int, int], int] = {}
    events: list[tuple[int, int, int]] = []
    placed = [[0, 0, 0] for _ in range(moments)]
    switches: list[tuple[int, int]] = []
    fresh = 0
    missing: dict[int, tuple[int | dict[tuple[int, int], int], int]] = {}  # key -> (category, bytes the line misses)
    missed: dict[int, dict[int, int]] = {}
    for position, token in enumerate(tokens):
        kind = token[0]
        if kind == "s":
            switches.append((len(events), token[1]))
            continue
        if kind == "m":
            classes.epoch += 1
            placed[token[1]][token[2]] = len(events)
            if missing:
                at = missed.setdefault(len(events), {})
                at.clear()
                for where, nbytes in missing.values():
                    cat = where if isinstance(where, int) else where.get((token[1], token[2]), -1)
                    if cat < 0:
                        raise _Stop("a storage whose bytes grow with the blocks has no category known at a moment")
                    at[cat] = at.get(cat, 0) + nbytes
            continue
        fresh += 1
        seq = len(events) + 1
        if kind == "a":
            keys[(token[1], classes.make(token[1]))] = fresh
            events.append((seq, fresh, token[1]))
            if position in grew:
                miss = _missed(token[1], grew[position][1][0], more, rounding)
                if miss:
                    if token[2] < 0 or (token[3] and position not in at_moments):
                        raise _Stop("a storage whose bytes grow with the blocks has no category known")
                    missing[fresh] = (at_moments[position] if token[3] else token[2], miss)
        elif kind == "x":
            events.append((seq, fresh, _FREE))
        else:
            size = token[1]
            key = keys.pop((size, classes.find(size, token[2], token[4], token[3], kind == "f")))
            if kind == "f":
                missing.pop(key, None)
                events.append((seq, key, _FREE))
            else:
                if key in missing or (position in grew and _missed(token[5], grew[position][1][2], more, rounding)):
                    raise _Stop("a storage whose bytes grow with the blocks was resized")
                keys[(token[5], classes.make(token[5]))] = key
                events.append((seq, key, token[5]))
    return events, placed, switches, missed


def _missed(size: int, grow: int, more: int, rounding: int) -> int:
    """What the line through the cuts misses of a storage of ``size`` bytes at full depth that grew by ``grow``
    per block (see :func:`_decoded`)."""
    def r(n: int) -> int:
        return -(-n // rounding) * rounding if rounding > 1 and n > 0 else n

    now, before = size - more * grow, size - (more + 1) * grow
    return r(size) - r(now) - more * (r(now) - r(before))


class _Classes:
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


def corrected(est: Any, recorded: Any, missed: "dict[int, dict[int, int]]") -> Any:
    """``est`` (its figures extended in a line) with what the line missed (:func:`extended_stream`) added where
    ``recorded`` places each moment: every phase record's start, peak and end, the run's, and the per-phase
    statistics (which shift alike only where every step missed alike: else a str saying so)."""
    import dataclasses

    from ..record.parts import Breakdown
    from ..record.stats import series_from
    from .device_memory import moments_of

    if not missed:
        return est
    trace = est.trace
    placed, first, peak, end = moments_of(trace, recorded)

    def fixed(b: Breakdown, seq: int) -> Breakdown:
        miss = missed.get(seq)
        if not miss:
            return b
        counts = list(b.counts)
        for cat, nbytes in miss.items():
            counts[cat] = (counts[cat] or 0) + nbytes
        return Breakdown(tuple(counts), None if b.total is None else b.total + sum(miss.values()))

    steps, shifted = [], set()
    for step in trace.steps:
        phases = []
        for i, rec in enumerate(step.phases):
            where = placed.get((step.index, i))
            if where is None:
                phases.append(rec)
                continue
            if any(missed.get(seq) for seq in where):
                shifted.add((rec.phase, rec.occurrence))
            phases.append(dataclasses.replace(rec, start=fixed(rec.start, where[0]), peak=fixed(rec.peak, where[1]),
                                              end=fixed(rec.end, where[2])))
        steps.append(dataclasses.replace(step, phases=tuple(phases)))
    stats = []
    for st in trace.phase_stats:
        if (st.phase, st.occurrence) not in shifted:
            stats.append(st)
            continue
        records = [rec for step in steps for rec in step.phases if (rec.phase, rec.occurrence) == (st.phase,
                                                                                                    st.occurrence)]
        if len(records) != st.count:  # steps the record keeps no detail of: their figures are not here
            return "the extended figures miss bytes in steps the record keeps no detail of"
        at_peak, at_end = (series_from(st.peak, [r.peak for r in records]),
                           series_from(st.end, [r.end for r in records]))
        if at_peak is None or at_end is None:
            return "the per-phase statistics count figures the phases' records do not hold"
        stats.append(dataclasses.replace(st, peak=at_peak, end=at_end))
    out = dataclasses.replace(trace, steps=tuple(steps), phase_stats=tuple(stats), start=fixed(trace.start, first),
                              peak=fixed(trace.peak, peak), end=fixed(trace.end, end))
    return dataclasses.replace(est, trace=out)
