"""A model from its configuration: a Hugging Face ``config.json`` built on the meta device, with token batches.

:func:`load_config` reads a ``config.json`` (a folder holding one, the file itself, or a hub id transformers
resolves from its cache or online), :func:`build_model` builds the class its ``architectures`` names under
``torch.device("meta")`` (no memory, however large), and :func:`token_batch` makes the inputs and labels a
training step of that kind of model takes. :func:`estimate_hf` ties them to :func:`memprof.estimate`.
"""

from __future__ import annotations

import json
import os
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Literal, Union

from ..record.estimate import Estimate
from ..errors import (ConfigNotFoundError, InvalidArgumentError, MemprofError, MissingExtraError, SimulationError,
                      UnknownNameError, is_interrupt)
from .loops import transformers_version_note
from .hf_limits import (check_counts_in_file, check_sequence, check_sizes, default_precision, dtype_note,
                        quantization_note, size_culprit)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from .aliases import HfConfig, HfModule, Option, UserValue
    from .run import OptimizerArg

__all__ = ["HfModel", "load_config", "build_model", "token_batch", "estimate_hf", "estimate_hf_generation",
           "check_counts", "KINDS"]

#: What memprof knows how to feed, by the suffix of the class name in ``architectures``.
KINDS = {"ForCausalLM": "causal-lm", "ForConditionalGeneration": "seq2seq", "ForSeq2SeqLM": "seq2seq",
         "ForSequenceClassification": "sequence-classification"}

#: What a config is given as: a transformers config already, a folder holding a ``config.json``, that file, or a
#: hub id (:func:`load_config`).
ConfigSource = Union["HfConfig", str, "os.PathLike[str]"]


def _transformers() -> types.ModuleType:
    try:
        import transformers
    except ImportError as exc:
        if is_interrupt(exc):
            raise
        raise MissingExtraError("building a model from its config needs transformers; pip install "
                                "'torch-memprof[transformers]'") from None
    return transformers


def load_config(source: ConfigSource) -> "HfConfig":
    """A ``PretrainedConfig`` from ``source``: a config already, a folder with a ``config.json``, that file,
    or a hub id (read from transformers' cache, or downloaded when the network allows)."""
    transformers = _transformers()
    if isinstance(source, transformers.PretrainedConfig):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise InvalidArgumentError(f"give a transformers config, a folder holding config.json, the file or a hub id; "
                                   f"got {type(source).__name__}")
    path = os.fspath(source)
    _read_bounded(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        path = os.path.join(path, "config.json")  # a file on this machine: its errors are the file's, not the hub's
    if os.path.isfile(path):
        try:
            return transformers.AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)) if
                                                           os.path.basename(path) == "config.json" else path)
        except (OSError, ValueError) as exc:
            if is_interrupt(exc):
                raise
            _check_file(path)
            raise ConfigNotFoundError(f"cannot read {path} as a transformers config ({_first(exc)}); give a "
                                      "config.json written by config.save_pretrained()") from None
        except Exception as exc:  # transformers' own validation of the values
            if is_interrupt(exc):
                raise
            _check_file(path)
            raise InvalidArgumentError(f"transformers refuses the config in {path} ({_last(exc)}); fix it") from None
    if not os.path.exists(path) and _looks_local(path):
        raise ConfigNotFoundError(f"no such file or folder: {path}; give a folder holding config.json, the file, or "
                                  "a hub id")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigNotFoundError(f"no config.json in {path}; give the folder a model was saved to "
                                  "(save_pretrained) or the path of its config.json")
    try:
        return transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        if is_interrupt(exc):
            raise
        _check_file(path)
        raise ConfigNotFoundError(f"no config found for {path!r} ({_first(exc)}); give a folder holding config.json, "
                                  "the file, or a hub id already in the local cache (huggingface-cli download "
                                  f"{path} config.json)") from None
    except Exception as exc:  # transformers' own validation of the values (huggingface_hub's strict dataclasses)
        if is_interrupt(exc):
            raise
        _check_file(path)
        raise InvalidArgumentError(f"transformers refuses the config in {path} ({_last(exc)}); fix config.json") \
            from None


def _looks_local(path: str) -> bool:
    """Is ``path``, which does not exist, meant as a file or folder here rather than a hub id? A hub id is
    ``name`` or ``owner/name``; a path that starts at the root or a dot, has more parts, or whose first part is a
    folder here (``configs/llama`` beside a ``configs`` folder) is a local one mistyped, not worth transformers'
    retries of the hub (about 25 s without a network)."""
    parts = path.replace(os.sep, "/").split("/")
    return (os.path.isabs(path) or path.startswith(".") or len(parts) > 2
            or (len(parts) == 2 and os.path.isdir(parts[0])))


def _check_file(path: str) -> None:
    """Where transformers refused a config file, the size in it that caused it, named
    (:func:`memprof.simulate.hf_limits.check_sizes` on the file's own keys): its own message may be a bare
    ``integer division or modulo by zero``."""
    import json
    import types

    from ..record.files import read_bytes

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:  # memprof's one reader: bounded, a regular file only
        raw = json.loads(read_bytes(file, what="a transformers config", fix="fix config.json",
                                    error=InvalidArgumentError))
    except (MemprofError, OSError, ValueError) as exc:
        if is_interrupt(exc):
            raise
        return
    if isinstance(raw, dict) and all(isinstance(k, str) and k.isidentifier() for k in raw):
        check_sizes(types.SimpleNamespace(**raw))


def _read_bounded(path: str) -> None:
    """Read a config on this machine (``path``, or the ``config.json`` in the folder ``path``) through memprof's
    one reader first: a named pipe or a link to ``/dev/zero``, which transformers would read until it blocks or
    fills memory, and a file above the size memprof reads, are refused naming the file; so is a count of layers or
    experts above what memprof builds (:data:`memprof.simulate.hf_limits.MOST`), before transformers' config
    class loops over it (Qwen2's lists a type per layer: 2**31 layers never finish). A hub id is left alone."""
    from ..record.files import read_bytes

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if os.path.exists(file):
        data = read_bytes(file, what="a transformers config",
                          fix="give a config.json written by config.save_pretrained()", error=InvalidArgumentError)
        try:
            raw = json.loads(data)
        except ValueError as exc:  # not JSON: transformers' own error names it
            if is_interrupt(exc):
                raise
            return
        check_counts_in_file(raw)


def _last(exc: BaseException) -> str:
    """The innermost line of a validation error's message (huggingface_hub nests the cause under a header)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass(frozen=True)
class HfModel:
    """A model built from a config on the meta device: the module, its kind (one of :data:`KINDS`' values),
    its class name and the notes on what was assumed in building it."""

    model: "HfModule"
    kind: str
    architecture: str
    notes: tuple[str, ...] = ()


def build_model(config: ConfigSource, *, checkpointing: bool = False) -> HfModel:
    """The class ``config.architectures`` names, built on the meta device in fp32 (``precision`` casts it later),
    in training mode; with ``checkpointing`` transformers' activation checkpointing enabled on every layer
    (non-reentrant, transformers' default)."""
    import torch

    import copy

    transformers = _transformers()
    config = copy.deepcopy(load_config(config))  # building sets its dtype (and a classifier's pad id): a copy's
    notes: list[str] = []
    names = list(getattr(config, "architectures", None) or [])
    if not names:
        name, what = _default_architecture(config, transformers)
        notes.append(f"the config names no architectures: built {name}, the {what} of its model_type")
        names = [name]
    name = names[0]
    kind = _kind_of(name, transformers)
    cls = getattr(transformers, name, None)
    if kind is None or cls is None:
        known = ", ".join(f"*{s}" for s in KINDS)
        why = "is not a class of this transformers" if cls is None else "is not a kind memprof can feed"
        raise UnknownNameError(f"architecture {name!r} {why} ({transformers.__version__}); memprof builds {known}: "
                               f"set \"architectures\" in config.json to one of them, or build the model yourself "
                               "and call memprof.estimate")
    check_sizes(config)  # a zero or negative size stops deep inside transformers or torch, or builds nonsense
    quantized = quantization_note(config)
    if quantized:
        notes.append(quantized)
    if kind == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0
        notes.append("the config has no pad_token_id: 0 was used (a sequence classifier needs one for batches)")
    pad, vocab = getattr(config, "pad_token_id", None), getattr(config, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and not 0 <= pad < vocab:
        # transformers' embedding would stop on torch's bare "Padding_idx must be within num_embeddings".
        raise InvalidArgumentError(f"the config's pad_token_id {pad} (from config.json, or {config.model_type}'s "
                                   f"default where it sets none) is not below its vocab_size {vocab}: set "
                                   f"pad_token_id in config.json to an id below {vocab}, or to null")
    try:
        with torch.device("meta"):
            model = cls._from_config(config, dtype=torch.float32)
    except Exception as exc:  # transformers' or torch's own stop on the config's values: named, not a traceback
        if is_interrupt(exc):
            raise
        culprit = size_culprit(config, str(exc)) if isinstance(exc, (RuntimeError, ArithmeticError)) else None
        hint = f" (the config's size behind it: {culprit})" if culprit else ""
        raise InvalidArgumentError(f"transformers could not build {name} from this config ({type(exc).__name__}: "
                                   f"{_first(exc)}){hint}; fix config.json, or build the model yourself and call "
                                   "memprof.estimate") from exc
    model.train()
    if checkpointing:
        enable_checkpointing(model)
    return HfModel(model, kind, name, tuple(notes))


def _kind_of(name: str, transformers: types.ModuleType) -> "str | None":
    """What memprof feeds the class ``name``: the kind of transformers' auto mapping that lists it (so that
    ``GPT2LMHeadModel`` is a causal LM, and so is Gemma-3's ``ForConditionalGeneration``), else by the suffix of
    its name (:data:`KINDS`)."""
    auto = getattr(getattr(transformers, "models", None), "auto", None)
    mappings = getattr(auto, "modeling_auto", None)
    for table, kind in (("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal-lm"),
                        ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq"),
                        ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "sequence-classification")):
        for value in (getattr(mappings, table, None) or {}).values():
            if name == value or (isinstance(value, (tuple, list)) and name in value):
                return kind
    return next((k for suffix, k in KINDS.items() if name.endswith(suffix)), None)


def enable_checkpointing(model: "HfModule") -> None:
    """Transformers' activation checkpointing on ``model`` (non-reentrant), through the method this version
    has (``activation_checkpointing_enable`` replaced ``gradient_checkpointing_enable``)."""
    kwargs = {"use_reentrant": False}
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise InvalidArgumentError(f"{type(model).__name__} does not support activation checkpointing in "
                                   "transformers; plan without it")
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _default_architecture(config: "PretrainedConfig", transformers: types.ModuleType) -> tuple[str, str]:
    """The class to build for a config that names none, and what it is in words: the model_type's
    sequence-to-sequence LM for an encoder-decoder config (``is_encoder_decoder``: Pegasus, mBART, T5, whose
    decoder alone is also a causal LM of transformers' but half the model trained), else its causal LM."""
    auto = transformers.models.auto.modeling_auto
    seq2seq = "sequence-to-sequence LM (an encoder-decoder config)"
    tables = [(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "causal LM"),
              (auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, seq2seq)]
    if getattr(config, "is_encoder_decoder", False):
        tables.reverse()
    model_type = getattr(config, "model_type", "")
    for mapping, what in tables:
        name = mapping.get(model_type)
        if name:
            return str(name), what
    raise UnknownNameError(f"the config names no architectures and model_type {model_type!r} has no causal or "
                           "sequence-to-sequence LM in transformers; set \"architectures\" in config.json to the "
                           "class to build")


def token_batch(built: HfModel, batch_size: int, seq_len: int) -> "dict[str, torch.Tensor]":
    """Token ids and labels of a training batch for ``built`` on the meta device: ``input_ids`` and ``labels``
    (the same ids: a causal LM shifts them itself) for a causal LM; also ``decoder_input_ids`` of ``seq_len``
    for a seq2seq model; one class label per sequence for a classifier. A ``seq_len`` beyond what the model takes
    (:func:`memprof.simulate.hf_limits.sequence_limit`) is refused."""
    import torch

    check_counts(batch_size=batch_size, seq_len=seq_len)
    check_sequence(built.model.config, seq_len)
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    if built.kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": torch.zeros_like(ids), "labels": torch.zeros_like(ids)}
    if built.kind == "sequence-classification":
        return {"input_ids": ids, "labels": torch.zeros(batch_size, dtype=torch.long, device="meta")}
    return {"input_ids": ids, "labels": ids}


def check_counts(**counts: object) -> None:
    """Each of ``counts`` (``seq_len=16``) is a positive int, or one error naming it."""
    for what, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{what} must be a positive int, got {value!r}")


def hf_loss(output: "UserValue") -> "torch.Tensor":
    """The loss transformers computes from the labels (``output.loss``)."""
    loss: torch.Tensor = output.loss
    return loss


def precision_of(config: "PretrainedConfig", precision: "str | None") -> str:
    """``precision``, or by default the config's dtype (bf16, fp16; fp32 otherwise: the dtype the model is built
    in, which :func:`memprof.simulate.hf_limits.dtype_note` says in words)."""
    return precision if precision is not None else default_precision(config)


def adamw(params: "Iterable[torch.Tensor]") -> "torch.optim.Optimizer":
    """torch's AdamW with its defaults (foreach on CUDA), the optimizer a plan assumes unless told."""
    import torch

    return torch.optim.AdamW(params)


def estimate_hf(config: ConfigSource, *, seq_len: int, batch_size: int, optimizer: "OptimizerArg" = adamw,
                precision: "str | None" = None, checkpointing: bool = False, device: str = "cuda",
                loop: "str | None" = "hf-trainer", **options: "Option") -> Estimate:
    """:func:`memprof.estimate` of a training step of the model ``config`` describes (see
    :func:`~memprof.simulate.hf.load_config`), built on the meta device: ``batch_size`` sequences of ``seq_len``
    tokens, the loss transformers computes from the labels, AdamW unless ``optimizer`` (a factory of parameters, or
    None) says otherwise. ``loop`` is the training loop simulated (:mod:`memprof.simulate.loops`): by default the HF
    Trainer's step of the installed transformers; ``"plain"`` is memprof's own loop (forward, the model's loss,
    backward, step, ``zero_grad()``); a ``train_step`` given replaces it.
    ``precision`` defaults to the config's dtype; ``checkpointing`` enables transformers' activation
    checkpointing. Every other option (``attention``, ``world_size``, ``parallel``, ``gpu``, ``alloc_conf``,
    ``routing``, ``train_step``: your step, handed the batch dict with its labels as ``inputs``) is
    :func:`memprof.estimate`'s."""
    from .estimate import estimate

    config = load_config(config)
    check_counts(batch_size=batch_size, seq_len=seq_len)
    check_sequence(config, seq_len)  # before building: an 8B model's meta build is not free
    resolved = precision_of(config, precision)
    built = build_model(config, checkpointing=checkpointing)
    batch = token_batch(built, batch_size, seq_len)
    with _named(built):
        # A train_step, or a named loop, computes its own loss from the batch (labels inside): it takes the batch
        # dict as inputs; memprof's own loop takes transformers' loss from the output.
        if options.get("train_step") is not None:
            loop = None
        loss_fn = hf_loss if loop in (None, "plain") and options.get("train_step") is None else None
        est = estimate(built.model, optimizer, inputs=batch, loss_fn=loss_fn, precision=resolved, device=device,
                       loop=loop, **options)
    said = [f"{built.architecture} built from its config on the meta device ({built.kind}; batch {batch_size} x "
            f"{seq_len} tokens{', activation checkpointing on every layer' if checkpointing else ''})"]
    said.extend(loop_versions(loop) if options.get("train_step") is None else [])
    said.extend(transformers_version_note(config))
    return _noted(est, said, config, precision, built)


def estimate_hf_generation(config: ConfigSource, *, batch_size: int, prompt_len: int, max_new_tokens: int,
                           precision: "str | None" = None, device: str = "cuda",
                           names: "tuple[str, str]" = ("prompt_len", "max_new_tokens"),
                           **options: "Option") -> Estimate:
    """:func:`memprof.estimate_generation` of the model ``config`` describes, built on the meta device in eval
    mode: ``batch_size`` prompts of ``prompt_len`` tokens, then ``max_new_tokens`` generated. ``precision``
    defaults to the config's dtype; every other option is :func:`memprof.estimate_generation`'s. A causal LM's
    prompt and new tokens together, a seq2seq model's prompt (the encoder's) and its new tokens (the decoder's)
    each, must fit the positions the config declares; ``names`` are the words its refusal gives the two counts (the
    command line's flags)."""
    from .generation import estimate_generation

    config = load_config(config)
    check_counts(batch_size=batch_size, prompt_len=prompt_len, max_new_tokens=max_new_tokens)
    built = build_model(config)
    if built.kind == "sequence-classification":
        raise InvalidArgumentError(f"{built.architecture} is a sequence classifier, which generates nothing; give "
                                   "the config of a causal LM or a seq2seq model, or simulate a training step")
    prompt, new = names
    if built.kind == "causal-lm":
        check_sequence(config, prompt_len + max_new_tokens, f"{prompt} + {new}")
    else:  # the encoder takes the prompt, the decoder its start token and the new tokens
        check_sequence(config, prompt_len, prompt)
        check_sequence(config, max_new_tokens + 1, f"{new} + 1 (the decoder's start token)")
    resolved = precision_of(config, precision)
    built.model.eval()
    with _named(built):
        est = estimate_generation(built.model, batch_size=batch_size, prompt_len=prompt_len,
                                  max_new_tokens=max_new_tokens, precision=resolved, device=device, **options)
    said = [f"{built.architecture} built from its config on the meta device ({built.kind}, eval mode; batch "
            f"{batch_size}, prompt {prompt_len} tokens, {max_new_tokens} new)"]
    said.extend(transformers_version_note(config))
    return _noted(est, said, config, precision, built)


def loop_versions(loop: "str | None") -> "list[str]":
    """The loop and the versions of transformers and torch simulated, in words (a named loop's note in the estimate
    says more)."""
    import torch

    from .loops import check_loop

    name = {None: "memprof's own (loop='plain')", "plain": "memprof's own (loop='plain')",
            "hf-trainer": "the HF Trainer's step (loop='hf-trainer')"}.get(check_loop(loop), f"loop={loop!r}")
    return [f"the training loop: {name}, simulated on transformers {_transformers().__version__} and torch "
            f"{torch.__version__}"]


def _noted(est: Estimate, said: "list[str]", config: "PretrainedConfig", precision: "str | None",
           built: HfModel) -> Estimate:
    """``est`` with what building it from the config assumed ahead of its own notes."""
    import dataclasses

    if precision is None:
        said.append(dtype_note(config))
    return dataclasses.replace(est, notes=tuple(said) + built.notes + est.notes)


class _named:
    """A context in which an exception other than memprof's, raised inside the code of the model a config built
    while it is simulated, becomes one :class:`SimulationError` naming the class and the config (the model's code
    is transformers', run on the config's values: what it refuses is the config). An exception of the caller's
    own functions (an optimizer factory, a parallelize function) passes as it is."""

    def __init__(self, built: HfModel) -> None:
        self.built = built

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: "type[BaseException] | None", exc: "BaseException | None",
                 tb: "types.TracebackType | None") -> Literal[False]:
        if exc is None or isinstance(exc, MemprofError) or not isinstance(exc, Exception) or not _in_model(tb):
            return False
        raise SimulationError(f"{self.built.architecture}, built from this config, raised {type(exc).__name__} in "
                              f"its simulated step: {_first(exc)}; the config's values do not make a model that "
                              "runs: fix config.json") from exc


def _in_model(tb: "types.TracebackType | None") -> bool:
    """Whether a traceback passes through the code of a transformers model (``transformers/models/``)."""
    while tb is not None:
        if f"{os.sep}transformers{os.sep}models{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False
