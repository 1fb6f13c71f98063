"""Simulating a generation: prefill and decoding on shape-only tensors, with the KV cache as its own category.

``memprof.estimate_generation(model, batch_size=8, prompt_len=4096, max_new_tokens=512)`` runs what
``model.generate()`` runs on a prompt without padding (:mod:`memprof.simulate.decoding`): for an encoder-decoder
model the encoder once; one prefill forward over the prompt (the decoder's start token for an encoder-decoder
model), then one forward per new token handed the cache back, each followed by the choice of the next tokens
as greedy search, sampling or beam search makes it (:mod:`memprof.simulate.choosing`). The last new token
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
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn
from typing_extensions import Unpack

from ..anatomy.params import infer_precision
from ..errors import InvalidArgumentError, MemprofError, is_interrupt
from .choosing import Beams, Greedy, Sampling
from .decoding import Decoding, decoder_start
from .estimate import Estimate
from .failures import simulation_error as _simulation_error
from .frozen_heap import frozen
from .kept_caches import caches_left_real
from .run import Generation, GenerationOptions, RunConfig
from .stages import NothingLeftBehind
from .twin import Twin as _Target

if TYPE_CHECKING:
    from ..anatomy.gpus import GpuSpec
    from ..collect.simulated import SimulatedProfile

__all__ = ["estimate_generation", "simulate_generation"]

#: Decode calls run one by one up to this many; longer generations jump (see the module's docstring).
_RUN_ALL = 16


def estimate_generation(model: nn.Module, **options: Unpack[GenerationOptions]) -> Estimate:
    """Simulate generating ``max_new_tokens`` tokens after a ``prompt_len``-token prompt for ``batch_size``
    sequences, and return an :class:`~memprof.Estimate` whose trace has a prefill phase, decode phases and
    the KV cache as ``kv_cache``.

    ``model`` is a model with a generation interface (a transformers model with ``generate()``), built on
    any device (a configuration built under ``torch.device("meta")`` costs no memory). For an
    encoder-decoder model (T5, BART, Whisper) ``prompt_len`` is the encoder's input: tokens, or for a speech
    encoder its fixed window of mel frames; the encoder runs once and the decoder from its start token, with
    self- and cross-attention caches. ``precision``, ``device`` and ``attention`` are :func:`memprof.estimate`'s:
    ``"bf16"`` casts the parameters, ``"mixed"`` runs under autocast, ``device="cuda"`` rounds to CUDA's
    512-byte blocks and picks CUDA's attention kernels. ``routing`` is :func:`memprof.estimate`'s: what a
    mixture-of-experts model's routers choose (``"balanced"`` by default). ``num_beams``, ``do_sample``,
    ``temperature``, ``top_k`` and ``top_p`` are ``generate()``'s, with its defaults: beam search keeps
    ``batch_size x num_beams`` sequences and copies the cache into the surviving beams' order after every
    step; sampling runs transformers' logits warpers. Every sequence runs to ``max_new_tokens``. ``gpu`` and
    ``alloc_conf`` are :func:`memprof.estimate`'s: the device-level peak, the fit and the headroom on that GPU.
    """
    return simulate_generation(RunConfig.for_generation(model, **options))


def simulate_generation(config: "RunConfig[Generation]") -> Estimate:
    """The estimate of the generation ``config`` describes (its workload a :class:`~memprof.simulate.run.
    Generation`): the twin, the prompt, the profiled prefill and decode calls, the device replay (the heap there
    before kept out of the garbage collector's full passes: :mod:`memprof.simulate.frozen_heap`)."""
    with caches_left_real(config.workload.model), frozen(), NothingLeftBehind():
        prepared = _prepared(config)
        prof = _decoded(prepared)
        return _generation_estimate(config, prepared, prof)


@dataclass
class _Prepared:
    """The generation's first stage: the twin, the decoding loop on it (its prompt made), the device and notes."""

    twin: _Target
    loop: Decoding
    gpu: "GpuSpec | None"
    decodes: int
    encoder_decoder: bool
    notes: list[str]


def _prepared(config: "RunConfig[Generation]") -> _Prepared:
    from .device_memory import check_target

    g, t = config.workload, config.target
    model = g.model
    if not callable(getattr(model, "generate", None)) or not callable(
            getattr(model, "prepare_inputs_for_generation", None)):
        raise InvalidArgumentError(
            f"{type(model).__name__} has no generation interface (generate() and prepare_inputs_for_generation(), "
            "as transformers' generative models have); estimate a training step of it with memprof.estimate")
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    _check_positions(model, g.prompt_len, g.max_new_tokens, encoder_decoder)
    chooser = choosing(model, num_beams=g.num_beams, do_sample=g.do_sample, temperature=g.temperature, top_k=g.top_k,
                       top_p=g.top_p, max_length=(1 if encoder_decoder else g.prompt_len) + g.max_new_tokens)
    gpu, device = check_target(t.gpu, t.device, t.alloc_conf)
    setup = _Target(model, config.precision, device, t.attention, g.routing, gpu=gpu)
    setup.model.eval()
    device_of = torch.device("meta") if setup.fake_mode is None else torch.device("cpu")
    loop = Decoding(setup.model, g.batch_size, device_of, chooser=chooser, autocast=setup.autocast,
                    emulated=setup.emulated)
    with (setup.fake_mode if setup.fake_mode is not None else contextlib.nullcontext()):
        loop.prompt(g.prompt_len)
    return _Prepared(setup, loop, gpu, g.max_new_tokens - 1, encoder_decoder, setup.notes)


def _decoded(prepared: _Prepared) -> "SimulatedProfile":
    """The prefill and the decode calls under the collector (the calls past :data:`_RUN_ALL` on a cache grown to
    their length)."""
    from ..collect.simulated import SimulatedProfile

    setup, loop, decodes = prepared.twin, prepared.loop, prepared.decodes
    cuda = setup.target.type == "cuda"  # the allocator's 512-byte blocks, and the stream for its replay
    prof = SimulatedProfile(setup.model, None, fake_mode=setup.fake_mode, rounding=512 if cuda else 1,
                            keep_stream=cuda)
    setup.moe.attach(prof)
    jump = decodes > _RUN_ALL
    where = "prefill"
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(setup.beneath())
            stack.enter_context(prof)
            stack.enter_context(setup.rules())
            stack.enter_context(torch.no_grad())
            loop.prefill()
            ran = decodes if not jump else 2
            for i in range(ran):
                where = f"decode call {i + 1}"
                loop.call(1)
            if jump:
                grown = decodes - ran - 1
                where = f"decode call {decodes} (on a cache grown to its length)"
                loop.grow(grown)
                prof.add_tokens(grown)
                loop.call(1)  # the last decode call, on the cache it would find
                prepared.notes.append(
                    f"decode calls 3 to {decodes - 1} of {decodes} were not run one by one: the cache was grown to "
                    "their length directly, and the last call ran on it (each decode call is the same computation on "
                    "a cache one token longer)")
    except MemprofError:
        raise
    except (RuntimeError, NotImplementedError) as exc:
        if is_interrupt(exc):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        raise _simulation_error(exc, f"generation ({where})") from exc
    except BaseException:
        if prof.running:  # an interrupt between the profile's entry and the registration of its exit
            prof.__exit__(*sys.exc_info())
        raise
    return prof


def _generation_estimate(config: "RunConfig[Generation]", prepared: _Prepared,
                         prof: "SimulatedProfile") -> Estimate:
    from .device_memory import on_device

    g, setup, notes = config.workload, prepared.twin, prepared.notes
    notes.extend(_generation_notes(g.model, prepared.loop, prepared.encoder_decoder))
    notes.extend(setup.rule_notes())
    resolved = config.precision or infer_precision(prof.trace)
    est = Estimate(trace=prof.trace, precision=resolved, device=setup.target.type, notes=tuple(notes))
    if setup.target.type == "cuda":
        est = on_device(est, prof.recorded_stream(), gpu=prepared.gpu, alloc_conf=config.target.alloc_conf,
                        model=g.model)
    return est


#: The loop's former name, kept for callers that run the simulation's calls on real tensors.
_Loop = Decoding


def choosing(model: nn.Module, *, num_beams: int = 1, do_sample: bool = False, temperature: float = 1.0,
             top_k: "int | None" = 50, top_p: float = 1.0, max_length: int = 0) -> "Greedy | Beams":
    """The chooser of next tokens ``generate()`` would run with these arguments (:mod:`.choosing`; the
    arguments as :class:`~memprof.simulate.run.Generation` checks them)."""
    sample = (float(temperature), top_k, float(top_p)) if do_sample else None
    if num_beams > 1:
        return Beams(num_beams, max_length, _eos_ids(model), sample,
                     length_penalty=_generation_value(model, "length_penalty", 1.0),
                     early_stopping=_generation_value(model, "early_stopping", False))
    return Sampling(*sample) if sample is not None else Greedy()


_T = TypeVar("_T")


def _generation_value(model: nn.Module, name: str, default: _T) -> _T:
    """The model's generation config's ``name`` (of ``default``'s type, as transformers' ``GenerationConfig``
    declares it), or ``default`` where it gives none."""
    value = getattr(getattr(model, "generation_config", None), name, None)
    return default if value is None else value


def _eos_ids(model: nn.Module) -> list[int]:
    """The end-of-sequence ids generate() stops on (its generation config's, else its config's)."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int) and not isinstance(eos, bool):
            return [eos]
        if isinstance(eos, (list, tuple)) and eos:
            return [int(e) for e in eos]
    return []


def _generation_notes(model: nn.Module, loop: Decoding, encoder_decoder: bool) -> list[str]:
    out = []
    chooser = loop.chooser
    if encoder_decoder:
        out.append(f"encoder-decoder: the encoder ran once over the prompt, the decoder from its start token "
                   f"(token {decoder_start(model)}) with self-attention and cross-attention caches; the encoder's "
                   "output, handed to every decoder call, is counted with the cache")
    if isinstance(chooser, Beams):
        out.append(f"beam search: {chooser.num_beams} beams per sequence ({loop.rows} sequences in every forward), "
                   f"continuations kept per step {chooser.keep}; after every step the cache was copied into the "
                   "surviving beams' order (reorder_cache: every layer's keys and values), as transformers does; "
                   "between steps the reordered copy is among temporaries until the next call takes it")
    if isinstance(chooser, (Sampling, Beams)) and (chooser.processors if isinstance(chooser, Beams) else True):
        names = [type(p).__name__ for p in chooser.processors]
        out.append("sampling: " + (", ".join(names) if names else "no logits warper") + " then softmax and "
                   "multinomial, as generate(do_sample=True) runs them; other logits processors a generation config "
                   "can add (repetition penalty, forced tokens ...) were not run")
    asked = _configured_processors(model)
    if asked:
        out.append(f"the model's generation config sets {', '.join(asked)}: generate() runs a logits processor for "
                   "each, which the simulation does not; each can keep another fp32 row of scores (batch x vocabulary "
                   "x 4 B) beside the logits between decode calls, not counted here")
    out.append(_cache_note(model))
    out.append("every sequence ran to max_new_tokens: no end-of-sequence token was taken to stop one early, which "
               "is the longest generation and the largest cache")
    return out


#: Generation-config fields for which generate() adds a logits processor, and the value that adds none.
_PROCESSOR_FIELDS = (("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0), ("encoder_no_repeat_ngram_size", 0),
                     ("bad_words_ids", None), ("min_length", 0), ("min_new_tokens", None),
                     ("forced_bos_token_id", None), ("forced_eos_token_id", None), ("suppress_tokens", None),
                     ("begin_suppress_tokens", None), ("sequence_bias", None),
                     ("exponential_decay_length_penalty", None))


def _configured_processors(model: nn.Module) -> list[str]:
    """The fields of ``model``'s generation config that make generate() run a logits processor (a real greedy
    generate() with min_new_tokens peaked 22 % above the simulation, a reviewer found), as ``name=value``."""
    config = getattr(model, "generation_config", None)
    found = []
    for name, none in _PROCESSOR_FIELDS:
        value = getattr(config, name, none)
        if value is not None and value != none and value != [] and value != {}:
            found.append(f"{name}={value!r}")
    return found


def _cache_note(model: nn.Module) -> str:
    """The cache the generation assumed, in words: the layers' kinds and what each keeps, and where from."""
    from collections import Counter

    from ..anatomy.cache_config import cache_spec

    spec = cache_spec(getattr(model, "config", None))
    if spec is None:
        return ("cache assumed: the one the model built on shape-only tensors; memprof cannot size this config's "
                "cache (a layer kind or state-space family it does not know), so its kv_cache has no formula")
    kinds = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in Counter(spec.layers).items())
    window = f", a window of {spec.sliding_window} tokens" if spec.sliding_window is not None else ""
    return (f"cache assumed: transformers' dynamic cache as generate() builds it from the config ({kinds} "
            f"layer(s){window}): {spec.kept}; formula memprof.anatomy.caches, after {spec.source}")


def _check_positions(model: nn.Module, prompt_len: int, max_new_tokens: int, encoder_decoder: bool) -> None:
    config = getattr(model, "config", None)
    if not encoder_decoder:
        limit = _positions(config)
        if limit is not None and prompt_len + max_new_tokens > limit:
            raise InvalidArgumentError(
                f"prompt_len + max_new_tokens = {prompt_len + max_new_tokens} tokens, but {type(model).__name__} has "
                f"positions for {limit} (its config's max_position_embeddings); shorten the prompt or the generation")
        return
    from ..collect.kv_cache import config_int

    decoder = config_int(config, "max_target_positions", "max_decoder_position_embeddings")
    if decoder is None and getattr(model, "main_input_name", "input_ids") == "input_ids":
        decoder = _positions(config)  # one table for both sides (BART)
        if decoder is not None and prompt_len > decoder:
            raise InvalidArgumentError(f"prompt_len = {prompt_len} encoder tokens, but {type(model).__name__} has "
                                       f"positions for {decoder}; shorten the prompt")
    if decoder is not None and max_new_tokens + 1 > decoder:
        raise InvalidArgumentError(
            f"max_new_tokens + the start token = {max_new_tokens + 1} decoder tokens, but {type(model).__name__}'s "
            f"decoder has positions for {decoder}; shorten the generation")


def _positions(config: object) -> "int | None":
    from ..collect.kv_cache import config_int

    limit = config_int(config, "max_position_embeddings", "n_positions", "max_sequence_length")
    return limit if limit is not None and limit > 0 else None
