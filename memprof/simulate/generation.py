"""Simulating a generation: prefill and decoding on shape-only tensors, with the KV cache as its own category.

``memprof.estimate_generation(model, batch_size=8, prompt_len=4096, max_new_tokens=512)`` runs what a
greedy ``model.generate()`` runs on a prompt without padding: one prefill forward over the prompt
(``use_cache=True``, position ids, an empty cache to fill, the logits of the last position only where the
model takes ``logits_to_keep``), then one forward per new token handed the cache back. The last new token
is never fed back, so a generation of ``max_new_tokens`` tokens runs ``max_new_tokens - 1`` decode calls
and ends with ``prompt_len + max_new_tokens - 1`` tokens in the cache.

Decode calls differ only in the length of the cache they read and grow, and memory grows with it, so
a long generation need not run each of them: after the first few, the cache is grown directly to the
length before the last call (transformers' ``Cache.update`` with empty keys and values, outside the
model's forward) and the last call runs on it. Its peak is the generation's largest decode peak, and
the cache at its end is the cache at the end of generation; the notes say which calls ran.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from torch import nn

from ..errors import InvalidArgumentError, MemprofError
from ..anatomy.params import infer_precision
from .estimate import Estimate, _simulation_error, _Target

__all__ = ["estimate_generation"]

#: Decode calls run one by one up to this many; longer generations jump (see the module's docstring).
_RUN_ALL = 16


def estimate_generation(
    model: nn.Module,
    *,
    batch_size: int,
    prompt_len: int,
    max_new_tokens: int,
    precision: "str | None" = None,
    device: "str | torch.device | None" = None,
    attention: str = "auto",
    gpu: Any = None,
    alloc_conf: Any = None,
) -> Estimate:
    """Simulate generating ``max_new_tokens`` tokens after a ``prompt_len``-token prompt for ``batch_size``
    sequences, and return an :class:`~memprof.Estimate` whose trace has a prefill phase, decode phases and
    the KV cache as ``kv_cache``.

    ``model`` is a model with a generation interface (a transformers model with ``generate()``), built on
    any device (a configuration built under ``torch.device("meta")`` costs no memory). ``precision``,
    ``device`` and ``attention`` are :func:`memprof.estimate`'s: ``"bf16"`` casts the parameters,
    ``"mixed"`` runs under autocast, ``device="cuda"`` rounds to CUDA's 512-byte blocks and picks CUDA's
    attention kernels. ``gpu`` and ``alloc_conf`` are :func:`memprof.estimate`'s: the device-level peak, the
    fit and the headroom on that GPU.
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"estimate_generation() needs a torch.nn.Module, got {type(model).__name__}")
    from ..units import as_count

    batch_size, prompt_len, max_new_tokens = (as_count(name, value, minimum=1) for name, value in (
        ("batch_size", batch_size), ("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens)))
    if not callable(getattr(model, "generate", None)) or not callable(
            getattr(model, "prepare_inputs_for_generation", None)):
        raise InvalidArgumentError(
            f"{type(model).__name__} has no generation interface (generate() and prepare_inputs_for_generation(), "
            "as transformers' generative models have); estimate a training step of it with memprof.estimate")
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise InvalidArgumentError(
            f"{type(model).__name__} is an encoder-decoder model; estimate_generation simulates decoder-only "
            "generation (profile a real generate() of it to measure its caches)")
    limit = _positions(getattr(model, "config", None))
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise InvalidArgumentError(
            f"prompt_len + max_new_tokens = {prompt_len + max_new_tokens} tokens, but {type(model).__name__} has "
            f"positions for {limit} (its config's max_position_embeddings); shorten the prompt or the generation")

    from .device_memory import check_target, on_device

    gpu_spec, device = check_target(gpu, device, alloc_conf)
    setup = _Target(model, precision, device, attention)
    twin = setup.model
    twin.eval()
    notes = setup.notes
    from ..collect.profiler import Profiler

    prof = Profiler(twin, None, mode="exact", timeline=False, _allow_meta=True, _fake_mode=setup.fake_mode,
                    _rounding=512 if setup.target.type == "cuda" else 1)
    if setup.target.type == "cuda":
        prof.ledger.record_stream()  # for the allocator replay
    decodes = max_new_tokens - 1
    jump = decodes > _RUN_ALL
    device_of = torch.device("meta") if setup.fake_mode is None else torch.device("cpu")
    loop = _Loop(twin, batch_size, device_of, autocast=setup.autocast, emulated=setup.emulated)
    with (setup.fake_mode if setup.fake_mode is not None else contextlib.nullcontext()):
        loop.prompt(prompt_len)
    with contextlib.ExitStack() as stack:
        if setup.fake_mode is not None:
            stack.enter_context(setup.fake_mode)
        stack.enter_context(prof)
        stack.enter_context(setup.rules())
        stack.enter_context(torch.no_grad())
        try:
            loop.call(prompt_len)  # prefill
            ran = decodes if not jump else 2
            for _ in range(ran):
                loop.call(1)
            if jump:
                grown = decodes - ran - 1
                loop.grow(grown)
                prof.collectors.kv.add_tokens(grown)
                loop.call(1)  # the last decode call, on the cache it would find
        except MemprofError:
            raise
        except (RuntimeError, NotImplementedError) as exc:
            raise _simulation_error(exc, 0) from exc
    if jump:
        notes.append(f"decode calls 3 to {decodes - 1} of {decodes} were not run one by one: the cache was grown "
                     f"to their length directly, and the last call ran on it (each decode call is the same "
                     f"computation on a cache one token longer)")
    notes.extend(setup.rule_notes())
    resolved = precision or infer_precision(prof.trace)
    est = Estimate(trace=prof.trace, precision=resolved, device=setup.target.type, notes=tuple(notes))
    if setup.target.type == "cuda":
        est = on_device(est, prof.ledger, gpu=gpu_spec, alloc_conf=alloc_conf, model=model)
    return est


class _Loop:
    """The calls of a greedy generate(): ids, a growing attention mask, the cache handed back."""

    def __init__(self, model: nn.Module, batch: int, device: torch.device, *, autocast: Any = None,
                 emulated: Any = None) -> None:
        self.model, self.batch, self.device = model, batch, device
        self.autocast, self.emulated = autocast, emulated
        params = inspect.signature(model.forward).parameters
        self.keep_last = "logits_to_keep" in params
        # transformers 5 calls it "cache", earlier versions "past_key_values".
        self.cache_name = "cache" if "cache" in params else "past_key_values"
        self.positions = "position_ids" in params
        # generate() hands the prefill an empty cache to fill, as transformers' generate does.
        self.cache: Any = _empty_cache(model)
        self.mask: "torch.Tensor | None" = None
        self.position: "torch.Tensor | None" = None
        # What generate() keeps between calls: every token so far, the last logits in fp32, the sequences
        # still running (transformers/generation/utils.py, the greedy loop).
        self.ids: "torch.Tensor | None" = None
        self.logits: "torch.Tensor | None" = None
        self.unfinished: "torch.Tensor | None" = None

    def prompt(self, tokens: int) -> None:
        """The prompt, made before the profile as a user's input ids are, and held as the user's variable holds it."""
        self.prompt_ids = self.ids = torch.zeros((self.batch, tokens), dtype=torch.long, device=self.device)

    def call(self, tokens: int) -> None:
        assert self.ids is not None
        if self.unfinished is None:
            self.unfinished = torch.ones(self.batch, dtype=torch.long, device=self.device)
        ids = self.ids[:, -tokens:].clone(memory_format=torch.contiguous_format)
        ones = torch.ones((self.batch, tokens), dtype=torch.long, device=self.device)
        self.mask = ones if self.mask is None else torch.cat([self.mask, ones], dim=-1)
        # No attention mask: generate() hands none to a model when the prompt has no padding (a mask of ones).
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True, "return_dict": True}
        if self.positions:
            # As generate() makes them: from the mask's running count at the prefill, then one past the last.
            if self.position is None:
                self.position = self.mask.long().cumsum(-1) - 1
            else:
                self.position = self.position[:, -1:] + tokens
            kwargs["position_ids"] = self.position
        if self.cache is not None:
            kwargs[self.cache_name] = self.cache
        if self.keep_last:
            kwargs["logits_to_keep"] = 1
        emulated = self.emulated
        if emulated is not None:
            emulated.begin_forward()
        try:
            with (self.autocast() if self.autocast is not None else contextlib.nullcontext()):
                out = self.model(**kwargs)
        finally:
            if emulated is not None:
                emulated.end_forward()
        cache = getattr(out, "past_key_values", None)
        if cache is None and isinstance(out, dict):
            cache = out.get("past_key_values")
        if cache is None:
            raise InvalidArgumentError(
                f"{type(self.model).__name__} returned no past_key_values with use_cache=True: it keeps no KV cache "
                "to simulate")
        self.cache = cache
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor):
            # generate(): the last position's logits copied to fp32 (kept until the next call's are), the next
            # token, the ids one longer, the stopping check; then the output is dropped.
            self.logits = None
            self.logits = logits[:, -1].to(copy=True, dtype=torch.float32)
            next_tokens = torch.argmax(self.logits, dim=-1)
            self.ids = torch.cat([self.ids, next_tokens[:, None]], dim=-1)
            done = torch.full((self.batch,), False, dtype=torch.bool, device=self.device)
            self.unfinished = self.unfinished & ~done
            del next_tokens, done
        del out, logits

    def grow(self, tokens: int) -> None:
        """Append ``tokens`` empty positions to every layer of the cache (transformers' Cache.update)."""
        if tokens <= 0:
            return
        layers = getattr(self.cache, "layers", None)
        update = getattr(self.cache, "update", None)
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
        ones = torch.ones((self.batch, tokens), dtype=torch.long, device=self.device)
        assert self.mask is not None and (self.position is not None or not self.positions)
        self.mask = torch.cat([self.mask, ones], dim=-1)
        assert self.ids is not None
        self.ids = torch.cat([self.ids, torch.zeros_like(ones)], dim=-1)  # the tokens generate() would have
        if self.position is not None:
            self.position = self.position[:, -1:] + tokens


def _positions(config: Any) -> "int | None":
    from ..collect.kv_cache import config_int

    limit = config_int(config, "max_position_embeddings", "n_positions", "max_sequence_length")
    return limit if limit is not None and limit > 0 else None


def _empty_cache(model: nn.Module) -> Any:
    """transformers' DynamicCache for ``model``, empty; None for other models (their first call makes one)."""
    import sys

    module = sys.modules.get("transformers")
    cls = getattr(module, "DynamicCache", None) if type(model).__module__.startswith("transformers.") else None
    if cls is None:
        return None
    try:
        return cls(config=model.config)
    except TypeError:  # versions whose DynamicCache takes no config
        return cls()
