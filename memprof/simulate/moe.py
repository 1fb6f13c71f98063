"""Mixture-of-experts models in a simulation: the pieces one simulation runs with, and what its notes say.

transformers 5 runs an MoE layer's experts in one of three ways (``experts_implementation``, chosen per
config; ``"grouped_mm"`` by default): ``torch._grouped_mm`` over tokens sorted by expert, ``batched_mm``
(each token's expert weights gathered, then one ``bmm``), or ``"eager"``, a Python loop over the experts hit
that gathers each one's tokens. The first two allocate by ``tokens x k`` only; the loop allocates per expert
by how many tokens it got. :class:`MoeRules` makes all three run on shape-only tensors:

* the target's ``_grouped_mm`` (:mod:`memprof.simulate.grouped_mm`), which torch's meta kernel refuses
  in float32;
* router calls answered from the routing assumption (:mod:`memprof.simulate.routing`,
  :class:`~memprof.simulate.routers.Router`), and the values that follow from them carried beside the
  data-less tensors (:mod:`memprof.simulate.shadows`), so the loop's ``nonzero``, ``item()`` and
  ``tolist()`` get answers;
* ``one_hot`` as the target's kernel runs it, and a routed scalar formatted as a real one
  (:class:`~memprof.simulate.routers.RoutedValues`).

A dense model never makes a router call inside its forward: then none of this changes anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..errors import is_interrupt
from .experts import CountsExchange
from .routers import RoutedValues, Router
from .routing import Routing, routing_of
from .shadows import ValueShadows

if TYPE_CHECKING:
    from ..collect.simulated import SimulatedProfile

__all__ = ["MoeRules"]


class MoeRules:
    """What a simulation for device type ``target`` needs to run MoE layers under ``routing`` (anything
    ``routing=`` accepts; None: balanced)."""

    def __init__(self, target: str, routing: object = None) -> None:
        self.routing: Routing = routing_of("balanced" if routing is None else routing)
        if self.routing.ranks:  # every rank's record: this rank replays its own
            self.routing = self.routing.of_rank(_current_rank())
        self.given = routing is not None
        self.target = target
        self.shadows = ValueShadows(target)
        self.exchange = self.shadows.exchange = CountsExchange(self.routing.policy, self.routing.ranks)
        self.plan = self.routing.plan()
        self.router = Router(self.plan, self.shadows.store)
        self.values = RoutedValues(target, self.shadows.store)

    def attach(self, prof: SimulatedProfile) -> None:
        """Router calls count inside the forward of ``prof``'s model (a :class:`~memprof.collect.simulated.
        SimulatedProfile`, which says where)."""
        self.router.where = prof.innermost_module

    def pause(self) -> _Paused:
        """A context in which router calls are not answered (a decoding loop's own ``topk``)."""
        return _Paused(self.router)

    def notes(self) -> list[str]:
        out: list[str] = self.exchange.notes()
        calls, r = self.plan.calls, self.routing
        if self.shadows.grouped_mm:
            out.append(f"torch._grouped_mm x{self.shadows.grouped_mm} ran as the {self.target} kernel runs it "
                       "(float32, bfloat16 and float16; output rows padded to 16 bytes, GroupedMMUtils.h)"
                       + ("; on a CUDA device with bf16 on compute capability 9.0 it runs CUTLASS, whose workspace "
                          "is not a torch tensor and is not counted" if self.target == "cuda" else ""))
        if not calls:
            if self.given and r.policy != "balanced":
                out.append(f"routing={r.words()} was given, but the model made no router call (topk or argmax over "
                           "scores inside its forward): it changed nothing")
            return out
        modules = len(self.router.modules)
        text = f"MoE routing assumed: {r.words()}; {calls} router call(s) in {modules} module(s) were answered from it"
        if r.policy == "replay":
            recorded = sum(len(v) for v in r.by_module.values()) + len(r.ordered)
            if recorded > calls:
                text += f" (the first {calls} of {recorded} recorded calls)"
        answered = self.shadows.answered
        if answered:
            ops = ", ".join(f"{name} x{n}" for name, n in sorted(answered.items()))
            text += (f". The experts' code read which experts were chosen ({ops}), as transformers' per-expert loop "
                     "('eager') does: its allocations follow each expert's token count, so these figures are for this "
                     "routing. A model's own routing differs: against real runs (docs/accuracy.md) balanced was "
                     "within 1 % of a training step but up to 8 % below a generation, whose few tokens per decode "
                     "call route unevenly; every token on the same k experts ('worst') gave the highest generation "
                     "peaks and the lowest training peaks, so no assumption bounds both. For firm figures replay a "
                     "recorded routing (memprof.profile(..., record_routing=True)), or run the experts as grouped_mm, "
                     "whose allocations do not depend on routing")
        else:
            text += (". No op read which experts were chosen (grouped_mm and batched_mm allocate by tokens x k): "
                     "the figures hold for any routing")
        if r.policy == "capacity":
            text += ("; transformers' routers of these models drop no token, so the capacity shaped the counts "
                     "only")
        out.append(text)
        return out


def _current_rank() -> int:
    """The simulated rank (of ``parallelize=``'s fake process group), 0 outside one."""
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except (RuntimeError, ValueError) as failure:
        if is_interrupt(failure):
            raise  # a signal handler's exception (errors.is_interrupt) is the user's
        return 0


class _Paused:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.saved: "Callable[[], str | None]" = router.where  # read again as the pause begins

    def __enter__(self) -> None:
        self.saved = self.router.where
        self.router.where = lambda: None

    def __exit__(self, *exc: object) -> None:
        self.router.where = self.saved

