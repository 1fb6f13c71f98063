"""Independent counters the tests compare memprof against.

Nothing here imports memprof: each figure is a plain sum of
numel() * element_size() over storages deduplicated by their StorageImpl.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def assert_sums(bd):
    """sum(categories) == total, exactly, whenever the total is measured."""
    assert bd.total == sum(v for v in bd.counts if v is not None)


def non_other(step):
    """A step's phases other than "other", as (phase, occurrence) pairs."""
    return [(p.phase.value, p.occurrence) for p in step.phases if p.phase.value != "other"]


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def unique_bytes(tensors) -> int:
    """Sum of storage sizes, each storage once (tied weights, views)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        seen[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def weight_bytes(model: nn.Module) -> int:
    return unique_bytes(model.parameters())


def buffer_bytes(model: nn.Module) -> int:
    return unique_bytes(model.buffers())


def grad_bytes(model: nn.Module) -> int:
    return unique_bytes(p.grad for p in model.parameters())


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return unique_bytes(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def saved_activation_bytes(fn, exclude) -> int:
    """Bytes autograd saves while ``fn()`` runs, deduplicated by storage, minus
    the storages of ``exclude`` (parameters, buffers, inputs). The graph is kept
    alive until the count is taken, then dropped."""
    excluded = {storage_key(t) for t in exclude}
    saved = {}

    def pack(t):
        k = storage_key(t)
        if k not in excluded:
            saved[k] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    total = sum(saved.values())
    del out
    return total


class LiveBytes(TorchDispatchMode):
    """Counts live bytes of every op output storage and of pre-registered
    tensors; remembers the highest total. Written independently of memprof."""

    def __init__(self, preexisting=()):
        super().__init__()
        self.live = {}
        self.total = 0
        self.peak = 0
        for t in preexisting:
            self._add(t)

    def _add(self, t):
        st = t.untyped_storage()
        k = st._cdata
        if k in self.live:
            return
        n = st.nbytes()

        def gone(_, k=k, n=n):
            if self.live.pop(k, None) is not None:
                self.total -= n

        self.live[k] = weakref.ref(st, gone)
        self.total += n
        self.peak = max(self.peak, self.total)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in args:
            if isinstance(a, torch.Tensor) and a.layout is torch.strided:
                self._add(a)
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if isinstance(o, torch.Tensor) and o.layout is torch.strided:
                self._add(o)
        return out

    def close(self):
        self.live.clear()


def hooks_left(model: nn.Module) -> list[str]:
    """Every place a memprof hook could have been left behind."""
    left = []
    for name, mod in model.named_modules():
        if mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks:
            left.append(f"module hooks on {name or '<model>'}")
    for name, p in model.named_parameters():
        if getattr(p, "_post_accumulate_grad_hooks", None):
            left.append(f"grad hook on {name}")
    import torch.optim.optimizer as optmod

    if optmod._global_optimizer_pre_hooks or optmod._global_optimizer_post_hooks:
        left.append("global optimizer hooks")
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        left.append("saved tensor hooks")
    if torch._C._len_torch_dispatch_stack() != 0:
        left.append("dispatch mode")
    return left


def hook_registry(model: nn.Module, optimizers=(), tensors=()) -> dict:
    """Every hook torch keeps where memprof could install one, as counts: the model's modules, its
    parameters, buffers and gradients, the optimizers (their own and the global step hooks), the
    given tensors (inputs, targets), the global module hooks, the saved-tensor hooks stack and the
    dispatch-mode stack. Compare a snapshot taken before a profile with one taken after it."""
    from torch.nn.modules import module as module_mod
    import torch.optim.optimizer as optmod

    snap = {}
    for name, mod in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_forward_hooks_always_called", "_state_dict_hooks", "_load_state_dict_pre_hooks"):
            snap[(f"module {name or '<model>'}", attr)] = len(getattr(mod, attr, None) or {})
    named = [(f"param {n}", p) for n, p in model.named_parameters(remove_duplicate=False)]
    named += [(f"grad {n}", p.grad) for n, p in model.named_parameters() if p.grad is not None]
    named += [(f"buffer {n}", b) for n, b in model.named_buffers()]
    named += [(f"tensor {i}", t) for i, t in enumerate(tensors)]
    for opt in optimizers:
        snap[("optimizer", "pre")] = len(opt._optimizer_step_pre_hooks)
        snap[("optimizer", "post")] = len(opt._optimizer_step_post_hooks)
        snap[("optimizer", "load")] = len(getattr(opt, "_optimizer_load_state_dict_post_hooks", None) or {})
        named += [(f"state {i}", v) for i, s in enumerate(opt.state.values()) for v in s.values()
                  if isinstance(v, torch.Tensor)]
    for name, t in named:
        snap[(name, "tensor hooks")] = len(t._backward_hooks or {})
        snap[(name, "post-accumulate hooks")] = len(getattr(t, "_post_accumulate_grad_hooks", None) or {})
    snap[("global", "optimizer")] = (len(optmod._global_optimizer_pre_hooks), len(optmod._global_optimizer_post_hooks))
    snap[("global", "module")] = tuple(len(getattr(module_mod, a, None) or {}) for a in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks",
        "_global_module_registration_hooks", "_global_parameter_registration_hooks",
        "_global_buffer_registration_hooks"))
    snap[("global", "saved tensor hooks")] = torch._C._autograd._top_saved_tensors_default_hooks(False)
    snap[("global", "dispatch modes")] = torch._C._len_torch_dispatch_stack()
    return snap


def tensors_under(obj, depth: int = 8):
    """The tensors reachable from ``obj`` through lists, tuples, dicts and objects' attributes."""
    seen, out, stack = set(), [], [(obj, 0)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
            continue
        if o is None or d >= depth or id(o) in seen or isinstance(o, (str, bytes, int, float, bool, type, nn.Module)):
            continue
        seen.add(id(o))
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend((v, d + 1) for v in o)
        elif isinstance(getattr(o, "__dict__", None), dict):
            stack.extend((v, d + 1) for v in vars(o).values())
    return out


class CacheOracle(TorchDispatchMode):
    """The cache of each call of ``model``, op by op, counted from the cache object the call is handed.

    After every op of a call: the floating storages the cache object (and an encoder output handed in)
    holds, plus the storages the call made that are still alive and that the cache holds when the call
    ends: a layer's new keys are its cache from the op that makes them. ``values[i]`` lists those bytes
    after each op of call ``i``, ``ends[i]`` the bytes held when it returns. Independent of memprof.
    An encoder-decoder model's encoder, called outside the model (as generate() calls it), opens the first
    call: its ops are that call's too, and its output the cache from the op that makes it.
    """

    NAMES = ("cache", "past_key_values", "encoder_outputs")

    def __init__(self, model: nn.Module):
        super().__init__()
        self.values, self.ends = [], []
        self.objs = None
        self.handles = [model.register_forward_pre_hook(self._begin, with_kwargs=True),
                        model.register_forward_hook(self._end, with_kwargs=True)]
        self.opened = False  # the encoder opened the call under way
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            self.handles.append(model.get_encoder().register_forward_pre_hook(self._encoder))

    def _held(self, *extra):
        held = {}
        for t in tensors_under([*self.objs, *extra]):
            if t.is_floating_point():
                st = t.untyped_storage()
                held[st._cdata] = st.nbytes()
        return held

    def _encoder(self, module, args):
        if self.objs is None and not torch.is_grad_enabled():
            self.objs, self.opened = [], True
            self.made, self.trail, self.serial = {}, [], 0

    def _begin(self, module, args, kwargs):
        opened, self.opened = self.opened, False
        self.objs = [kwargs.get(n) for n in self.NAMES]
        if opened:
            return  # the decoder's first call goes on from its encoder
        # Storages the call made: address -> (weak reference, bytes, serial). An address is reused once its
        # storage is freed, so a storage is told apart by its serial.
        self.made, self.trail, self.serial = {}, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.objs is not None:
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor) and o.layout is torch.strided:
                    st = o.untyped_storage()
                    known = self.made.get(st._cdata)
                    if known is None or known[0]() is None:
                        self.serial += 1
                        self.made[st._cdata] = (weakref.ref(st), st.nbytes(), self.serial)
            self.made = {k: v for k, v in self.made.items() if v[0]() is not None}
            self.trail.append((self._held(), {k: (serial, n) for k, (_, n, serial) in self.made.items()}))
        return out

    def _end(self, module, args, kwargs, output):
        final = self._held(getattr(output, "past_key_values", None))
        kept = {self.made[k][2] for k in final if k in self.made}
        self.values.append([sum(held.values()) + sum(n for k, (serial, n) in alive.items()
                                                     if serial in kept and k not in held)
                            for held, alive in self.trail])
        self.ends.append(sum(final.values()))
        self.objs = None

    def close(self):
        for h in self.handles:
            h.remove()


def json_strings(value):
    """Every string of a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from json_strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from json_strings(v)
