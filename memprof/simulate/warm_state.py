"""An optimizer that already holds state, carried into the simulation as it holds it.

An optimizer given as an instance is rebuilt on the twin's parameters (:func:`memprof.simulate.twin.meta_optimizer`),
and a rebuilt optimizer holds no state. One that has stepped already (a warm-up step before the estimate, a
checkpoint's ``load_state_dict``) holds its moments or momentum buffers from the start of the run it is about to
take: the estimate was under by all of them until its first optimizer step (an AdamW over a 2-layer model: 198,756
B of states missing at step 0's forward, backward and the phases between), and with ``steps=1`` and SGD's momentum
under at its peak. Each state of a parameter the twin holds is made again on its twin: a tensor as a shape-only
tensor of its shape, strides and dtype on the twin parameter's device (fake or meta), a one-element CPU tensor (a
step counter, whose value the step reads) as a real copy with its value (lifted into the fake mode with it, as a
constructor's counters are: ``twin._lifted``), anything else as it is.
"""

from __future__ import annotations

import torch

from ..units import format_bytes

__all__ = ["carry_state"]

#: The one-element states torch.optim's steps read the values of (Adam's and its kin's counters, ASGD's averaging
#: scalars).
_COUNTERS = frozenset({"step", "eta", "mu"})


def carry_state(user: torch.optim.Optimizer, twin: torch.optim.Optimizer, mapping: "dict[int, torch.Tensor]",
                notes: list[str]) -> None:
    """Give ``twin`` (rebuilt from ``user`` on the twin's parameters; ``mapping``: the user's parameter's id -> its
    twin) the state ``user`` holds, with a note. A parameter the twin does not hold (another pipeline stage's) is
    not the run's; a state that cannot be made again (a sparse tensor, a sharded twin parameter, a state that is not
    a dict) is left out, and the note names it."""
    carried, nbytes = 0, 0
    left: list[str] = []
    for param, state in user.state.items():
        twin_param = mapping.get(id(param)) if isinstance(param, torch.Tensor) else None
        if twin_param is None:
            continue
        if not isinstance(state, dict):
            left.append(f"a state of type {type(state).__name__}")
            continue
        made: dict[object, object] = {}
        for key, value in state.items():
            copy = _twin_of(key, value, param, twin_param) if isinstance(value, torch.Tensor) else value
            if copy is None:
                left.append(f"{key!s} ({_kind(value, twin_param)})")
                break  # all of a parameter's state, or none: a step finding half of it would fail
            made[key] = copy
        else:
            if made:
                twin.state[twin_param] = made
                tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
                carried += len(tensors)
                nbytes += sum(v.untyped_storage().nbytes() for v in tensors)
    if carried:
        notes.append(f"the optimizer held state before the estimate (a step taken, a checkpoint loaded): its "
                     f"{carried} state tensor(s), {format_bytes(nbytes)}, were carried into the simulation as it "
                     f"holds them (a floating state in its parameter's dtype cast with it by precision=), from "
                     f"the first step on")
    if left:
        notes.append(f"the optimizer's state could not be carried for {len(left)} parameter(s) ({', '.join(left[:3])}"
                     f"{', ...' if len(left) > 3 else ''}): the simulation makes it at its first step, under until "
                     f"then by what it holds")


def _counter(key: object, value: torch.Tensor, param: torch.Tensor) -> bool:
    """A one-element CPU state whose value the step reads: torch.optim's ``step`` counters and ASGD's ``eta`` and
    ``mu``, or one unlike its parameter. A one-element parameter's moments are like it (its shape and dtype): they
    are made on the target like any moment, cast with their parameter (a review found them left on the host for a
    CUDA target, 1,024 B under, and in fp32 beside a bf16 parameter, which the step refused)."""
    if value.numel() != 1 or value.device.type != "cpu":
        return False
    return key in _COUNTERS or value.shape != param.shape or value.dtype != param.dtype


def _twin_of(key: object, value: torch.Tensor, param: torch.Tensor, twin_param: torch.Tensor) -> "torch.Tensor | None":
    """``value`` (a state of the user's ``param``) made again beside ``twin_param``, or None where it cannot be.
    A floating state in its parameter's dtype follows the parameter where ``precision=`` casts it: torch makes an
    optimizer's states like their parameters, and a bf16 run's optimizer holds bf16 moments."""
    from torch._subclasses.fake_tensor import FakeTensor

    if value.layout is not torch.strided or type(value) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if _counter(key, value, param):
        return value.detach().clone()  # its value is read by the step
    dtype = twin_param.dtype if value.is_floating_point() and value.dtype == param.dtype else value.dtype
    if isinstance(twin_param, FakeTensor):
        with twin_param.fake_mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=dtype, device=twin_param.device)
    if type(twin_param) in (torch.Tensor, torch.nn.Parameter) and twin_param.is_meta:
        return torch.empty_strided(value.shape, value.stride(), dtype=dtype, device="meta")
    return None


def _kind(value: torch.Tensor, twin_param: torch.Tensor) -> str:
    if value.layout is not torch.strided:
        return f"a {value.layout} tensor"
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        return f"a {type(value).__name__}"
    return f"its parameter's twin is a {type(twin_param).__name__}"
