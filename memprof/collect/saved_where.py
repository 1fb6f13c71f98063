"""Where a saved activation was saved from: its "where" tag for the per-module formula's causes, and the
bytes each module's forward saved for the module table.

A storage autograd saves is tagged once with where it was first saved (outside the model, in a container's own
code, in a module without a saved-bytes rule), and again as rule modules save it, by what their rules count
against the storage memprof counts once: more (two modules saved it, an expanded view), or less (a view of a
larger storage). :meth:`.saved.SavedTracker.account_storage` calls these for each new activation (and
:meth:`.saved.SavedTracker.pack` writes out their common case for light mode's new activation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..vocabulary import Phase
from .ledger import ACTIVATIONS, INPUTS, TAGS, Entry
from .moves import move, set_tag

if TYPE_CHECKING:
    from .ledger import Ledger
    from .module_table import ModuleTable
    from .state import Run

__all__ = ["attribute", "saved_by_rule_module", "adopt_unseen"]

_FORWARD = Phase.FORWARD
_RECOMPUTED = TAGS.index("recomputed_for_backward")
_TAG = {name: i for i, name in enumerate(TAGS)}
_TAG_SAVED_OUTSIDE = _TAG["saved_outside_modules"]
_TAG_SAVED_TWICE = _TAG["saved_by_two_modules"]
_TAG_WEIGHT_COPY = _TAG["autocast_weight_copy"]
_TAG_SAVED_AS_VIEW = _TAG["saved_as_view_of_larger"]
_TAG_SAVED_EXPANDED = _TAG["saved_as_expanded_view"]
# "Where" tags that describe what the rule modules saving a storage count (or no tag yet).
_WHERE_BY_RULES = (-1, _TAG_SAVED_TWICE, _TAG_SAVED_AS_VIEW, _TAG_SAVED_EXPANDED)


def saved_by_rule_module(led: "Ledger", entry: Entry, index: int, view_bytes: int,
                         saved_inputs: "dict[tuple[int, int], int] | None") -> None:
    """Account for what the per-module formula counts: each rule counts the tensor its module
    saves (a view's bytes), once per module, whatever storage it shares. ``saved_inputs`` (module, storage
    key) -> bytes: the model's inputs that rule modules save, while the formula's shapes are captured (else
    None)."""
    if entry.cat == INPUTS:
        if saved_inputs is not None:
            # The model's inputs that a module with a rule saves: its rule counts them as activations.
            key = (index, entry.key)
            saved_inputs[key] = max(view_bytes, saved_inputs.get(key, 0))
        return
    if entry.cat != ACTIVATIONS:
        return
    savers = entry.savers
    if savers is None:
        savers = entry.savers = {}
    elif savers.get(index, 0) >= view_bytes:
        return
    savers[index] = view_bytes
    # What the rules of the modules that saved it count, against the storage memprof counts once.
    covered = sum(savers.values())
    where = entry.where
    if covered > entry.nbytes:
        # Rules count more than the storage holds: several modules saved it (ReLU's output, the next
        # Linear's input; q, k and v projections of one tensor), or one saved an expanded view of it.
        tag = _TAG_SAVED_TWICE if len(savers) > 1 else _TAG_SAVED_EXPANDED
        set_tag(led, entry, tag, covered - entry.nbytes)
    elif where in _WHERE_BY_RULES:
        if covered < entry.nbytes:
            # Rules count the views their modules saved (x[:, 0]); memprof, the whole storage.
            set_tag(led, entry, _TAG_SAVED_AS_VIEW, entry.nbytes - covered)
        elif where >= 0:
            set_tag(led, entry, where, 0)
    else:
        # First saved where no rule sees it (container code, a module without a rule, outside the
        # model): that cause names only what the rules of later savers do not count.
        set_tag(led, entry, where, entry.nbytes - covered)


def attribute(led: "Ledger", run: "Run", table: "ModuleTable", entry: Entry) -> None:
    """Where a new activation was saved from, for the per-module formula's causes and the module table.

    An autocast weight copy has a cause of its own in every comparison, so it gets no "where"
    that would name it twice.
    """
    where = entry.where < 0 and entry.tag != _TAG_WEIGHT_COPY
    stack = run.calls
    phase = run.phase
    if not stack:
        if where and phase is _FORWARD:
            set_tag(led, entry, _TAG_SAVED_OUTSIDE)
        return
    if phase is not _FORWARD:
        # Recomputation in backward (a reentrant checkpoint's block): not the module's forward saving,
        # but what the recomputed block keeps for its part of backward.
        if where:
            set_tag(led, entry, _RECOMPUTED)
        return
    index = stack[-1]
    if where:
        tag = table.saved_tag[index]
        if tag >= 0:
            set_tag(led, entry, tag)
    # ModuleTable.saved_in, written out: this runs for every new activation.
    info = table.info[index]
    if info.act_step != run.step:
        info.act_step = run.step
        info.act_bytes = 0
    info.act_bytes += entry.nbytes


def adopt_unseen(led: "Ledger", run: "Run", table: "ModuleTable", keys: list[int]) -> None:
    """Storages saved as inputs that turn out to come from compiled code: activations after all."""
    for key in keys:
        entry = led.entries.get(key)
        if entry is not None and entry.cat == INPUTS:
            move(led, entry, ACTIVATIONS, retro=True)
            if entry.saved < 0:
                entry.saved = 0
            attribute(led, run, table, entry)
