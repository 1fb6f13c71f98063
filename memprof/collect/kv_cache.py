"""The KV cache: tensors a model keeps from one forward to the next.

The rule is about what happens to a tensor, not its class. A tensor the model made in one call of its
forward that comes back into a later call is carried state: a KV cache. That covers a user's own cache
(a tuple of key/value tensors handed back), and transformers' ``Cache`` objects (``DynamicCache``,
``StaticCache``, sliding-window and encoder-decoder caches), which the model fills in place: tensors the
call made and left inside an object it was given are the cache too, as are those it returns under the
name it was given a cache by (or ``past_key_values`` and ``cache``, transformers' names for it).

In exact mode, where memprof sees every storage made, only tensors made inside the model's forward
count, so the attention mask or position ids a decoding loop builds between calls stay inputs. In light
mode storages made by ops are not seen: tensors under a cache's name are counted as the cache.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from ..record.cache import CacheMoment
from .cache_facts import CacheFacts, config_int, field as _field
from ..vocabulary import Phase
from ..errors import is_interrupt
from .hook_objects import hook_object
from .ledger import KV_CACHE, TEMPORARIES
from .moves import move
from .phases import begin_encoder, relabel_closed
from .state import EXACT
from .torch_compat import is_dynamo_compiling

if TYPE_CHECKING:
    from .dispatch import StorageTracker
    from .aliases import Args, Kwargs
    from .ledger import Ledger, Release
    from .phases import PhaseTracker
    from .state import Run
    from .undo import UndoStack

__all__ = ["CacheTracker", "watch_encoder", "config_int"]

#: transformers' names for the cache, in its models' arguments and outputs (``cache`` from version 5).
CACHE_NAMES = ("past_key_values", "cache")
_MAX_DEPTH = 6
_MAX_NODES = 5_000  # a walk stops here: a cache of a thousand layers has a few thousand objects


class CacheTracker:
    """Finds the cache among what a root forward is given and gives back, and counts it as ``kv_cache``.

    Only calls under ``no_grad`` (inference) are looked at: a training forward that returns a cache never
    gets it back. A call is a *decode* when tensors an earlier call made come back into it (then that
    earlier call, if it was not labelled yet, was the *prefill*), or when the cache object of a generation
    already under way is handed in; a call handed an empty cache object (transformers' ``generate()``
    hands the first call one to fill) is a prefill. Anything else is an ordinary forward, so an evaluation
    loop whose outputs carry a cache nobody hands back stays a forward.
    """

    def __init__(self, model: nn.Module, ledger: "Ledger", run: "Run", storages: "StorageTracker",
                 phases: "PhaseTracker") -> None:
        self.ledger = ledger
        self.run = run
        self.storages = storages
        self.phases = phases
        self.names: set[str] = set(CACHE_NAMES)  # where caches were seen: argument and output names
        #: What the cache formula needs, gathered as the calls run.
        self.formula = CacheFacts(getattr(model, "config", None))
        # The running call: the ledger's event count and the cache's tokens when it began, and the tokens
        # when the call before it began (what a sliding-window layer holds depends on that call).
        self.call_seq = 0
        self.call_before = 0
        self.call_earlier = 0
        self.in_cache = 0  # tokens in the cache now
        self.incoming = 0  # tokens handed to the call running now
        self.call_tokens: dict[int, int] = {}  # phase serial of an ordinary no-grad call -> its tokens
        # The cache object (not a tensor) the running root call was handed, filled as its layers run.
        self.active: object = None
        self.kind: "Phase | None" = None  # what the running root call is: PREFILL, DECODE or None
        self.prefill_serials: set[int] = set()  # earlier calls found to have been prefills
        self.encoder_first = False  # the running call is a prefill that began with the encoder's forward
        self._last: "Release | None" = None  # the cache object of the last prefill or decode call
        self.last_tokens = (0, 0, 0)  # that call's (earlier, before, after) tokens
        self.let_go: "int | None" = None  # the ledger's event count when that cache object was let go
        phases.on_close.append(self.phase_closed)

    def before_call(self, args: "Args", kwargs: "Kwargs") -> "Phase | None":
        """What this root call is (``Phase.PREFILL``, ``Phase.DECODE`` or ``None``); claims the cache handed in."""
        self.active, self.kind, self.prefill_serials, self.encoder_first = None, None, set(), False
        if torch.is_grad_enabled():
            return None
        self.incoming, batch = _new_tokens(args, kwargs)
        handed: object = None
        for name, obj in _arguments(args, kwargs):
            if name in self.names and obj is not None and not isinstance(obj, (torch.Tensor, tuple, list, dict)):
                handed = obj
        self.active = handed
        # The cache object of the generation under way, handed in again: a decode call even when every
        # tensor in it was replaced outside the model (a cache grown directly).
        again = handed is not None and self.in_cache > 0 and self._last is not None and self._last() is handed
        # An empty cache object is filled by a prefill, also when what comes back with it was made earlier
        # (an encoder-decoder's encoder output, handed to every decoder call).
        fresh = handed is not None and not again and not any(
            t.is_floating_point() and t.numel() for t in _tensors(handed))
        # The decoder's first call continues the prefill its encoder began (phases.begin_encoder): the
        # encoder's output is the first thing that prefill put in the cache, from the op that made it.
        self.encoder_first = fresh and self.phases.encoder_open
        inside: set[int] = set()  # phase serials of earlier calls that made what comes back
        back = False
        for name, obj in _arguments(args, kwargs):
            # An encoder-decoder's encoder output is counted with the cache (CacheSpec.encoder_hidden) also when the
            # loop made it outside the model: generate()'s copy per beam (repeat_interleave) is.
            encoder = name == "encoder_outputs"
            claimed, made_in = self._claim(obj, named=encoder or name in self.names,
                                           retro=encoder and self.encoder_first)
            if claimed:
                self.names.add(name)
            if made_in is not None:
                back = True
                inside |= made_in
        previous = self.call_before
        if (back and not fresh) or again:
            self.kind = Phase.DECODE
            if self.in_cache == 0:  # the call that made it was a prefill nobody could name then
                self.prefill_serials = {s for s in inside if s in self.call_tokens}
                self.in_cache = sum(self.call_tokens[s] for s in self.prefill_serials)
                previous = 0
        elif handed is not None:
            self.kind = Phase.PREFILL
            self.in_cache = 0
            previous = 0
        if self.kind is not None:
            self.formula.batch = batch if batch is not None else self.formula.batch
            # Where the call began: for a prefill the encoder began, where the encoder began.
            start = self.phases.encoder_seq if self.encoder_first else self.ledger.seq
            self.call_seq, self.call_earlier, self.call_before = start, previous, self.in_cache
            self.formula.note_shapes(handed, kwargs)
        return self.kind

    def layer_done(self, args: "Args", kwargs: "Kwargs") -> None:
        """A module handed the running call's cache object returned: what it added there is the cache from
        now on, not at the end of the whole call (the prefill's peak is reached with half the layers filled)."""
        active = self.active
        if active is None:
            return
        if any(v is active for v in kwargs.values()) or any(a is active for a in args):
            self._claim(active, named=True, retro=True)

    def after_call(self, args: "Args", kwargs: "Kwargs", output: object) -> None:
        """The model's root call returned. Claim what a prefill or decode call added to the cache it was given
        (filled in place) or returned: under a cache's name, or, from a decode call, any container in its output
        (a tuple of key and value tensors; the logits are a plain tensor). Then the call's prefill or decode
        phase ends (:meth:`call_phase_ends`)."""
        phases = self.phases
        kind, handed, self.active = self.kind, self.active, None
        if kind is None:
            if not torch.is_grad_enabled():  # an ordinary call: a prefill if what it made comes back
                self.call_tokens[self.ledger.phase_serial] = self.incoming
                while len(self.call_tokens) > 64:  # only the latest calls can still turn out to be prefills
                    del self.call_tokens[next(iter(self.call_tokens))]
            if self.run.phase is Phase.PREFILL or self.run.phase is Phase.DECODE:
                self.call_phase_ends()
            return
        kept: list[object] = []  # what holds the cache now, for where the call had got at its peak
        for name, obj in _arguments(args, kwargs):
            if not isinstance(obj, torch.Tensor):
                if self._claim(obj, named=name in self.names, retro=True)[0]:
                    kept.append(obj)
        for name in self.names:
            obj = _field(output, name)
            if obj is not None:
                self._claim(obj, named=True, retro=True)
                kept.append(obj)
        if kind is Phase.DECODE and isinstance(output, (tuple, list)):
            for item in output:
                if not isinstance(item, torch.Tensor):
                    self._claim(item, named=True, retro=True)
                    kept.append(item)
        self.in_cache += self.incoming
        key = (self.run.step, kind.value, phases.occurrence.get(kind, 0))
        self.formula.tokens[key] = self.in_cache
        if self.encoder_first:
            self.formula.encoder_prefills.append((key[0], key[2]))
            self.encoder_first = False
        self._note_moments(key, kept)
        self._last, self.let_go = None, None
        self.last_tokens = (self.call_earlier, self.call_before, self.in_cache)
        if handed is not None:
            try:  # a weak reference: memprof keeps nothing of the user's alive
                self._last = self.ledger.watch(handed, (), then=self._let_go)
            except TypeError as failure:
                if is_interrupt(failure):
                    raise  # a signal handler's exception (errors.is_interrupt) is the user's
                self._last = None
        if self.run.phase is Phase.PREFILL or self.run.phase is Phase.DECODE:
            self.call_phase_ends()

    def call_phase_ends(self) -> None:
        """A prefill or decode call ended: a merged decode phase ends where its last call does; otherwise the
        phase ends with the call, its end the cache as the call left it, and what the decoding loop does until
        the next call (sampling, the growing ids) is "other"."""
        phases = self.phases
        if phases.merging():
            phases.mark_end()
        else:
            phases.begin(Phase.OTHER)

    def _let_go(self, ref: "Release") -> None:
        # Run when the ledger settles the queue, in order among the frees (not as a finaliser).
        if ref is self._last:  # the cache object of the last call was let go (generate() returned): when
            self.let_go = self.ledger.seq

    def phase_closed(self, step: int, phase: Phase, occurrence: int) -> None:
        """A phase between or after the calls ended: whether the last call's cache object was still held at its
        peak and its end (``written`` 1, else 0: ``generate()`` lets go of it as it returns; a loop of the
        user's may keep it), for the formula there. Caches that are not objects (tuples) say nothing."""
        if phase is not Phase.OTHER or self._last is None:
            return
        let_go, peak_seq = self.let_go, self.ledger.phase_peak_seq
        for moment, held in (("peak", let_go is None or let_go > peak_seq), ("end", self._last() is not None)):
            self.formula.moments[(step, phase.value, occurrence, moment)] = CacheMoment(
                step, phase.value, occurrence, moment, *self.last_tokens, written=int(held))

    def relabel_prefills(self) -> None:
        """The earlier calls that made what this decode call got back were prefills: their (closed) phases
        are relabelled so, with the tokens they put in the cache."""
        phases = self.phases
        for serial in sorted(self.prefill_serials):
            key = relabel_closed(phases, serial, Phase.PREFILL)
            if key is not None:
                self.formula.tokens[key] = self.call_tokens.get(serial, 0)
        self.prefill_serials = set()

    def add_tokens(self, n: int) -> None:
        """``n`` tokens joined the cache outside the model's forward (a simulation growing it directly)."""
        self.in_cache += n

    def _note_moments(self, key: tuple[int, str, int], kept: list[object]) -> None:
        """The cache at the end of the call that just ended, and at the phase's peak if the call reached it:
        how many of the storages the call put in the cache existed then (exact mode sees them being made)."""
        led = self.ledger
        tokens = (self.call_earlier, self.call_before, self.in_cache)
        self.formula.moments[key + ("end",)] = CacheMoment(*key, "end", *tokens)
        peak = key + ("peak",)
        if peak in self.formula.moments and led.phase_peak_seq <= self.call_seq:
            return  # a folded decode phase whose peak an earlier call reached
        written, overlap = None, False
        if self.run.mode == EXACT:
            made: dict[int, int] = {}
            for obj in kept:
                for t in _tensors(obj):
                    entry = self.storages.entry_of(t) if t.is_floating_point() else None
                    if entry is not None and entry.cat == KV_CACHE and entry.phase_serial == led.phase_serial \
                            and self.call_seq < entry.created <= led.phase_peak_seq:
                        made[entry.key] = entry.created
            written, overlap = len(made), led.phase_peak_seq in made.values()
        self.formula.moments[peak] = CacheMoment(*key, "peak", *tokens, written=written, overlap=overlap)

    def _claim(self, obj: object, *, named: bool, retro: bool = False) -> "tuple[bool, set[int] | None]":
        """Count the floating tensors under ``obj`` as the cache: those made inside the model (or already the
        cache), and with ``named`` any tensor there. Returns whether any was claimed, and the phase serials of
        the calls that made those that come back (``None`` when none does). With ``retro`` (claims as a call
        runs or ends) what the running call made counts as the cache since it was made, at the phase's peak
        too: transformers' caches keep a layer's new keys from the op that makes them (``torch.cat``), and the
        peak can fall inside the layer, before memprof sees them there."""
        storages = self.storages
        led = self.ledger
        claimed = False
        made_in: "set[int] | None" = None
        for t in _tensors(obj):
            if not t.is_floating_point():  # positions, lengths, counters: bookkeeping, not keys and values
                continue
            entry = storages.entry_of(t)
            if entry is None:
                if named:  # made where memprof did not see it (light mode, before the profile): the name says
                    entry = storages.add_tensor(t, KV_CACHE)
                    if entry is not None:
                        claimed = True
                        self.formula.itemsizes.add(t.element_size())
                continue
            if entry.cat == KV_CACHE:
                claimed = True
                made_in = made_in if made_in is not None else set()
            elif entry.cat == TEMPORARIES and (entry.module >= 0 or named):
                # Made inside the model (or handed over under a cache's name), kept past the call.
                if entry.module >= 0:
                    made_in = (made_in if made_in is not None else set()) | {entry.phase_serial}
                move(led, entry, KV_CACHE, retro=retro)
                claimed = True
                self.formula.itemsizes.add(t.element_size())
        return claimed, made_in


def watch_encoder(model: nn.Module, run: "Run", phases: "PhaseTracker", stack: "UndoStack") -> None:
    """Begin a prefill where an encoder-decoder model's encoder is called under no_grad outside the model's own
    calls, as ``generate()`` calls it (``_prepare_encoder_decoder_kwargs_for_generation``: ``self.get_encoder()``
    once, before the decoder's first call in ``_prefill``). The model says it is one by its config's
    ``is_encoder_decoder`` and names its encoder by ``get_encoder()`` (transformers' interface): any seq2seq
    model, not a list of classes. The hook runs after memprof's own module hook (a schedule resumes there, and
    the encoder's frame is then open), and goes on ``stack``, removed with the rest."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) is not True:
        return
    try:
        encoder = model.get_encoder()  # type: ignore[operator]  # a transformers model's; nn.Module's type lacks it
    # A model whose lookup fails has no encoder memprof can name: its phases stay as they were.
    except Exception as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return
    if not isinstance(encoder, nn.Module) or encoder is model or not any(m is encoder for m in model.modules()):
        return

    def began(_module: nn.Module, _args: object, _kwargs: object) -> None:
        # Compiled code is measured from outside (as memprof's module hooks do); only the outermost call counts,
        # which memprof's hook has just put on the call stack.
        if is_dynamo_compiling() or not run.active or len(run.calls) != 1 or torch.is_grad_enabled() \
                or threading.get_ident() != run.thread:
            return
        begin_encoder(phases)

    stack.callback(encoder.register_forward_pre_hook(hook_object(began), with_kwargs=True).remove)


def _arguments(args: "Args", kwargs: "Kwargs") -> Iterator[tuple[str, object]]:
    for i, a in enumerate(args):
        yield f"#{i}", a
    yield from kwargs.items()


def _tensors(obj: object) -> Iterator[torch.Tensor]:
    """The tensors reachable from ``obj`` through sequences, mappings and plain objects' attributes."""
    seen: set[int] = set()
    stack = [(obj, 0)]
    nodes = 0
    while stack and nodes < _MAX_NODES:
        o, depth = stack.pop()
        nodes += 1
        if isinstance(o, torch.Tensor):
            if id(o) not in seen:
                seen.add(id(o))
                yield o
            continue
        if depth >= _MAX_DEPTH or o is None or isinstance(o, (str, bytes, int, float, bool, nn.Module, type)):
            continue
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, dict):
            children = list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            children = list(o)
        else:
            attrs = getattr(o, "__dict__", None)
            if not isinstance(attrs, dict):
                continue
            children = list(attrs.values())
        stack.extend((c, depth + 1) for c in reversed(children))


def _new_tokens(args: "Args", kwargs: "Kwargs") -> "tuple[int, int | None]":
    """Tokens (and batch) handed to a call: its ``input_ids`` or ``inputs_embeds`` (an encoder-decoder's
    ``decoder_`` ones first: the cache holds the decoder's tokens), else the second dimension of its first
    tensor argument of two or more (batch, tokens, ...)."""
    t = next((kwargs[k] for k in ("decoder_input_ids", "input_ids", "decoder_inputs_embeds", "inputs_embeds")
              if isinstance(kwargs.get(k), torch.Tensor)), None)
    if not isinstance(t, torch.Tensor):
        t = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() >= 2), None)
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        return 0, None
    return int(t.shape[1]), int(t.shape[0])
