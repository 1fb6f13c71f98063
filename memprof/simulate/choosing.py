"""How a simulated generation chooses its next tokens after each forward: greedy, sampling, beam search.

Each chooser mirrors what transformers' decoding loop of that kind allocates and keeps between forward calls
(``transformers/generation/utils.py``: ``_sample`` for greedy and sampling, ``_beam_search`` for beams), on
shape-only tensors. Nothing here reads a value: the loop runs until ``max_new_tokens`` (no sequence is taken to
stop early at an end-of-sequence token), which is the longest, largest generation.

* :class:`Greedy`: the last position's logits copied to fp32, their argmax, the ids one longer.
* :class:`Sampling`: the same copy through transformers' own logits warpers (``TemperatureLogitsWarper``,
  ``TopKLogitsWarper``, ``TopPLogitsWarper`` as ``generate(do_sample=True, temperature=, top_k=, top_p=)``
  builds them), a softmax and ``torch.multinomial``. The warpers' temporaries (top-k's values and mask, top-p's
  sort, softmax, cumulative sum and scatter) are theirs, and ``_sample``'s locals (logits, scores,
  probabilities) stay alive through the next forward, as Python keeps them.
* :class:`Beams`: ``_beam_search``'s state (running and finished sequences of ``max_length`` tokens, scores,
  beam indices), and per step the log-softmax, the top-2k continuations, the stopping criteria and the two
  gathers, through transformers' own helpers of ``GenerationMixin`` (``_get_top_k_continuations``,
  ``_get_running_beams_for_next_iteration``, ``_update_finished_beams``, ``_check_early_stop_heuristic``), then
  ``cache.reorder_cache(beam_idx)``: every layer's keys and values copied in the order of the surviving beams.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from .aliases import HfCache, HfModule, UserValue

#: A logits processor of transformers' (a warper): ``processor(input_ids, scores)`` gives the processed scores.
Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Loop(Protocol):
    """The decoding loop a chooser serves (a :class:`memprof.simulate.decoding.Decoding`, which imports this
    module): what a chooser reads of it, and the tensors it keeps there as ``generate()``'s locals."""

    model: HfModule
    batch: int
    rows: int
    device: torch.device
    cache: HfCache
    ids: "torch.Tensor | None"
    logits: "torch.Tensor | None"
    next_tokens: "torch.Tensor | None"
    unfinished: "torch.Tensor | None"

__all__ = ["Greedy", "Sampling", "Beams", "warpers"]


class Greedy:
    """``_sample`` without sampling: argmax of the fp32 copy of the last logits (the copy is kept until the next
    call's replaces it)."""

    def start(self, loop: Loop) -> None:
        loop.unfinished = torch.ones(loop.rows, dtype=torch.long, device=loop.device)

    def choose(self, loop: Loop, output: list[UserValue]) -> None:
        """Choose from ``output[0]``, the forward's output; clear ``output`` where transformers drops it."""
        assert loop.ids is not None and loop.unfinished is not None  # the prompt's, and start()'s
        # Rebound as _sample rebinds next_token_logits: the previous call's copy is alive while the new one is made
        # (freed first, the estimate was one fp32 row of logits under, B x vocab x 4 B; a new user's sweep).
        loop.logits = output[0].logits[:, -1].to(copy=True, dtype=torch.float32)
        loop.next_tokens = torch.argmax(loop.logits, dim=-1)  # a local of the loop: alive until the next step's
        loop.ids = torch.cat([loop.ids, loop.next_tokens[:, None]], dim=-1)
        done = torch.full((loop.rows,), False, dtype=torch.bool, device=loop.device)
        loop.unfinished = loop.unfinished & ~done
        output.clear()

    def grow(self, loop: Loop, tokens: int) -> None:
        pass


def warpers(temperature: float, top_k: "int | None", top_p: float, keep: int = 1) -> list[Processor]:
    """transformers' logits warpers for sampling, in the order ``generate()`` applies them."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out: list[Processor] = []
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=keep))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=keep))
    return out


class Sampling(Greedy):
    """``_sample`` with ``do_sample=True``: the warpers, a softmax, one multinomial draw per sequence."""

    def __init__(self, temperature: float = 1.0, top_k: "int | None" = 50, top_p: float = 1.0) -> None:
        self.processors = warpers(temperature, top_k, top_p)
        self.scores: "torch.Tensor | None" = None
        self.probs: "torch.Tensor | None" = None

    def choose(self, loop: Loop, output: list[UserValue]) -> None:
        # _sample's locals: each name is rebound in turn, so the previous step's tensor lives until then.
        assert loop.ids is not None and loop.unfinished is not None  # the prompt's, and start()'s
        loop.logits = output[0].logits[:, -1].to(copy=True, dtype=torch.float32)
        scores = loop.logits
        for p in self.processors:
            scores = p(loop.ids, scores)
        self.scores = scores
        self.probs = torch.nn.functional.softmax(self.scores, dim=-1)
        loop.next_tokens = torch.multinomial(self.probs, num_samples=1).squeeze(1)
        loop.ids = torch.cat([loop.ids, loop.next_tokens[:, None]], dim=-1)
        done = torch.full((loop.rows,), False, dtype=torch.bool, device=loop.device)
        loop.unfinished = loop.unfinished & ~done
        output.clear()


class Beams:
    """``_beam_search`` with ``num_beams`` beams over ``max_length`` tokens (prompt and new tokens), ``eos`` the
    end-of-sequence ids (they size the continuations kept per step), ``sample`` the (temperature, top_k, top_p) of
    beam sampling (None: beam search)."""

    def __init__(self, num_beams: int, max_length: int, eos: "list[int]",
                 sample: "tuple[float, int | None, float] | None" = None, length_penalty: float = 1.0,
                 early_stopping: "bool | str" = False) -> None:
        self.num_beams, self.max_length, self.eos, self.sample = num_beams, max_length, eos, sample
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.keep = max(2, 1 + len(eos)) * num_beams
        # Beam sampling keeps a non-eos token beside the eos ones (generate()'s min_tokens_to_keep).
        self.processors = warpers(*sample, keep=len(eos) + 1) if sample is not None else []
        self.state: dict[str, torch.Tensor] = {}  # _beam_search's locals, by name

    def start(self, loop: Loop) -> None:
        """What ``_beam_search`` makes before the prefill (the ids already expanded to batch x beams)."""
        model, b, nb, device = loop.model, loop.batch, self.num_beams, loop.device
        for name in ("_get_top_k_continuations", "_get_running_beams_for_next_iteration", "_update_finished_beams",
                     "_check_early_stop_heuristic", "_beam_search_has_unfinished_sequences", "_flatten_beam_dim",
                     "_unflatten_beam_dim"):
            if not callable(getattr(model, name, None)):
                raise InvalidArgumentError(
                    f"num_beams > 1 runs transformers' own beam-search steps, and this transformers has no "
                    f"GenerationMixin.{name}; upgrade transformers (5.0 or later), or estimate with num_beams=1")
        from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, StoppingCriteria,
                                                               StoppingCriteriaList)

        self.model = model
        assert loop.ids is not None  # the prompt's, expanded to batch x beams
        self.cur_len = self.prompt_len = loop.ids.shape[1]
        s = self.state
        s["top_mask"] = torch.cat((torch.ones((nb,), dtype=torch.bool),
                                   torch.zeros((self.keep - nb,), dtype=torch.bool)), dim=0).to(device)
        fill = self.eos[0] if self.eos else -1
        s["running"] = torch.full((b, nb, self.max_length), fill_value=fill, dtype=torch.int64, device=device)
        s["running"][:, :, :self.cur_len] = model._unflatten_beam_dim(loop.ids, b, nb)
        s["sequences"] = s["running"].detach().clone()
        s["running_scores"] = torch.zeros((b, nb), dtype=torch.float, device=device)
        s["running_scores"][:, 1:] = -1e9
        s["scores"] = torch.full((b, nb), fill_value=-1e9, dtype=torch.float, device=device)
        s["finished"] = torch.zeros((b, nb), dtype=torch.bool, device=device)
        s["unsatisfied"] = torch.ones((b, 1), dtype=torch.bool, device=device)
        s["hits"] = torch.zeros((b, nb), dtype=torch.bool, device=device)
        s["running_indices"] = torch.full((b, nb, self.max_length - self.cur_len), fill_value=-1, dtype=torch.int32,
                                          device=device)
        s["indices"] = s["running_indices"].detach().clone()
        s["flat"] = loop.ids
        criteria: list[StoppingCriteria] = [MaxLengthCriteria(max_length=self.max_length)]
        if self.eos:
            criteria.append(EosTokenCriteria(eos_token_id=torch.tensor(self.eos, device=device)))
        self.criteria = StoppingCriteriaList(criteria)

    def inputs(self, loop: Loop) -> torch.Tensor:
        """The ids of the next call: ``running_sequences`` up to the current length, flattened (a copy)."""
        s = self.state
        if self.cur_len > self.prompt_len:
            s["flat"] = self.model._flatten_beam_dim(s["running"][:, :, :self.cur_len])
        flat: torch.Tensor = s["flat"]
        return flat

    def choose(self, loop: Loop, output: list[UserValue]) -> None:
        # Each of _beam_search's locals is a key of the state, rebound where the loop rebinds it: the previous
        # step's tensors live until then, through the next forward too.
        m, s, b, nb = self.model, self.state, loop.batch, self.num_beams
        loop.logits = output[0].logits[:, -1, :].to(copy=True, dtype=torch.float32)
        s["log_probs"] = torch.nn.functional.log_softmax(loop.logits, dim=-1)
        for p in self.processors:
            s["log_probs"] = p(s["flat"], s["log_probs"])
        output.clear()  # del model_outputs
        s["log_probs"] = m._unflatten_beam_dim(s["log_probs"], b, nb)
        s["log_probs"] = s["log_probs"] + s["running_scores"][:, :, None]
        s["log_probs"] = torch.reshape(s["log_probs"], (b, -1))
        s["topk_log_probs"], s["topk_sequences"], s["topk_indices"] = m._get_top_k_continuations(
            accumulated_log_probs=s["log_probs"], running_sequences=s["running"],
            running_beam_indices=s["running_indices"], cur_len=self.cur_len, decoder_prompt_len=self.prompt_len,
            do_sample=self.sample is not None, beams_to_keep=self.keep, num_beams=nb, batch_size=b)
        s["hits"] = self.criteria(m._flatten_beam_dim(s["topk_sequences"][:, :, :self.cur_len + 1]), None)
        s["hits"] = m._unflatten_beam_dim(s["hits"], b, self.keep)
        s["running"], s["running_scores"], s["running_indices"] = m._get_running_beams_for_next_iteration(
            topk_log_probs=s["topk_log_probs"], topk_running_sequences=s["topk_sequences"],
            topk_running_beam_indices=s["topk_indices"], next_token_hits_stopping_criteria=s["hits"], num_beams=nb)
        s["sequences"], s["scores"], s["indices"], s["finished"] = m._update_finished_beams(
            sequences=s["sequences"], topk_running_sequences=s["topk_sequences"], beam_scores=s["scores"],
            topk_log_probs=s["topk_log_probs"], beam_indices=s["indices"], topk_running_beam_indices=s["topk_indices"],
            is_early_stop_heuristic_unsatisfied=s["unsatisfied"], is_sent_finished=s["finished"],
            next_token_hits_stopping_criteria=s["hits"], top_num_beam_mask=s["top_mask"], num_beams=nb,
            cur_len=self.cur_len, decoder_prompt_len=self.prompt_len, length_penalty=self.length_penalty,
            early_stopping=self.early_stopping)
        s["beam_idx"] = m._flatten_beam_dim(s["running_indices"][..., self.cur_len - self.prompt_len])
        loop.cache.reorder_cache(s["beam_idx"])
        self.cur_len += 1
        s["unsatisfied"] = m._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=s["unsatisfied"], running_beam_scores=s["running_scores"],
            beam_scores=s["scores"], is_sent_finished=s["finished"], cur_len=self.cur_len,
            max_length=self.max_length, decoder_prompt_len=self.prompt_len, early_stopping=self.early_stopping,
            length_penalty=self.length_penalty)
        # The loop's condition: its tensors are made and dropped; their value (whether to stop) is not read.
        m._beam_search_has_unfinished_sequences(s["unsatisfied"], s["finished"], s["hits"], self.early_stopping)

    def grow(self, loop: Loop, tokens: int) -> None:
        """``tokens`` decode steps skipped: the state is sized by ``max_length`` already; only the length moves."""
        self.cur_len += tokens
