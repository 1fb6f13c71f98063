"""A live storage found to be something else than the ledger has it: moved to another category, or tagged.

The ledger records what torch does (storages made, freed, resized; saved slots let go) and the peaks. What a
storage *is* is learnt later, by the collectors: an op's output becomes a saved activation, a gradient, the
optimizer's state, the KV cache; a saved storage is tagged with what made it and where it was saved. These
functions are that reclassification; each keeps the total unchanged and, with ``retro``, the peaks of the
phase in which the storage was made.
"""

from __future__ import annotations

from .ledger import ACTIVATIONS, FIRST_WHERE_TAG, Entry, Ledger

__all__ = ["move", "set_tag"]


def move(ledger: Ledger, entry: Entry, cat: int, *, retro: bool = False) -> None:
    """Move a live storage to another category (the total does not change).

    With ``retro=True`` a storage created in the current phase that only
    now reveals what it was (optimizer state found after ``step()``, a
    gradient stored by AccumulateGrad) is also moved in the phase and
    global peak compositions, if it was alive at those peaks.
    """
    old = entry.cat
    if old == cat:
        return
    n = entry.nbytes
    ledger.totals[old] -= n
    ledger.totals[cat] += n
    entry.cat = cat
    # When it became ``old`` and what it was before: at a peak before that, it was still that.
    moved, before = entry.moved, entry.before
    ledger.seq += 1  # an event of its own: a peak reached before it is told apart from one after it
    if ledger.stream is not None:
        ledger.stream_moves.append((ledger.seq, entry.key, cat))
        if retro and entry.phase_serial == ledger.phase_serial:
            ledger.stream_retro.append(ledger.seq)
    entry.moved, entry.before = ledger.seq, old
    if old == ACTIVATIONS or cat == ACTIVATIONS:
        sign = -1 if old == ACTIVATIONS else 1
        if entry.tag >= 0:
            ledger.tag_act[entry.tag] += sign * entry.tag_bytes
        if entry.where >= 0:
            ledger.tag_act[entry.where] += sign * entry.where_bytes
    if retro and entry.phase_serial == ledger.phase_serial:
        if entry.created <= ledger.phase_peak_seq:
            ledger.phase_peak[old if moved <= ledger.phase_peak_seq else before] -= n
            ledger.phase_peak[cat] += n
        if ledger.peak_phase_serial == ledger.phase_serial and entry.created <= ledger.peak_seq:
            ledger.peak[old if moved <= ledger.peak_seq else before] -= n
            ledger.peak[cat] += n
        # The peaks now hold it as ``cat`` since its creation: a later move starts from there.
        entry.moved, entry.before = 0, cat


def set_tag(ledger: Ledger, entry: Entry, tag: int, nbytes: "int | None" = None) -> None:
    """Tag a storage (what it is, or where it was saved from: each kind has its own slot);
    the tag counts ``nbytes`` (default: the storage's bytes)."""
    n = entry.nbytes if nbytes is None else nbytes
    if tag >= FIRST_WHERE_TAG:
        old, old_n = entry.where, entry.where_bytes
        entry.where, entry.where_bytes = tag, n
    else:
        old, old_n = entry.tag, entry.tag_bytes
        entry.tag, entry.tag_bytes = tag, n
    if entry.cat == ACTIVATIONS:
        if old >= 0:
            ledger.tag_act[old] -= old_n
        ledger.tag_act[tag] += n
