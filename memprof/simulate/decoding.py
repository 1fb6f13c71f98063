"""The calls of a transformers ``generate()``, as a simulated generation makes them.

:class:`Decoding` runs what ``generate()`` runs on a prompt without padding, for decoder-only and
encoder-decoder models: for an encoder-decoder model the encoder's forward once (``generate()`` runs it before
the first decoder call) and a decoder started from its start token; the inputs expanded to batch x beams for
beam search; one prefill forward (``use_cache=True``, position ids, an empty cache to fill: transformers'
``DynamicCache``, inside an ``EncoderDecoderCache`` with a second one for cross-attention; the logits of the
last position only where the model takes ``logits_to_keep``), then one forward per new token handed the cache
back. After each forward a chooser (:mod:`memprof.simulate.choosing`) picks the next tokens as greedy search,
sampling or beam search does. The same class runs on real tensors in the tests, so a simulation is checked
against a real run of the very same calls.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from ..errors import InvalidArgumentError, is_interrupt
from .choosing import Greedy

if TYPE_CHECKING:
    from .aliases import HfCache, HfConfig, UserValue
    from .autocast import AutocastFactory, CudaAutocast
    from .choosing import Beams

__all__ = ["Decoding", "empty_cache", "encoder_inputs"]


class Decoding:
    """The calls of a ``generate()`` of ``batch`` sequences on ``device``; ``chooser`` picks the tokens
    (:class:`~memprof.simulate.choosing.Greedy` by default). ``autocast``: a factory of the autocast context
    each forward runs in; ``emulated``: the CUDA autocast rule whose forward window each forward opens."""

    def __init__(self, model: nn.Module, batch: int, device: torch.device, *, chooser: "Greedy | Beams | None" = None,
                 autocast: "AutocastFactory | None" = None, emulated: "CudaAutocast | None" = None) -> None:
        self.model, self.batch, self.device = model, batch, device
        self.autocast, self.emulated = autocast, emulated
        self.chooser: "Greedy | Beams" = chooser if chooser is not None else Greedy()
        self.beams = getattr(self.chooser, "num_beams", 1)
        self.rows = batch * self.beams  # the sequences each forward runs
        self.encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
        params = inspect.signature(model.forward).parameters
        self.keep_last = "logits_to_keep" in params
        # transformers 5 calls it "cache", earlier versions "past_key_values".
        self.cache_name = "cache" if "cache" in params else "past_key_values"
        self.positions = "position_ids" in params and not self.encoder_decoder
        # generate() hands the prefill an empty cache to fill.
        self.cache: HfCache = empty_cache(model)
        self.mask: "torch.Tensor | None" = None
        self.position: "torch.Tensor | None" = None
        # What generate() keeps between calls: every token so far, the last logits in fp32, the sequences still
        # running; for an encoder-decoder model the encoder's output, handed to every decoder call.
        self.ids: "torch.Tensor | None" = None
        self.logits: "torch.Tensor | None" = None
        self.next_tokens: "torch.Tensor | None" = None
        self.unfinished: "torch.Tensor | None" = None
        self.source: "dict[str, torch.Tensor] | None" = None
        self.encoder_outputs: UserValue = None  # the encoder's output, as the model returns it
        self.started = False

    def prompt(self, tokens: int) -> None:
        """The prompt (an encoder-decoder model's encoder input), made before the profile as a user's inputs are,
        and held as the user's variable holds it."""
        if self.encoder_decoder:
            self.source = encoder_inputs(self.model, self.batch, tokens, self.device)
        else:
            self.prompt_ids = self.ids = torch.zeros((self.batch, tokens), dtype=torch.long, device=self.device)

    def prefill(self) -> None:
        """generate()'s preparation and its first forward (the prompt, or the decoder's start token)."""
        self._start()
        assert self.ids is not None
        self.call(self.ids.shape[1])

    def _start(self) -> None:
        if self.started:
            return
        self.started = True
        if self.encoder_decoder:
            assert self.source is not None
            with self._forward():
                # (get_encoder is a transformers model's; nn.Module's type lacks it)
                self.encoder_outputs = self.model.get_encoder()(**self.source, return_dict=True)  # type: ignore[operator]
            self.ids = torch.full((self.batch, 1), decoder_start(self.model), dtype=torch.long, device=self.device)
        if self.beams > 1:  # _expand_inputs_for_generation: every input repeated per beam
            assert self.ids is not None
            self.ids = self.ids.repeat_interleave(self.beams, dim=0)
            if self.encoder_outputs is not None:
                hidden = self.encoder_outputs["last_hidden_state"]
                self.encoder_outputs["last_hidden_state"] = hidden.repeat_interleave(self.beams, dim=0)
                del hidden
        self.chooser.start(self)

    @contextlib.contextmanager
    def _forward(self) -> Iterator[None]:
        if self.emulated is not None:
            self.emulated.begin_forward()
        try:
            with (self.autocast() if self.autocast is not None else contextlib.nullcontext()):
                yield
        finally:
            if self.emulated is not None:
                self.emulated.end_forward()

    def call(self, tokens: int) -> None:
        """One forward over the last ``tokens`` tokens, then the chooser's step."""
        self._start()
        source = self.chooser.inputs(self) if hasattr(self.chooser, "inputs") else self.ids
        assert source is not None
        ids = source[:, -tokens:].clone(memory_format=torch.contiguous_format)
        del source
        kwargs: dict[str, object] = {"use_cache": True, "return_dict": True}
        if self.encoder_decoder:
            kwargs.update(decoder_input_ids=ids, encoder_outputs=self.encoder_outputs)
        else:
            # No attention mask: generate() hands none to a model when the prompt has no padding (a mask of ones).
            kwargs["input_ids"] = ids
            ones = torch.ones((self.rows, tokens), dtype=torch.long, device=self.device)
            self.mask = ones if self.mask is None else torch.cat([self.mask, ones], dim=-1)
            if self.positions:
                # As generate() makes them: from the mask's running count at the prefill, then one past the last.
                if self.position is None:
                    self.position = self.mask.long().cumsum(-1) - 1
                else:
                    self.position = self.position[:, -1:] + tokens
                kwargs["position_ids"] = self.position
            del ones
        if self.cache is not None:
            kwargs[self.cache_name] = self.cache
        if self.keep_last:
            kwargs["logits_to_keep"] = 1
        with self._forward():
            out = self.model(**kwargs)
        cache = getattr(out, "past_key_values", None)
        if cache is None and isinstance(out, dict):
            cache = out.get("past_key_values")
        if cache is None:
            raise InvalidArgumentError(
                f"{type(self.model).__name__} returned no past_key_values with use_cache=True: it keeps no KV cache "
                "to simulate")
        self.cache = cache
        del cache
        if isinstance(getattr(out, "logits", None), torch.Tensor):
            box = [out]
            del out
            self.chooser.choose(self, box)

    def grow(self, tokens: int) -> None:
        """Append ``tokens`` empty positions to every self-attention layer of the cache (transformers'
        ``Cache.update``), as ``tokens`` decode calls would have."""
        if tokens <= 0:
            return
        inner = getattr(self.cache, "self_attention_cache", self.cache)  # an EncoderDecoderCache's decoder side
        layers = getattr(inner, "layers", None)
        update = getattr(inner, "update", None)
        if not layers or not callable(update):
            raise InvalidArgumentError(
                f"the model's cache ({type(self.cache).__name__}) has no transformers Cache interface (layers, "
                "update()) to grow it by; use max_new_tokens <= 17")
        for i, layer in enumerate(layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                continue
            k = keys.new_empty((*keys.shape[:-2], tokens, keys.shape[-1]))
            v = values.new_empty((*values.shape[:-2], tokens, values.shape[-1]))
            update(k, v, i)
            del k, v
        if not self.encoder_decoder:
            ones = torch.ones((self.rows, tokens), dtype=torch.long, device=self.device)
            assert self.mask is not None
            self.mask = torch.cat([self.mask, ones], dim=-1)
            if self.position is not None:
                self.position = self.position[:, -1:] + tokens
            del ones
        if isinstance(self.chooser, Greedy):
            assert self.ids is not None  # the tokens generate() would have
            self.ids = torch.cat([self.ids, self.ids.new_zeros((self.rows, tokens))], dim=-1)
        self.chooser.grow(self, tokens)


def decoder_start(model: nn.Module) -> int:
    """The token an encoder-decoder model's decoder starts from (its generation config's, else its config's)."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        start = getattr(source, "decoder_start_token_id", None)
        if isinstance(start, int) and not isinstance(start, bool):
            return start
    return 0


def encoder_inputs(model: nn.Module, batch: int, tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
    """An encoder-decoder model's encoder input for ``batch`` sequences of ``tokens``: token ids, or for a speech
    encoder (``input_features``) mel features, whose length is the encoder's fixed window."""
    name = getattr(model, "main_input_name", "input_ids")
    config: HfConfig = model.config  # a transformers model's, of its own class
    if name == "input_ids":
        return {"input_ids": torch.zeros((batch, tokens), dtype=torch.long, device=device)}
    if name == "input_features":
        window = 2 * int(getattr(config, "max_source_positions", 0))
        if tokens != window:
            raise InvalidArgumentError(
                f"{type(model).__name__} encodes a fixed window of {window} mel frames (2 x max_source_positions); "
                f"give prompt_len={window}")
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        return {"input_features": torch.zeros((batch, int(config.num_mel_bins), window), dtype=dtype,
                                              device=device)}
    raise InvalidArgumentError(
        f"{type(model).__name__}'s encoder takes {name!r}; estimate_generation simulates encoders of token ids and "
        "of mel features (input_features)")


def empty_cache(model: nn.Module) -> HfCache:
    """transformers' empty cache for ``model`` as generate() makes it (an EncoderDecoderCache of two
    DynamicCaches for an encoder-decoder model); None for other models (their first call makes one)."""
    import sys

    module = sys.modules.get("transformers")
    cls = getattr(module, "DynamicCache", None) if type(model).__module__.startswith("transformers.") else None
    if cls is None:
        return None
    config: HfConfig = model.config  # a transformers model's, of its own class
    text = getattr(config, "get_text_config", None)
    if callable(text):
        try:
            config = text(decoder=True)
        except TypeError as failure:  # versions whose get_text_config takes no decoder argument
            if is_interrupt(failure):
                raise  # a signal handler's exception (errors.is_interrupt) is the user's
            config = text()
    try:
        make: Callable[[], HfCache] = lambda: cls(config=config)  # noqa: E731
        make()
    except TypeError as failure:  # versions whose DynamicCache takes no config
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        make = cls
    if getattr(model.config, "is_encoder_decoder", False):
        pair = getattr(module, "EncoderDecoderCache", None)
        if pair is None:
            return None
        return pair(make(), make())
    return make()
