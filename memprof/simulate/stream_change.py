"""How the tokens of a model cut to one block more are those of the cut before with runs of tokens inserted and some
numbers grown (:func:`change`), and that change made again (:func:`apply`): the half of
:mod:`memprof.simulate.depth_stream` that aligns two cuts' streams (:mod:`memprof.simulate.stream_tokens` writes
them); the other half checks that the change holds in the next cut and decodes the whole model's stream.

Tokens are aligned in full, or by their shapes alone (:func:`shape`: a free or resize without the way it names its
storage), each inserted run then slid along the copies it repeats to where the most tokens agree in full
(:func:`slid`).
"""

from __future__ import annotations

import difflib
import importlib.util
from typing import Callable, NamedTuple, Sequence, cast

from .stream_tokens import Token, Tokens, Ways

__all__ = ["Grown", "Stop", "Change", "change", "apply", "moved", "shape", "Opcode"]


def _matcher() -> "Callable[..., difflib.SequenceMatcher[Token]]":
    """The matcher that aligns two cuts' tokens: cydifflib's where it is installed (a dependency of memprof on
    CPython), which is difflib's ``SequenceMatcher`` compiled, the same algorithm giving the same opcodes (pinned by
    tests/unit/test_stream_change.py); on a pipeline stage's streams, a few hundred distinct tokens repeated over
    10,000, difflib's own takes 0.4-0.6 s an alignment and cydifflib's 0.02-0.04 s. Without it (another interpreter,
    a platform without its wheel) difflib's: the same answers, slower."""
    if importlib.util.find_spec("cydifflib") is None:
        return difflib.SequenceMatcher
    import cydifflib

    return cast("Callable[..., difflib.SequenceMatcher[Token]]", cydifflib.SequenceMatcher)


Matcher = _matcher()

#: A token grown from one cut to the next: written in full, and what its bytes, position and new bytes grew by.
Grown = tuple[Token, tuple[int, int, int]]



class Stop(Exception):
    """A stream that the tokens cannot extend (the reason is the message)."""


class Change(NamedTuple):
    """From one cut to the next: the runs of tokens inserted (``[start, end)`` in the next cut), and the tokens
    that grew (position in the next cut -> what each of its numbers grew by: bytes, position, new bytes). Also
    where each token of the next cut that was not inserted stood in the first (``aligned``), and the tokens of the
    runs whose position grows (``per_copy``: position in a run -> (growth, step)): by ``growth`` in every copy of
    the run each time one more is inserted (under a pipeline schedule a block's backward frees what an earlier
    micro-batch's forward made, named from the newest of its size, after the live storages of every later block
    of the micro-batches in flight, whose number grows with the blocks in every copy at once), or by ``step`` from
    each copy to the next (FSDP2 resizes the parameters it gathered to 0 in order of a list each copy shortens)."""

    runs: list[tuple[int, int]]
    grew: dict[int, Grown]
    aligned: "dict[int, int] | None" = None
    per_copy: "dict[int, tuple[int, int]] | None" = None


def change(a: Tokens, b: Tokens, by_shape: bool = False) -> Change:
    """How ``b``'s tokens are ``a``'s with runs inserted and some numbers grown (a storage of bytes in proportion
    to the parameters, a free naming its storage from an end of a list that grew). Each token of ``b`` is written
    in full, a grown free named the way that both cuts share and that moved least. ``by_shape``:
    the tokens are aligned by their shapes alone (:func:`shape`), and a free or resize aligned with one that names
    its storage otherwise grew as where aligned in full."""
    runs: list[tuple[int, int]] = []
    grew: dict[int, Grown] = {}
    aligned: dict[int, int] = {}
    seq_a, seq_b = ([shape(t) for t in a[0]], [shape(t) for t in b[0]]) if by_shape else (a[0], b[0])
    ops: "Sequence[Opcode]" = Matcher(None, seq_a, seq_b, autojunk=False).get_opcodes()
    if by_shape:
        ops = slid(ops, a[0], b[0], seq_b)
    for op, i1, i2, j1, j2 in ops:
        if op == "equal":
            aligned.update(zip(range(j1, j2), range(i1, i2)))
            for x, y in zip(range(i1, i2), range(j1, j2)) if by_shape else ():
                if a[0][x] != b[0][y]:
                    full, by = grown(a[0][x], a[1][x], b[0][y], b[1][y])
                    if any(by):  # else a way stood still, which _agreed finds
                        grew[y] = (full, by)
            continue
        if op == "insert":
            runs.append((j1, j2))
            continue
        if op == "delete":
            raise Stop("its allocation stream lost events with a block more")
        pairs = paired(a, b, i1, i2, j1, j2)
        y = j1
        for x, yx in pairs:
            if yx > y:
                runs.append((y, yx))
            grew[yx] = grown(a[0][x], a[1][x], b[0][yx], b[1][yx])
            aligned[yx] = x
            y = yx + 1
        if j2 > y:
            runs.append((y, j2))
    return Change(runs, grew, aligned)


Opcode = tuple[str, int, int, int, int]


def slid(ops: "Sequence[Opcode]", a: list[Token], b: list[Token], shapes: "list[Token]") -> "list[Opcode]":
    """``ops`` (difflib's, of the shapes) with each run inserted between two equal stretches slid along them to
    where the most tokens aligned are the same in full. Where a block's run repeats, inserting it at any copy gives
    the same shapes, and difflib takes the first place that matches; in full, the first copy of a run can differ
    from the rest (the first block frees what the others do not), and a run inserted before it made that copy the
    one each block adds."""
    tags = [op[0] for op in ops]
    out = [list(op[1:]) for op in ops]  # i1, i2, j1, j2 of each
    for k in range(1, len(out) - 1):
        if tags[k] != "insert" or tags[k - 1] != "equal" or tags[k + 1] != "equal":
            continue
        before, op, after = out[k - 1], out[k], out[k + 1]
        i, _, j1, j2 = op
        best, score = 0, 0
        moved, t = 0, 0  # along: b[j1 + t] takes a[i + t] from b[j2 + t]
        while j2 + t < after[3] and shapes[j1 + t] == shapes[j2 + t]:
            moved += (a[i + t] != b[j1 + t]) - (a[i + t] != b[j2 + t])
            t += 1
            best, score = (t, moved) if moved < score else (best, score)
        moved, t = 0, 0  # back: b[j2 - 1 - t] takes a[i - 1 - t] from b[j1 - 1 - t]
        while j1 - 1 - t >= before[2] and shapes[j1 - 1 - t] == shapes[j2 - 1 - t]:
            moved += (a[i - 1 - t] != b[j2 - 1 - t]) - (a[i - 1 - t] != b[j1 - 1 - t])
            t += 1
            best, score = (-t, moved) if moved < score else (best, score)
        if best:
            before[1] += best
            before[3] += best
            op[:] = [i + best, i + best, j1 + best, j2 + best]
            after[0] += best
            after[2] += best
    return [(tag, o[0], o[1], o[2], o[3]) for tag, o in zip(tags, out) if o[1] > o[0] or o[3] > o[2]]


def paired(a: Tokens, b: Tokens, i1: int, i2: int, j1: int, j2: int) -> list[tuple[int, int]]:
    """Each token of ``a[i1:i2]`` paired, in order, with one of ``b[j1:j2]`` (the others inserted), the pairs that
    differ least in their numbers (a storage whose bytes grow with the parameters among others of one size)."""
    n, m = i2 - i1, j2 - j1
    if n > m or n * m > 250_000:
        raise Stop("its allocation stream changed, not only grew, with a block more")
    inf = float("inf")
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    cost[0] = [0.0] * (m + 1)
    for x in range(1, n + 1):
        row, above = cost[x], cost[x - 1]
        for y in range(x, m + 1):
            row[y] = min(row[y - 1], above[y - 1] + apart(a, i1 + x - 1, b, j1 + y - 1))
    if cost[n][m] == inf:
        raise Stop("its allocation stream changed, not only grew, with a block more")
    pairs, x, y = [], n, m
    while x:
        if cost[x][y] == cost[x][y - 1] and y > x:
            y -= 1
        else:
            pairs.append((i1 + x - 1, j1 + y - 1))
            x, y = x - 1, y - 1
    return pairs[::-1]


def apart(a: Tokens, x: int, b: Tokens, y: int) -> float:
    """How far token ``x`` of ``a`` is from token ``y`` of ``b`` in its numbers (infinite: another kind)."""
    ta, tb = a[0][x], b[0][y]
    if ta[0] != tb[0] or ta[0] in ("m", "s", "x"):
        return float("inf")
    far = abs(tb[1] - ta[1])
    if ta[0] == "a":
        return float(far) if ta[2:] == tb[2:] else float("inf")
    common = a[1][x].keys() & b[1][y].keys()
    if not common or ta[6:] != tb[6:]:  # a move pairs only with a move to the same category
        return float("inf")
    far += min(abs(b[1][y][w] - a[1][x][w]) for w in common)
    return float(far + (abs(tb[5] - ta[5]) if ta[0] == "r" else 0))


def grown(ta: Token, oa: Ways, tb: Token, ob: Ways) -> Grown:
    """Token ``tb`` written the way it and ``ta`` share that moved least, and how much each number grew."""
    if ta[0] != tb[0] or ta[0] in ("m", "s", "x"):
        raise Stop("its allocation stream changed, not only grew, with a block more")
    if ta[0] == "a":
        if ta[2:] != tb[2:]:
            raise Stop("its allocation stream changed, not only grew, with a block more")
        return (tb, (tb[1] - ta[1], 0, 0))
    if ta[6:] != tb[6:]:
        raise Stop("its allocation stream changed, not only grew, with a block more")
    ways = [(abs(ob[w] - oa[w]), abs(ob[w]), w) for w in oa.keys() & ob.keys()]
    if not ways:
        raise Stop("its allocation stream frees a storage no way named alike in both cuts")
    _, _, (way, ago) = min(ways)
    full = (tb[0], tb[1], way, ago, ob[(way, ago)], *tb[5:])
    grown = (tb[1] - ta[1], ob[(way, ago)] - oa[(way, ago)], (tb[5] - ta[5]) if tb[0] == "r" else 0)
    return (full, grown)


def apply(tokens: list[Token], change: Change, times: int) -> tuple[list[Token], Change, list[int]]:
    """``tokens`` with ``change`` made ``times`` more times: each run inserted again after itself, each grown
    token's numbers grown again; the change as it stands in the result (its runs the last copy); and where in
    ``tokens`` each token of the result came from."""
    starts = {start: end for start, end in change.runs}
    per_copy = change.per_copy or {}
    out: list[Token] = []
    runs: list[tuple[int, int]] = []
    grew: dict[int, Grown] = {}
    copies: dict[int, tuple[int, int]] = {}
    origin: list[int] = []
    i = 0
    while i < len(tokens):
        end = starts.get(i)
        if end is not None:
            for copy in range(times + 1):
                for q, token in enumerate(tokens[i:end], i):
                    if q in per_copy:  # grown: in the run for the next insertion, or as a grown token
                        growth, step = per_copy[q]
                        token = moved(token, times * growth + copy * step)
                        if copy == times:
                            copies[len(out)] = (growth, step)
                        elif growth:
                            grew[len(out)] = (token, (0, growth, 0))
                    out.append(token)
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
                token = (*token[:5], full[5] + times * new, *full[6:])
            grew[len(out)] = (token, (size, value, new))
            out.append(token)
        i += 1
    return out, Change(runs, grew, None, copies), origin


def moved(token: Token, by: int) -> Token:
    """A free or resize ``token`` naming its storage ``by`` positions further along its way."""
    return (*token[:4], token[4] + by, *token[5:])


def shape(token: Token) -> Token:
    """A token without the way a free or resize names its storage by (a move keeps its category)."""
    return token[:2] if token[0] == "f" else (token[0], token[1], *token[5:]) if token[0] == "r" else token
