"""What a model's repeated stack of blocks is, for the depth fast path (:mod:`memprof.simulate.depth`): where it
is (:func:`find_stack`), its period of kinds of block (:func:`period`: a hybrid's sliding-window and full-attention
layers) and whether every block is like the cuts' (:func:`unlike`), which the cuts' line stands for."""

from __future__ import annotations

import enum
import functools
import types
from collections import Counter

import torch
from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

__all__ = ["find_stack", "period", "unlike", "alike", "signatures"]


def find_stack(model: nn.Module) -> "tuple[str, int, str] | None":
    """The repeated stack: the name of the ``ModuleList``/``Sequential`` with the most children of one class (two
    or more), its length, and that class's name."""
    best: "tuple[str, int, str] | None" = None
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        kinds = Counter(type(c) for c in m.children())
        if not kinds:
            continue
        cls, n = kinds.most_common(1)[0]
        if n >= 2 and n == len(m) and (best is None or n > best[1]):
            best = (name, n, cls.__name__)
    return best


def period(model: nn.Module, name: str) -> int:
    """The blocks of one period of the stack: the shortest ``p`` dividing its length such that block ``i`` is like
    block ``i % p`` for every ``i`` (:func:`signatures`; 1 when they are all alike, the stack's length when no
    period repeats): a hybrid's sliding-window and full-attention layers, told apart by a word, a flag or a window
    set on some only, or by a module some blocks lack (Llama 4's layers without RoPE have no q/k norm)."""
    return alike(model, name)[0]


def unlike(model: nn.Module, name: str) -> "str | None":
    """Where the blocks of the stack ``name`` are not alike, which two differ and in what (:func:`alike`); None
    where they are."""
    return alike(model, name)[1]


def alike(model: nn.Module, name: str) -> "tuple[int, str | None]":
    """The stack's :func:`period`, and where its blocks are not alike, why; both read off one description of the
    blocks (:func:`signatures`), which a caller that needs both asks for once. The blocks are not alike where
    they repeat no period, share a parameter, or hooks are registered for every module. The cuts hold the first
    blocks, and each unit added stands for every later one: a later block unlike the earlier ones (its layers
    frozen, a hook of its own, another dtype, dropout off) is not in the line. The two named are the first that
    differ in a period of their words and flags alone (the period a hybrid stack was built with)."""
    blocks = _blocks(model, name)
    sigs = signatures(blocks)
    p = _period(sigs)
    shared = _shared(blocks) or _global_hooks()
    if shared is not None:
        return p, shared
    if p < len(sigs):
        return p, None
    kinds = [[line for line in sig if line.startswith("module ")] for sig in sigs]
    q = _period([[" ".join(w for w in line.split() if "=" in w and not w.startswith(("training=", "hooks=")))
                  for line in kind] for kind in kinds])
    q = 1 if q == len(sigs) else q
    i = next((i for i in range(q, len(sigs)) if sigs[i] != sigs[i % q]), 1)
    mine, theirs = sigs[i], sigs[i % q]
    at = next((j for j, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
    said = [f"{which} has {sig[at]}" if at < len(sig) else f"{which} has nothing more"
            for which, sig in ((f"block {i}", mine), (f"block {i % q}", theirs))]
    return p, ", ".join(said)


def signatures(blocks: "list[nn.Module]") -> "list[list[str]]":
    """What each block is, in words, for :func:`alike`: its modules (paths, classes, training
    flags, hook counts, settings), its parameters (shapes, dtypes, requires_grad) and buffers. A setting is
    compared as it is (a word, a flag, a dtype, a member of an enum, a tuple, a function by its name), a float by
    whether it is 0 (a dropout's rate: a mask or none), an int by its value unless it is each block's own index
    (``layer_idx``: it grows by 1 a block), None as unset."""
    raw = [_raw(b) for b in blocks]
    indices = _indices(raw)
    out = []
    for i, block in enumerate(raw):
        sig = []
        for path, cls, training, hooks, settings in block:
            words = sorted(f"{k} index" if (path, k) in indices else _setting(k, v) for k, v in settings)
            sig.append(f"module {path or '(the block)'} {cls} training={training} hooks={hooks} "
                       f"{' '.join(words)}".rstrip())
        sig += _tensors(blocks[i])
        out.append(sig)
    return out


def _blocks(model: nn.Module, name: str) -> "list[nn.Module]":
    return list(model.get_submodule(name).children()) if name else list(model.children())


def _period(sigs: "list[list[str]]") -> int:
    """The shortest ``p`` dividing the stack that it repeats (a period that does not divide it, 5 in 6 blocks, is
    one block unlike the others)."""
    n = len(sigs)
    return next(p for p in range(1, n + 1) if n % p == 0 and all(sigs[i] == sigs[i % p] for i in range(n)))


_Raw = list[tuple[str, str, bool, list[int], list[tuple[str, object]]]]


def _raw(block: nn.Module) -> _Raw:
    """Each module of ``block``: path, class, training flag, hook counts, and its plain settings."""
    out: _Raw = []
    for path, m in block.named_modules():
        hooks = [len(getattr(m, h, None) or ()) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                         "_backward_pre_hooks")]
        settings = [(k, v) for k, v in vars(m).items() if not k.startswith("_") and _plain(v)]
        out.append((path, type(m).__qualname__, m.training, hooks, settings))
    return out


def _plain(value: object) -> bool:
    """A setting :func:`_setting` can compare: a scalar, a dtype, an enum member, a tuple of those, a function."""
    if isinstance(value, (str, bool, float, int, type(None), torch.dtype, enum.Enum)):
        return True
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, (types.FunctionType, types.BuiltinFunctionType, functools.partial))


def _indices(raw: "list[_Raw]") -> "set[tuple[str, str]]":
    """The (module path, setting) pairs that are each block's own index: an int that grows by 1 a block."""
    values: dict[tuple[str, str], list[object]] = {}
    for block in raw:
        for path, _cls, _training, _hooks, settings in block:
            for k, v in settings:
                values.setdefault((path, k), []).append(v)
    out = set()
    for key, vs in values.items():
        ints = [v for v in vs if type(v) is int]
        if len(ints) == len(raw) > 1 and all(b - a == 1 for a, b in zip(ints, ints[1:])):
            out.add(key)
    return out


def _setting(key: str, value: object) -> str:
    """A plain setting (:func:`_plain`) in words, as :func:`signatures` compares it."""
    if isinstance(value, (str, bool, int, torch.dtype, enum.Enum, tuple)):
        return f"{key}={value!r}"
    if isinstance(value, float):
        return f"{key}{'=' if value == 0 else '!='}0"
    if value is None:
        return f"{key} unset"
    return f"{key}={getattr(value, '__qualname__', None) or getattr(getattr(value, 'func', None), '__qualname__', '?')}"


def _tensors(block: nn.Module) -> "list[str]":
    """A block's parameters and buffers, in words (a lazy module's not yet made: uninitialised)."""
    out = []
    for n, t in block.named_parameters():
        shape = "uninitialised" if isinstance(t, UninitializedParameter) else tuple(t.shape)
        out.append(f"parameter {n} {shape} {t.dtype} requires_grad={t.requires_grad}")
    for n, b in block.named_buffers():
        held = "uninitialised" if isinstance(b, UninitializedBuffer) else tuple(b.shape)
        out.append(f"buffer {n} {held} {b.dtype}")
    return out


def _global_hooks() -> "str | None":
    """Hooks registered for every module (``torch.nn.modules.module.register_module_forward_hook`` ...), which
    can act on some blocks and not others (a feature tap from layer 6 on) where no block's description shows it;
    None where there are none."""
    from torch.nn.modules import module as torch_module

    kinds = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks")
    held = [k.strip("_") for k in kinds if getattr(torch_module, k, None)]
    return f"hooks for every module are registered ({', '.join(held)}), which may act on some blocks only" \
        if held else None


def _shared(blocks: "list[nn.Module]") -> "str | None":
    """Which two blocks share a parameter (a cut holds the first of them, the line counts it once per block),
    None where none does."""
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for n, t in block.named_parameters():
            j = owner.setdefault(id(t), i)
            if j != i:
                return f"block {i} shares its parameter {n} with block {j}"
    return None
