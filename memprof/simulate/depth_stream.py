"""The allocation stream of a model at its full depth, from the streams of three cuts of it.

The allocator replay (:mod:`memprof.simulate.device_memory`) needs the whole model's stream: its cache moves in whole
segments, so its figures are no line in depth (:mod:`memprof.simulate.depth`). A stream of identical blocks is
itself regular, though: each block adds the same events, at the same places. So the stream is extended, not the
figures, and replayed whole.

A stream's events name storages by key, which no two runs share, so each is first written as a token that does
not (:func:`~memprof.simulate.stream_tokens.tokens_of`): a storage made (its bytes, the category the ledger made
it in, whether it moved to another while it lived), or freed or resized, naming *which* live storage of its bytes
by the nearest of five positions (:class:`~memprof.simulate.stream_tokens.Classes`: from the newest or the oldest
of those made in its epoch, the span between two markers; from the newest or the oldest of all; from the one freed
last: a backward frees its block's activations newest first, a ``foreach`` step frees its outputs oldest first);
and each phase's start, peak and end as a marker where it falls.
A token stream names exactly one stream (keys aside), :func:`_decoded`. The tokens of the cut to ``k + 1`` blocks
are those of ``k`` with runs of tokens inserted and some numbers grown (a storage of one norm per parameter; a
storage named from the end of a list that grows): they are found (:func:`~memprof.simulate.stream_change.change`),
and the check is that inserting each run once more where it was inserted, and growing each grown number once more,
gives the tokens of the cut to ``k + 2``, exactly (:func:`_agreed`). A free in a run may name its storage by a
position that grows in every copy of the run each time one more is inserted (under a pipeline schedule a block's
backward frees what its micro-batch's forward made, after the later blocks' storages of every micro-batch in
flight): the growth is measured from ``k`` to ``k + 1`` on a copy of the run the cut kept, and must hold in every
copy in the cut to ``k + 2`` (:func:`_per_copy`); or one that moves by a step from each copy to the next (FSDP2
resizing what it gathered to 0), measured on the copy just before the run and held in every copy of the cut to
``k + 2`` (:func:`_per_step`; also on the copy after the run, and with a growth beside it: a backward visits the blocks
from the last, so the copy a block adds comes before those it repeats). Where the tokens aligned in full give no
change that the next cut confirms, they are aligned by their shapes alone (:func:`_aligned`: a first pipeline
stage's backward frees a storage of the block before it after its own events, which full alignment splits from the
run), each run slid to where the most tokens agree in full (:mod:`memprof.simulate.stream_change`). Then each run
inserted ``more`` times again gives the tokens of the model at full depth, decoded into a stream whose events are
numbered one by one, the moments placed at their markers. A switch of the current CUDA stream (FSDP2's copy-in and
reduce-scatter streams:
:class:`~memprof.collect.streams.StreamUse`) is a marker too, so each block's run carries its own switches and the
whole model's stream places every storage on the stream the whole model's run made it on; storages a library holds
for another stream (``record_stream``, FSDP1) are not placed, and such a run is simulated whole. Where a check
fails the reason is returned instead, and the caller simulates the whole model.

What the figures extended in a line miss, the stream shows: a storage whose bytes grow with the depth is rounded by
the target's allocator (512 B), which no line follows; :func:`corrected` adds the difference to the category the
storage was made in, at every moment it is live.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

from ..errors import is_interrupt
from .stream_change import Change, Grown, Stop
from .stream_change import apply as _apply
from .stream_change import change as _change
from .stream_change import shape as _shape
from .stream_tokens import FREE, ORDER, Classes, MovedCategories, Token, Tokens, tokens_of

if TYPE_CHECKING:
    from ..collect.simulated import RecordedStream
    from .aliases import ByKind
    from .estimated import Estimate

__all__ = ["extended_stream", "bent", "corrected", "HELD", "Side", "Extension"]


#: Why a run's stream is not extended whatever its cuts: storages held for another stream.
HELD = ("the run holds storages a library uses on another CUDA stream (record_stream), which the extended stream "
        "does not place")


def extended_stream(cuts: "Sequence[RecordedStream]", more: int, rounding: int, moves: bool = False
                    ) -> "tuple[RecordedStream, Extension] | str":
    """The :class:`~memprof.collect.simulated.RecordedStream` of the model at full depth from the three cuts'
    (``k``, ``k + 1`` and ``k + 2`` blocks): the change from the cut to ``k`` to that to ``k + 1`` made once more
    must give the cut to ``k + 2``, exactly; it is then made ``more`` times more. With it, what the figures
    extended in a line miss, the category each of its storages was made in, and its moves of a storage to another
    category (with ``moves``; else none) and its moments in the order they fall between its events
    (:class:`Extension`), which :mod:`memprof.simulate.stream_peaks` reads the composition of any moment off. A str
    where it cannot: why."""
    try:
        found = _aligned_cuts(cuts, 2, moves)
        if isinstance(found, str):
            return found
        moved, _tokens, (change, tokens, per_copy) = found
        # The cut to k + 2's tokens, position by position.
        predicted, change, _ = _apply(tokens, change._replace(per_copy=per_copy), 1)
        whole, change, origin = _apply(predicted, change, more)
        at_moments = {p: moved.at_moments[q] for p, q in enumerate(origin) if q in moved.at_moments}
        decoded = _decoded(whole, len(cuts[2].moments), change.grew, more, rounding, at_moments)
    except (Stop, KeyError, IndexError, ValueError) as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return _stopped(exc, "its extended allocation stream")
    return _recorded(cuts[2], decoded), Extension(decoded.missed, decoded.cats, decoded.side)


def bent(cuts: "Sequence[RecordedStream]", rounding: int) -> "tuple[RecordedStream, dict[int, dict[int, int]]] | str":
    """The cut to ``k`` blocks' own stream (``cuts[0]``, its events numbered as :func:`_decoded` numbers them) and,
    at each of its moments, what the line through the cuts to ``k + 1`` and ``k + 2`` misses of its figures, by
    category: the allocator rounds a storage whose bytes grow with the blocks (a flat buffer of every parameter's
    gradient or optimizer state, or a rank's flat shard of them: ``d`` bytes a block, not a multiple of 512) to
    ``rounding(x + n d)``, which is no line in ``n``, while every other storage's bytes are. The line through the
    two larger cuts extended back by two blocks, plus what this gives, is the cut to ``k``'s figures exactly where
    the cuts' figures are affine but for the rounding: subtracted from the cut's figures, the three cuts are
    checked as a line (``depth``), and what the line misses at full depth is :class:`Extension`'s ``missed``. The
    change from ``k`` to ``k + 1`` is the one :func:`extended_stream` finds; a str where there is none, or where the
    decoding stops (:func:`_decoded`)."""
    try:
        found = _aligned_cuts(cuts, 0, False)
        if isinstance(found, str):
            return found
        moved, tokens, (change, _tokens, _per_copy) = found
        if change.aligned is None:
            return UNEVEN
        # The grown tokens of the cut to k + 1, where they stand in the cut to k: each bytes-grown storage there
        # is x - d of the next cut's x, and the line extended back by two blocks reads it at k.
        grew = {change.aligned[y]: g for y, g in change.grew.items() if y in change.aligned}
        decoded = _decoded(tokens[0][0], len(cuts[0].moments), grew, -2, rounding, moved.at_moments)
    except (Stop, KeyError, IndexError, ValueError) as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return _stopped(exc, "its allocation stream")
    return _recorded(cuts[0], decoded), decoded.missed


#: A change from one cut to the next that holds in the third (:func:`_aligned`): the change, the middle cut's tokens
#: written as every copy names its storages, and the positions that grow in every copy.
Agreed = tuple[Change, list[Token], dict[int, tuple[int, int]]]


def _aligned_cuts(cuts: "Sequence[RecordedStream]", tracked: int, moves: bool
                  ) -> "tuple[MovedCategories, list[Tokens], Agreed] | str":
    """The three cuts' tokens (with ``moves``, their moves between categories too; the categories of cut
    ``tracked``'s storages at its moments kept by the :class:`MovedCategories` returned) and the change from the
    first to the second that, made once more, gives the third (:func:`_aligned`); or why there is none: storages
    held for another stream, phases that differ between the cuts, no such change."""
    if any(r.streams.held for r in cuts):
        return HELD
    moved = MovedCategories(cuts[tracked].moves)
    tokens = [tokens_of(r, moved if i == tracked else None, moves) for i, r in enumerate(cuts)]
    steps = [tuple(m[0] for m in r.moments) for r in cuts]
    if any(s != steps[0] for s in steps):
        return "its phases differ between the cuts"
    agreed = _aligned(tokens[0], tokens[1], tokens[2])
    return agreed if isinstance(agreed, str) else (moved, tokens, agreed)


def _stopped(exc: Exception, what: str) -> str:
    """Why ``what`` (a stream being decoded) did not decode: a :class:`Stop`'s reason, or a token naming no live
    storage (a ``KeyError``, ``IndexError`` or ``ValueError``): not this stream's shape."""
    return str(exc) if isinstance(exc, Stop) else f"{what} frees a storage it never made"


def _recorded(like: "RecordedStream", decoded: "Decoded") -> "RecordedStream":
    """The :class:`~memprof.collect.simulated.RecordedStream` of the ``decoded`` tokens of a stream with ``like``'s
    moments (the largest cut's, for the whole model's stream), its events numbered one by one. The ledger's own peak
    is where the replay looks only when no phase record holds the run's peak (depth.py checks one does): it is the
    moment of ``like``'s that it falls on, else none."""
    from ..collect.simulated import RecordedStream
    from ..collect.streams import StreamUse

    at = next(((i, f) for i, m in enumerate(like.moments) for f, seq in enumerate(m[1:]) if seq == like.peak_seq),
              None)
    peak = decoded.moments[at[0]][at[1]] if at is not None else 0
    return RecordedStream(tuple(decoded.events),
                          tuple((m[0], d[0], d[1], d[2]) for m, d in zip(like.moments, decoded.moments)), peak,
                          StreamUse(switches=tuple(decoded.switches)))


#: Why the cuts' streams do not extend where no run of events repeats as a block is added.
UNEVEN = "its allocation stream did not grow by the same events per block"


def _aligned(a: Tokens, b: Tokens, c: Tokens) -> "Agreed | str":
    """The change from ``a`` to ``b`` that, made once more, gives ``c`` (:func:`_agreed`'s tokens and growths
    beside it), or why there is none. The tokens are aligned in full first; failing that, by their shapes alone (a
    free or resize without the way it names its storage): where a block's backward frees a storage of the block
    before it (a 1F1B stage's first micro-batch), the run a block adds holds the previous block's free, and
    aligned in full the free falls apart from the run, one copy from where the next cut puts it. The reason
    given is the first alignment's."""
    reason: "str | None" = None
    for by_shape in (False, True):
        try:
            change = _change(a, b, by_shape)
        except Stop as exc:
            if is_interrupt(exc):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            reason = reason or str(exc)
            continue
        predicted, _, origin = _apply(b[0], change, 1)
        agreed = _agreed(a, b, c, predicted, origin, change) if len(predicted) == len(c[0]) else None
        if agreed is not None:
            return change, *agreed
        reason = reason or UNEVEN
    assert reason is not None
    return reason


def _agreed(a: Tokens, b: Tokens, c: Tokens, predicted: list[Token], origin: list[int], change: Change
            ) -> "tuple[list[Token], dict[int, tuple[int, int]]] | None":
    """``b``'s tokens, each free or resize that did not grow written the way that names its storage alike
    wherever the change puts a copy of it in ``c`` (a block's own storages, which each copy of a run names,
    move in the lists of their bytes from copy to copy, so the nearest way in one cut need not be the one that
    holds); None where a token has no such way, or the prediction differs from ``c`` otherwise. Failing that, a
    token of a run may name its storage the same way in every copy by a position that grows: in every copy by what
    it grew from ``a`` to ``b`` (:func:`_per_copy`), or from each copy to the next by what it moved from the copy
    ``b`` has just before the run (:func:`_per_step`), as every copy in ``c`` must show; those positions and
    growths are returned beside the tokens."""
    Fit = tuple[tuple[str, int], int, int]
    allowed: dict[int, set[Fit]] = {}
    copies: dict[int, list[int]] = {}  # q -> where its copies stand in c, in order
    for p, q in enumerate(origin):
        token, want = predicted[p], c[0][p]
        if q in change.grew or token[0] not in ("f", "r"):
            if not _same(token, want, c[1][p]):
                return None
            continue
        if want[0] != token[0] or want[1] != token[1] or (token[0] == "r" and want[5:] != token[5:]):
            return None
        theirs, ours = c[1][p], b[1][q]
        fits: set[Fit] = {(w, 0, 0) for w, v in ours.items() if theirs.get(w) == v}
        allowed[q] = allowed[q] & fits if q in allowed else fits
        copies.setdefault(q, []).append(p)
    kept: "dict[tuple[int, int], int | None]" = {}
    for q in [q for q, fits in allowed.items() if not fits]:  # no way holds still: one that grows, if any
        run = next(((s, e) for s, e in change.runs if s <= q < e), None)
        if run is None:  # a token no block inserted: nothing grows it per copy
            return None
        # The same token in the copies of the run on either side, by position and counted without markers.
        beside = {q - (run[1] - run[0]), q + (run[1] - run[0]), *_beside(b[0], q, run)}
        ours, grown, stepped = b[1][q], _per_copy(a, b, q, run, change, kept, beside), _per_step(b, q, beside)
        fits = {(w, g, 0) for w, g in grown} | {(w, 0, h) for w, h in stepped}
        # Both at once: where a backward visits the blocks from the last, the copy a block adds comes before those
        # it repeats; each copy kept moves by g (measured on one) and the new one sits h before the one after it,
        # so, in the order of the stream, the first copy moved by g - h (from the oldest of a list: g = 0).
        fits |= {(w, g - h, h) for w, h in stepped for g in {0, *(g for v, g in grown if v == w)}}
        for j, p in enumerate(copies[q]):
            theirs = c[1][p]
            fits = {(w, g, h) for w, g, h in fits if theirs.get(w) == ours[w] + g + j * h}
        allowed[q] = fits
    tokens = list(b[0])
    per_copy: dict[int, tuple[int, int]] = {}
    for q, fits in allowed.items():
        if not fits:
            return None
        # A way that stands still, then one that grows alike in every copy (checked in each), then one that steps
        # from copy to copy (with two copies in the next cut, checked in one): a free's position from the newest
        # that grew in every copy and its distance from the last free that stepped in the one checked did not in
        # a third copy.
        (way, ago), g, h = min(fits, key=lambda f: (f[1] != 0 or f[2] != 0, f[2] != 0, abs(b[1][q][f[0]]),
                                                    ORDER[f[0][0]]))
        t = tokens[q]
        tokens[q] = (t[0], t[1], way, ago, b[1][q][(way, ago)], *t[5:])
        if g or h:
            per_copy[q] = (g, h)
    return tokens, per_copy


def _per_step(b: Tokens, q: int, beside: "set[int]") -> "set[tuple[tuple[str, int], int]]":
    """How far each way of token ``q`` of ``b`` is from the same token of the copies of its run just before and
    after it (at ``beside``, where the token there is the same free or resize), as the step from a copy to the one
    after it: each (way, step), which each copy in the next cut must move on by."""
    out: set[tuple[tuple[str, int], int]] = set()
    ours = b[1][q]
    for at in beside:
        if not 0 <= at < len(b[0]) or _shape(b[0][at]) != _shape(b[0][q]):
            continue
        theirs, later = b[1][at], at > q  # the step is from a copy to the one after it
        out.update((w, (theirs[w] - ours[w]) if later else (ours[w] - theirs[w]))
                   for w in ours.keys() & theirs.keys() if ours[w] != theirs[w])
    return out


def _per_copy(a: Tokens, b: Tokens, q: int, run: tuple[int, int], change: Change,
              kept: "dict[tuple[int, int], int | None]", beside: "set[int]") -> "set[tuple[tuple[str, int], int]]":
    """How far each way of token ``q`` of ``b``, in ``run``, moved from ``a`` to ``b``, as measured on a copy of the
    run that ``b`` kept from ``a``, at the same place in it: its value in ``b`` against the value of the token of
    ``a`` it stood for. The copies looked at: those just before and just after the run (``beside``), where the
    token there is the same free or resize, and the nearest copy of the whole run (:func:`_kept_copy`; ``kept``
    holds each run's, found once). Each (way, growth) measured, any of which the caller may check against the next
    cut."""
    if change.aligned is None:
        return set()
    if run not in kept:
        kept[run] = _kept_copy(b[0], run, change)
    copy = kept[run]
    places = beside | ({copy + q - run[0]} if copy is not None else set())
    out: set[tuple[tuple[str, int], int]] = set()
    for at in places:
        x = change.aligned.get(at)
        if x is None or _shape(b[0][at]) != _shape(b[0][q]) or _shape(a[0][x]) != _shape(b[0][q]):
            continue
        theirs, ours = a[1][x], b[1][at]
        out.update({(w, ours[w] - theirs[w]) for w in ours.keys() & theirs.keys() & b[1][q].keys()
                    if ours[w] != theirs[w]})
    return out


def _beside(tokens: list[Token], q: int, run: tuple[int, int]) -> list[int]:
    """Where token ``q`` of ``run`` stands in the copies of the run just before and after it, counted without
    markers: a phase's moment (its peak) falls in one copy of a block's run, not in the others."""
    n = sum(1 for t in tokens[run[0]:run[1]] if t[0] != "m")
    out = []
    for step in (-1, 1):
        at, left = q, n
        while left and 0 <= at + step < len(tokens):
            at += step
            left -= tokens[at][0] != "m"
        if not left and tokens[at][0] != "m":
            out.append(at)
    return out


def _kept_copy(tokens: list[Token], run: tuple[int, int], change: Change) -> "int | None":
    """Where the nearest other copy of ``run`` starts in ``tokens`` (the same tokens, frees and resizes by their
    kind and bytes alone), every token of it one the cut before had (aligned: not inserted); None if there is
    none."""
    assert change.aligned is not None
    s, e = run
    n = e - s
    shapes = [_shape(t) for t in tokens[s:e]]
    for d in range(n, max(s, len(tokens) - e) + 1):  # outwards, until both ends are passed
        for j in (s - d, s + d):
            if (0 <= j and j + n <= len(tokens) and _shape(tokens[j]) == shapes[0]
                    and all(j + o in change.aligned for o in range(n))
                    and [_shape(t) for t in tokens[j:j + n]] == shapes):
                return j
    return None


def _same(predicted: Token, token: Token, options: "ByKind") -> bool:
    """Does ``predicted`` name what ``token`` (with the ways it could be written, ``options``) does?"""
    if predicted == token:
        return True
    if predicted[0] != token[0] or predicted[0] not in ("f", "r") or predicted[1] != token[1]:
        return False
    if predicted[0] == "r" and predicted[5:] != token[5:]:
        return False
    return bool(options.get((predicted[2], predicted[3])) == predicted[4])


#: A move, ``("v", seq, key, category, retroactive)`` (1: it also moved the storage in its phase's peak), or a
#: moment, ``("m", seq, moment, which of its three, 0)``, of a decoded stream, at the seq of the event before it.
Side = tuple[str, int, int, int, int]


class Extension(NamedTuple):
    """What a stream extended to full depth holds beside its events (:func:`extended_stream`)."""

    #: What the figures extended in a line miss: seq -> category -> bytes.
    missed: dict[int, dict[int, int]]
    #: The category each storage was made in (-1: not known), one per storage made, in order.
    cats: list[int]
    #: Its moves of a storage to another category and its moments, in order (:data:`Side`).
    side: list[Side]


class Decoded(NamedTuple):
    """A token stream decoded (:func:`_decoded`)."""

    events: list[tuple[int, int, int]]
    moments: list[list[int]]
    switches: list[tuple[int, int]]
    missed: dict[int, dict[int, int]]
    #: The category each storage was made in (-1: not known), one per storage made, in order.
    cats: list[int]
    #: The moves and the moments in the order they fall between the events (both placed at the seq of the event
    #: before them, which cannot tell them apart where they share it).
    side: "list[Side]"


def _decoded(tokens: list[Token], moments: int, grew: dict[int, Grown], more: int, rounding: int,
             at_moments: "dict[int, dict[tuple[int, int], int]]") -> Decoded:
    """The stream ``tokens`` name: its events numbered 1, 2, ... (keys too), each moment's (start, peak, end)
    seq: the seq of the last event before its marker, and each switch of the current stream as ``(seq, stream)``,
    the seq of the last event before it (:class:`~memprof.collect.streams.StreamUse`); the category each storage
    was made in and each move of a storage to another, as the ledger records them. And what the figures
    extended in a line miss at each marker's seq, by category: a storage whose bytes grew by ``d`` per block
    (``grew``, by position) is ``rounding(x + more d)`` at full depth, where the line through the cuts'
    ``rounding(x - d)`` and ``rounding(x)`` says ``rounding(x) + more (rounding(x) - rounding(x - d))``, in the
    category it is in at each moment (``at_moments``: by the position of the token that made a storage that moved,
    (moment, which) -> category). A storage whose category is not known at a moment stops it where it misses
    anything."""
    classes = Classes()
    keys: dict[tuple[int, int], int] = {}
    events: list[tuple[int, int, int]] = []
    placed = [[0, 0, 0] for _ in range(moments)]
    switches: list[tuple[int, int]] = []
    fresh = 0
    missing: dict[int, tuple[int | dict[tuple[int, int], int], int]] = {}  # key -> (category, bytes the line misses)
    missed: dict[int, dict[int, int]] = {}
    cats: list[int] = []
    side: list[Side] = []
    made: "dict[int, int | dict[tuple[int, int], int] | None]" = {}  # key -> its category (None: not known)
    for position, token in enumerate(tokens):
        kind = token[0]
        if kind == "s":
            switches.append((len(events), token[1]))
            continue
        if kind == "m":
            classes.epoch += 1
            placed[token[1]][token[2]] = len(events)
            side.append(("m", len(events), token[1], token[2], 0))
            if missing:
                at = missed.setdefault(len(events), {})
                at.clear()
                for where, nbytes in missing.values():
                    cat = where if isinstance(where, int) else where.get((token[1], token[2]), -1)
                    if cat < 0:
                        raise Stop("a storage whose bytes grow with the blocks has no category known at a moment")
                    at[cat] = at.get(cat, 0) + nbytes
            continue
        if kind == "r" and len(token) > 6:  # a move to another category: no event, the storage re-made in its class
            size = token[1]
            key = keys.pop((size, classes.find(size, token[2], token[4], token[3], False)))
            keys[(size, classes.make(size))] = key
            side.append(("v", len(events), key, token[6], token[7]))
            continue
        fresh += 1
        seq = len(events) + 1
        if kind == "a":
            keys[(token[1], classes.make(token[1]))] = fresh
            events.append((seq, fresh, token[1]))
            cats.append(token[2])
            category: "int | dict[tuple[int, int], int] | None" = (at_moments.get(position) if token[3]
                                                                    else int(token[2]))
            made[fresh] = category
            if position in grew:
                _miss(missing, fresh, category, _missed(token[1], grew[position][1][0], more, rounding))
        elif kind == "x":
            events.append((seq, fresh, FREE))
        else:
            size = token[1]
            key = keys.pop((size, classes.find(size, token[2], token[4], token[3], kind == "f")))
            if kind == "f":
                missing.pop(key, None)
                events.append((seq, key, FREE))
            else:
                # Resized (a ZeRO rank's state made whole in the step, then cut to its flat shard; FSDP2's gathered
                # parameters resized to 0): what the line misses is the new bytes' (none where they do not grow).
                missing.pop(key, None)
                if position in grew:
                    _miss(missing, key, made.get(key), _missed(token[5], grew[position][1][2], more, rounding))
                keys[(token[5], classes.make(token[5]))] = key
                events.append((seq, key, token[5]))
    return Decoded(events, placed, switches, missed, cats, side)


def _miss(missing: "dict[int, tuple[int | dict[tuple[int, int], int], int]]", key: int,
          where: "int | dict[tuple[int, int], int] | None", nbytes: int) -> None:
    """Note that the line misses ``nbytes`` of storage ``key``, in the category ``where`` it was made in (by
    moment where it moves between categories: :class:`~memprof.simulate.stream_tokens.MovedCategories`)."""
    if not nbytes:
        return
    if where is None or (isinstance(where, int) and where < 0):
        raise Stop("a storage whose bytes grow with the blocks has no category known")
    missing[key] = (where, nbytes)


def _missed(size: int, grow: int, more: int, rounding: int) -> int:
    """What the line through the cuts misses of a storage of ``size`` bytes at full depth that grew by ``grow``
    per block (see :func:`_decoded`)."""
    def r(n: int) -> int:
        return -(-n // rounding) * rounding if rounding > 1 and n > 0 else n

    now, before = size - more * grow, size - (more + 1) * grow
    return r(size) - r(now) - more * (r(now) - r(before))


def corrected(est: "Estimate", recorded: "RecordedStream", missed: "dict[int, dict[int, int]] | None"
              ) -> "Estimate | str":
    """``est`` (its figures extended in a line) with what the line missed (:func:`extended_stream`) added where
    ``recorded`` places each moment: every phase record's start, peak and end, and the run's. The per-phase
    statistics are the caller's to make again from the records (``depth._stats_of_records``). Nothing missed
    (none, or None: no stream was extended) leaves ``est`` as it is. A str where bytes were missed at the peak of a
    simulated ZeRO or FSDP rank's optimizer step (:func:`~memprof.simulate.device_memory.scaled_step`): that peak
    is no moment of the stream but the rank's share of the replica's (``LayoutPlan.finish``), whose categories the
    stream's do not give (a ZeRO-1 rank's flat share of the states, one storage rounded to the allocator's 512 B,
    went to the temporaries there)."""
    import dataclasses

    from ..record.parts import Breakdown
    from .device_memory import moments_of, scaled_step

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

    steps = []
    for step in trace.steps:
        phases = []
        for i, rec in enumerate(step.phases):
            where = placed.get((step.index, i))
            if where is not None and scaled_step(trace, rec) and any(missed.get(where[1], {}).values()):
                return (f"the line through the cuts missed bytes at step {step.index} {rec.phase.value}'s peak, which "
                        "is the rank's share of the replica's step, not a moment of the stream")
            phases.append(rec if where is None else dataclasses.replace(
                rec, start=fixed(rec.start, where[0]), peak=fixed(rec.peak, where[1]), end=fixed(rec.end, where[2])))
        steps.append(dataclasses.replace(step, phases=tuple(phases)))
    out = dataclasses.replace(trace, steps=tuple(steps), start=fixed(trace.start, first), peak=fixed(trace.peak, peak),
                              end=fixed(trace.end, end))
    return dataclasses.replace(est, trace=out)
