"""Pipeline stages of a transformers decoder model, cut where the model's own pipeline plan says it can be cut.

A transformers model describes its pipeline cut in its pipeline plan (``model.pp_plan``: the causal-LM class's
``_pp_plan``, ``{"lm_head": (["hidden_states"], ["logits"])}``, with the config's ``base_model_pp_plan`` under the
base model's prefix, ``{"embed_tokens": (["input_ids"], ["inputs_embeds"]), "layers": (["hidden_states",
"attention_mask"], ["hidden_states"]), "norm": (["hidden_states"], ["hidden_states"])}``:
``transformers/distributed/mixin.py``, ``init_parallel_plans``). :func:`split` cuts it as torchtitan cuts a Llama
(``torchtitan/distributed/pipeline_parallel.py``): the decoder layers evenly over the stages, the first stage
with the embedding, the last with the final norm and the head.

A stage runs the model's own code: it is a shallow copy of the base model (and, on the last stage, of the causal
LM around it) holding only its stage's modules, called as the whole model is called. Stage 0 hands it the token
ids; the others hand it the previous stage's hidden states as ``inputs_embeds``, so the base model's forward
computes what it computes for the whole model before its first layer: the position ids of an unpadded batch
(``arange(seq)``), the causal mask with no padding mask (``create_causal_mask``, or a sliding window's), the
rotary ``position_embeddings`` from the model's rotary module. Its config is a copy whose ``num_hidden_layers``
and ``layer_types`` are the stage's (the forward runs ``self.layers[: config.num_hidden_layers]`` and picks each
layer's mask by ``config.layer_types[i]``). A stage other than the last has no final norm (an identity in its
place) and returns the hidden states; the last returns the causal LM's logits, through whatever the causal LM
applies after its head (a final logit soft-cap). The loss is the model's own (``model.loss_function``) on those
logits and the labels, as the whole model computes it from ``labels=``.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Callable, TypedDict, TypeVar

import torch
from torch import nn

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import PretrainedConfig

    from ..record.estimate import Estimate
    from .aliases import HfModule, Option
    from .run import OptimizerArg

__all__ = ["pp_support", "split", "HfStage", "causal_lm_loss", "stage_layers", "pp_degrees", "pp_fsdp",
           "PipelineSimulation", "StageSearch", "DEGREES", "MICROBATCHES_PER_STAGE"]

#: The pipeline degrees a plan tries (those that divide the world size and the decoder layers).
DEGREES = (2, 4)

#: Micro-batches per step, per pipeline stage: a plan's pipeline runs 2 x pp of them, enough for 1F1B's steady
#: state (the first stage holds pp micro-batches in flight: Narayanan et al. 2021, §2.2) with as many after it.
MICROBATCHES_PER_STAGE = 2

#: What the plan names, by module: the base model's embedding, layers and norm, and the causal LM's head.
_BASE = {"embed_tokens": ["input_ids"], "layers": ["hidden_states"], "norm": ["hidden_states"]}

_M = TypeVar("_M", bound=nn.Module)


def pp_support(model: "HfModule") -> "tuple[bool, str]":
    """Whether :func:`split` can cut ``model``, and why not: a transformers causal LM whose pipeline plan names the
    base model's ``embed_tokens``, ``layers`` (a ModuleList) and ``norm`` and the head ``lm_head`` returning
    logits, as the decoder models of transformers do."""
    name = type(model).__name__
    plan = getattr(model, "pp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return False, f"{name} has no pipeline plan in transformers (model.pp_plan is empty)"
    base = getattr(model, "base_model", None)
    prefix = getattr(model, "base_model_prefix", "")
    if base is None or base is model or not prefix or getattr(model, prefix, None) is not base:
        return False, f"{name} is not a causal LM around a base model, which memprof's pipeline cut follows"
    head = plan.get("lm_head")
    if not isinstance(getattr(model, "lm_head", None), nn.Module) or not head or list(head[1]) != ["logits"]:
        return False, f"the pipeline plan of {name} names no lm_head returning logits ({', '.join(plan)})"
    for part, inputs in _BASE.items():
        entry = plan.get(f"{prefix}.{part}")
        if not entry or list(entry[0])[:1] != inputs:
            return False, (f"the pipeline plan of {name} does not name {prefix}.{part} taking {inputs[0]} "
                           f"({', '.join(plan)}), which memprof's pipeline cut follows")
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) < 1:
        return False, f"{name}'s {prefix}.layers is not a list of decoder layers"
    if not isinstance(getattr(base, "norm", None), nn.Module) or not isinstance(getattr(base, "embed_tokens", None),
                                                                               nn.Module):
        return False, f"{name}'s {prefix} has no embed_tokens and norm modules"
    return True, ""


def stage_layers(num_layers: int, k: int, n: int) -> range:
    """The decoder layers stage ``k`` of ``n`` holds: torchtitan's even cut (``num_layers`` must divide)."""
    if n < 1 or not 0 <= k < n:
        raise InvalidArgumentError(f"stage {k} of {n} does not exist; stages are numbered 0 to n - 1")
    if num_layers % n:
        raise InvalidArgumentError(f"{num_layers} decoder layers do not divide into {n} pipeline stages evenly; use a "
                                   "number of stages that divides them")
    per = num_layers // n
    return range(per * k, per * (k + 1))


def _shallow(module: _M) -> _M:
    """A copy of ``module`` sharing its submodules, parameters and buffers, with containers of its own (its
    children, parameters, buffers, hooks and the set of non-persistent buffers), so that replacing a child or
    adding a hook leaves ``module`` as it was."""
    out = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):
            out.__dict__[key] = copy.copy(value)
    return out


def _stage_config(config: "PretrainedConfig", layers: range) -> "PretrainedConfig":
    """The config the stage's base model reads in its forward: the stage's layer count and layer types."""
    out = copy.deepcopy(config)
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == config.num_hidden_layers:
        out.layer_types = list(types)[layers.start:layers.stop]
    out.num_hidden_layers = len(layers)
    return out


class HfStage(nn.Module):
    """Stage ``index`` of ``stages`` of a transformers causal LM (see the module's docstring): ``body`` is the base
    model (the causal LM on the last stage) holding the stage's modules; called with the token ids (stage 0) or
    the previous stage's hidden states, it returns its hidden states, or on the last stage the logits."""

    #: The model's TP plan in the stage's module names (:func:`_stage_tp_plan`), set by :func:`split`.
    tp_plan: "dict[str, str]"

    def __init__(self, body: nn.Module, index: int, stages: int) -> None:
        super().__init__()
        self.body, self.index, self.stages = body, index, stages

    @property
    def layers(self) -> nn.ModuleList:
        """The stage's decoder layers."""
        # A transformers model's base_model and layers are its own class's attributes, not nn.Module's.
        body: HfModule = self.body
        layers: nn.ModuleList = (body.base_model if self.index == self.stages - 1 else body).layers
        return layers

    def forward(self, x: "torch.Tensor") -> "torch.Tensor":
        feed = {"input_ids": x} if self.index == 0 else {"inputs_embeds": x}
        out = self.body(**feed, use_cache=False)
        handed: torch.Tensor = out.logits if self.index == self.stages - 1 else out.last_hidden_state
        return handed

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.stages}"


def split(model: "HfModule", k: int, n: int) -> "HfStage":
    """Stage ``k`` of ``n`` of the transformers causal LM ``model`` (``Pipeline(split=split)``): the first with the
    embedding, every stage its share of the decoder layers, the last with the final norm and the head, returning
    the logits. The stage shares ``model``'s modules; ``model`` itself is left as it was."""
    ok, why = pp_support(model)
    if not ok:
        raise InvalidArgumentError(f"{why}; plan it without pipeline layouts")
    base = model.base_model
    layers = stage_layers(len(base.layers), k, n)
    stage_base = _shallow(base)
    stage_base.config = _stage_config(base.config, layers)
    stage_base.layers = nn.ModuleList(base.layers[i] for i in layers)
    if k > 0:
        stage_base.embed_tokens = None  # the stage is handed the hidden states (inputs_embeds)
        if isinstance(getattr(stage_base, "embedding_multiplier", None), (int, float)):
            # Granite's base forward scales whatever inputs_embeds it is given (modeling_granite.py): the first
            # stage scaled the embeddings already. (x * 1.0 is x, exactly.)
            stage_base.embedding_multiplier = 1.0
    if k < n - 1:
        stage_base.norm = nn.Identity()  # the final norm is the last stage's
        stage = HfStage(stage_base, k, n)
    else:
        body = _shallow(model)
        setattr(body, model.base_model_prefix, stage_base)
        stage = HfStage(body, k, n)
    stage.tp_plan = _stage_tp_plan(model, k == n - 1)
    return stage


def _stage_tp_plan(model: "HfModule", last: bool) -> "dict[str, str]":
    """``model``'s TP plan in the stage's module names: the base model's entries under ``body.`` (``body.model.``
    on the last stage, whose body is the causal LM), the causal LM's own (``lm_head``) on the last stage only."""
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, dict):
        return {}
    prefix = model.base_model_prefix + "."
    out = {}
    for pattern, style in plan.items():
        if pattern.startswith(prefix):
            out[("body." + prefix if last else "body.") + pattern[len(prefix):]] = style
        elif last:
            out["body." + pattern] = style
    return out


def causal_lm_loss(model: "HfModule") -> "Callable[[torch.Tensor, torch.Tensor], torch.Tensor]":
    """The loss ``model`` computes from ``labels=`` (its ``loss_function``: transformers' ``ForCausalLMLoss``,
    the labels shifted by one, cross-entropy in fp32), as ``loss_fn(logits, labels)`` for the pipeline's last
    stage. Handed the whole model's output instead (an estimate of the model without ``pipeline=``), it takes the
    output's ``logits``, as the model itself does."""
    function, vocab = model.loss_function, model.config.vocab_size

    def loss(logits: "torch.Tensor", labels: "torch.Tensor") -> "torch.Tensor":
        if not isinstance(logits, torch.Tensor):
            found = getattr(logits, "logits", None)
            if not isinstance(found, torch.Tensor):
                raise InvalidArgumentError(
                    f"causal_lm_loss(model) takes the logits (a tensor) or a model output holding them, got "
                    f"{type(logits).__name__}; give loss_fn a function of what the model (or the last stage) returns")
            logits = found
        value: torch.Tensor = function(logits=logits, labels=labels, vocab_size=vocab)
        return value

    return loss


def pp_degrees(model: "HfModule", world_size: int) -> list[int]:
    """The pipeline degrees of :data:`DEGREES` that divide ``world_size`` and ``model``'s decoder layers (the
    even cut), none when :func:`pp_support` says the model cannot be cut."""
    if not pp_support(model)[0]:
        return []
    layers = len(model.base_model.layers)
    return [p for p in DEGREES if p <= world_size and world_size % p == 0 and layers % p == 0]


def pp_fsdp(mixed: bool, tp: bool = False, fsdp: bool = True) -> "Callable[[HfStage, DeviceMesh], HfStage]":
    """A ``parallelize(stage, mesh)`` function: with ``tp`` the model's own TP plan over the mesh's ``tp``
    dimension first (:func:`memprof.simulate.hf_layouts.apply_tp_plan`, in the stage's module names), then with
    ``fsdp`` FSDP2 over its ``dp`` dimension inside each stage, as torchtitan applies it under pipeline
    parallelism (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_fsdp``): ``fully_shard`` of each
    decoder layer, then of the stage, with ``reshard_after_forward=False`` (its default when the pipeline is on: no
    all-gather per micro-batch) and, for ``mixed``, the ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)`` that gives its mixed precision."""

    def parallelize(stage: HfStage, mesh: "DeviceMesh") -> HfStage:
        from torch.distributed.fsdp import fully_shard

        from .hf_layouts import apply_tp_plan
        from .plan_precision import policy

        if tp:
            apply_tp_plan(stage, mesh["tp"])
        if not fsdp:
            return stage
        options: _ShardOptions = {"mesh": mesh["dp"], "reshard_after_forward": False}
        if mixed:
            options["mp_policy"] = policy()
        for layer in stage.layers:
            fully_shard(layer, **options)
        fully_shard(stage, **options)
        return stage

    return parallelize


class _ShardOptions(TypedDict, total=False):
    """The keyword arguments :func:`pp_fsdp` hands ``fully_shard``."""

    mesh: "DeviceMesh"
    reshard_after_forward: bool
    mp_policy: "MixedPrecisionPolicy"


class PipelineSimulation:
    """How a plan simulates a pipeline layout at one micro-batch size ``b``: :func:`memprof.estimate` of the
    causal LM cut by :func:`split` over ``pp`` stages (FSDP2 over ``world_size / pp`` ranks inside each, by
    :func:`pp_fsdp`), torch's 1F1B schedule over ``microbatches`` micro-batches of ``b`` sequences (the rank's
    batch is ``b x microbatches``), the model's own loss on the last stage; every stage's rank simulated and the
    one with the largest device-level peak returned (a predicted out-of-memory error counting as the largest)."""

    def __init__(self, world_size: int, pp: int, microbatches: int, schedule: str = "1f1b", tp: int = 1) -> None:
        self.world_size, self.pp, self.microbatches, self.schedule, self.tp = world_size, pp, microbatches, schedule, tp
        self.dp = world_size // (pp * tp)
        self.mesh = {"pp": pp, **({"dp": self.dp} if self.dp > 1 else {}), **({"tp": tp} if tp > 1 else {})}

    def __call__(self, estimate: "Callable[..., Estimate]", model: "HfModule", optimizer: "OptimizerArg",
                 make_batch: "Callable[[int], dict[str, torch.Tensor]]", b: int, *, precision: str,
                 over: "StageSearch | None" = None, **common: "Option") -> "Estimate":
        """The estimate at ``b`` sequences a micro-batch; with ``over`` (a plan's search of one row) the stages are
        simulated worst first and only until one does not fit (:func:`memprof.simulate.rank_classes.
        pipeline_ranks`)."""
        from .pipeline import Pipeline
        from .plan_precision import POLICY, estimate_precision
        from .rank_classes import pipeline_ranks

        common.pop("loss_fn", None)  # the whole model's (output.loss): the last stage's loss is the model's own below
        batch = make_batch(b * self.microbatches)
        pipeline = Pipeline(split, self.schedule, self.microbatches)
        # Mixed precision under the schedule is FSDP2's policy ("mixed", its older name here): fp32 parameters and
        # no autocast anywhere, not even around a checkpointed region's recomputation in backward.
        mixed = precision in ("mixed", POLICY)
        if mixed:
            precision = estimate_precision(POLICY)
        fn = (None if self.dp == 1 and self.tp == 1 else pp_fsdp(mixed, tp=self.tp > 1, fsdp=self.dp > 1))
        loss = causal_lm_loss(model)

        def one(rank: int) -> "Estimate":
            return estimate(model, optimizer, inputs=batch["input_ids"], targets=batch["labels"], loss_fn=loss,
                            precision=precision, world_size=self.world_size, mesh=self.mesh, parallelize=fn,
                            pipeline=pipeline, rank=rank, **common)

        if over is not None:
            over.at(b)
        est = pipeline_ranks(self.world_size, self.mesh, pipeline, one, key=device_key, over=over)
        if over is not None:
            over.saw(b, est)
        return est


class StageSearch:
    """How a plan's search of one row asks for a pipeline's stages (:class:`PipelineSimulation`'s ``over``): at
    each batch the stage that was the worst at the nearest batch simulated goes first (the first stage, holding
    the most micro-batches in flight, or the last, holding the logits), and once one does not fit ``limit`` the
    batch does not fit, so the others are not simulated. A row's batch that fits has every stage simulated; the
    search asks nothing else of one that does not. Batch 1 has every stage simulated all the same: a row that fits
    nothing shows its figures, the worst stage's. Per row, so that its order follows that row's batches alone,
    whichever process searches it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.first = 0
        self._batch = 1
        self._worst: dict[int, int] = {}  # batch -> the pp coordinate of its worst stage simulated

    def at(self, b: int) -> None:
        """Set :attr:`first` for batch ``b``, about to be simulated."""
        near = min(self._worst, key=lambda s: (abs(s - b), -s), default=None)
        self.first, self._batch = (0 if near is None else self._worst[near]), b

    def exceeds(self, est: "Estimate") -> bool:
        """Is ``est`` over what fits the device (a predicted out-of-memory error, or a device-level peak, the
        tensors' peak without a device replay, above the limit), at a batch other than 1?"""
        oom, device_peak, _ = device_key(est)
        return self._batch != 1 and (oom or device_peak > self.limit)

    def saw(self, b: int, est: "Estimate") -> None:
        """Keep which stage was the worst at ``b``."""
        from .rank_classes import worst_stage

        self._worst[b] = worst_stage(est) or 0  # a pipeline's estimate always names its worst stage


def device_key(est: "Estimate") -> tuple[bool, int, int]:
    """How a plan ranks a stage's estimate: a predicted out-of-memory error first, then the device-level peak, then
    the tensors' peak."""
    memory = est.device_memory
    if memory is None:
        return (False, est.peak_bytes, est.peak_bytes)
    return (memory.oom is not None, memory.device_peak, est.peak_bytes)
