"""tests/gloo_settled.py's :class:`LetGoByGloo` on two real gloo ranks: a functional collective returns with gloo
holding none of its tensors (the forward all-to-all, the autograd all-to-all's forward, and its backward, which
autograd's C++ issues), so an input its caller drops right after the call is freed there, on the caller's thread,
as under the simulation's fake process group. Without the mode the collective's work is still registered when the
call returns (nothing has waited for it), and its tensors are held past it."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not built in")


class _Seen:
    """Per functional collective, as it returns to the caller: (op, each input's use count before it and after
    it, each output's after it)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int], list[int], list[int]]] = []


def _watching(seen: _Seen):
    """A dispatch mode above :class:`LetGoByGloo` (as memprof's profile is) that records what the caller sees."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace != "_c10d_functional" or func.__name__.startswith(("wait_tensor", "_wrap")):
                return func(*args, **kwargs)
            before = [args[0]._use_count()]
            out = func(*args, **kwargs)
            seen.calls.append((str(func), before, [args[0]._use_count()], [out._use_count()]))
            return out

    return Watch()


def _rank(rank: int, store: str) -> None:
    import torch.distributed._functional_collectives as funcol

    from gloo_settled import join_gloo, settle_collectives

    settle_collectives()
    join_gloo(rank, 2, store)
    try:
        seen, freed_on = _Seen(), []
        torch.manual_seed(0)
        x = torch.randn(8, requires_grad=True)
        with _watching(seen):
            sent = x.detach() * 3
            gone = weakref.ref(sent.untyped_storage(), lambda _: freed_on.append(threading.get_ident()))
            got = funcol.all_to_all_single(sent, None, None, dist.group.WORLD)
            del sent  # the caller lets go of its input at once: with gloo done with it, it is freed here
            assert gone() is None and freed_on == [threading.get_ident()], freed_on
            received = got * 1  # the caller's wait, which finds nothing left to wait for
            y = funcol.all_to_all_single_autograd(x * 2, [4, 4], [4, 4], dist.group.WORLD)
            y.sum().backward()
        # every rank's x is the same (seeded alike): each receives its own chunk of it from both
        assert torch.equal(received, torch.cat([x.detach()[rank * 4:(rank + 1) * 4] * 3] * 2))
        # forward all-to-all, the autograd one's forward, its backward (grad_output sent back)
        assert [c[0] for c in seen.calls] == ["_c10d_functional.all_to_all_single.default"] * 3, seen.calls
        for op, before, after, out in seen.calls:
            # the input held by no more than before the call, the output by its result alone
            assert (after, out) == (before, [1]), (op, before, after, out)
        assert x.grad is not None and torch.equal(x.grad, torch.full((8,), 2.0))  # d(sum(a2a(2x)))/dx
    finally:
        dist.destroy_process_group()


def test_a_functional_collective_on_gloo_returns_with_gloo_holding_none_of_its_tensors(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(str(tmp_path / "store"),), nprocs=2)
