"""The formulas an estimate extended in depth is held against (:mod:`memprof.simulate.depth`): its records (module
calls, optimizers) are the cut model's, so the cuts' formulas are extended in a line as the figures are, and kept
in the trace's facts, which :mod:`memprof.anatomy.predict` reads first."""

from __future__ import annotations

import dataclasses

from ..record.estimate import Estimate

__all__ = ["extended_formulas"]


def extended_formulas(est: Estimate, ests: "list[Estimate]", more: int) -> "tuple[Estimate, str | None]":
    """``est`` with the formulas the reconciliation holds it against extended from the cuts' (``ests``) by ``more``
    blocks per stage: the per-module rules' activations (and the checkpointed part of them), the optimizer's
    states and step temporaries (each parameter group's, then the largest). They are computed from the trace's
    module calls and optimizers, which are the cut model's, so a 16-layer Llama's default estimate held its
    5-block cut's (activations 345,728 B where the whole model's rules give 1,069,440 B). Each grows by the same
    bytes per block, as the figures do; one that does not is no formula at full depth (a note says so), never
    the cut model's. One that no cut has (an optimizer memprof has no formula for) stays none."""
    from ..anatomy.predict import predict_activations, predict_optimizers

    # A CUDA target's cuts are traced on the CPU device record until the replay names the GPU (kept for the
    # caller's replay): their rules are read as on the device the estimate is for, as the whole model's are.
    traces = [dataclasses.replace(e.trace, device=est.trace.device) for e in ests]
    acts = [predict_activations(t) for t in traces]
    opts = [predict_optimizers(t) for t in traces]
    lost: list[str] = []

    def line(values: "list[int | None]", what: str) -> "int | None":
        a, b, c = values
        if a is None and b is None and c is None:
            return None  # no formula in any cut: none at full depth either
        if a is None or b is None or c is None or b - a != c - b:
            lost.append(what)
            return None
        return c + more * (c - b)

    saved = line([p.saved_bytes for p in acts], "the per-module rules' activations")
    checkpointed = line([p.checkpointed_bytes for p in acts], "their checkpointed part")
    state = line([p.state_bytes for p in opts], "the optimizer's states")
    by_group = [p.transient_by_group for p in opts]
    if by_group[0] and len({len(g) for g in by_group}) == 1:
        # The step's temporaries are its largest parameter group's: each group is extended in its own line, then
        # the largest taken (a 24-layer model's blocks' group passes its embedding and head's past a few blocks:
        # a line through the cuts' maximum, the embedding's each time, stayed 524,288 B where the whole model's is
        # 891,008 B).
        lines = [line(list(values), "the optimizer's step temporaries") for values in zip(*by_group)]
        transient = None if None in lines else max(v for v in lines if v is not None)
    else:
        transient = line([p.transient_bytes for p in opts], "the optimizer's step temporaries")
    trace = est.trace
    if saved is None or checkpointed is None:  # the calls would give the cut model's sums
        trace = dataclasses.replace(trace, module_calls=())
        saved = checkpointed = None
    if any(w.startswith("the optimizer's") for w in lost):  # its records would give the cut model's
        trace = dataclasses.replace(trace, optimizers=())
    facts = dataclasses.replace(trace.facts, activation_formula=saved, activation_checkpointed_formula=checkpointed,
                                optimizer_state_formula=state, optimizer_transient_formula=transient)
    note = (f"depth: no formula for {', '.join(dict.fromkeys(lost))} at full depth, since the cuts' did not grow "
            "by the same bytes per block" if lost else None)
    return dataclasses.replace(est, trace=dataclasses.replace(trace, facts=facts)), note
