"""What a model's repeated stack of blocks is, for the depth fast path (:mod:`memprof.simulate.depth`): where it
is (:func:`find_stack`), its period of kinds of block (:func:`period`: a hybrid's sliding-window and full-attention
layers) and whether every block is like the cuts' (:func:`unlike`), which the cuts' line stands for."""

from __future__ import annotations

from collections import Counter

from torch import nn

__all__ = ["find_stack", "period", "unlike"]


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
    """The blocks of one period of the stack's kinds: the shortest ``p`` such that block ``i`` is of the kind of
    block ``i % p`` for every ``i`` (1 when they are all alike; the stack's length when no period repeats). A
    block's kind is what its modules say of themselves in words and flags (``attention_type``, ``is_sliding``):
    numbers, a layer's index among them, are no kind."""
    blocks = list(model.get_submodule(name).children()) if name else list(model.children())
    kinds = [tuple(sorted((f"{path}.{key}", value) for path, m in block.named_modules()
                          for key, value in vars(m).items() if isinstance(value, (str, bool)) and key != "training"))
             for block in blocks]
    for p in range(1, len(kinds) + 1):
        if all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
            return p
    return len(kinds)


def unlike(model: nn.Module, name: str) -> "str | None":
    """Where the blocks of the stack ``name`` are not alike, which two differ and in what; None where block ``i``
    is like block ``i % p`` for every ``i`` (``p`` the stack's period of kinds, :func:`period`). The cuts hold
    the first blocks, and each block added stands for every later one: a later block that differs (its layers
    frozen, a hook of its own, another dtype, dropout off) is not in the line. Alike is: the same modules (paths,
    classes, training flags, hook counts and settings, :func:`_setting`), the same parameters (shapes, dtypes,
    requires_grad) and buffers."""
    blocks = list(model.get_submodule(name).children()) if name else list(model.children())
    p = period(model, name)
    signatures = [_signature(b) for b in blocks[:p]]
    for i in range(p, len(blocks)):
        mine, theirs = _signature(blocks[i]), signatures[i % p]
        if mine != theirs:
            at = next((j for j, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
            said = [f"{which} has {sig[at]}" if at < len(sig) else f"{which} has nothing more"
                    for which, sig in ((f"block {i}", mine), (f"block {i % p}", theirs))]
            return ", ".join(said)
    return None


def _signature(block: nn.Module) -> "list[str]":
    """What a block is, for :func:`unlike`, in words."""
    out = []
    for path, m in block.named_modules():
        hooks = [len(getattr(m, h, None) or ()) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                         "_backward_pre_hooks")]
        settings = sorted(_setting(key, value) for key, value in vars(m).items()
                          if isinstance(value, (str, bool, float, int, type(None))) and not key.startswith("_"))
        out.append(f"module {path or '(the block)'} {type(m).__qualname__} training={m.training} hooks={hooks} "
                   f"{' '.join(settings)}".rstrip())
    out += [f"parameter {n} {tuple(t.shape)} {t.dtype} requires_grad={t.requires_grad}"
            for n, t in block.named_parameters()]
    out += [f"buffer {n} {tuple(t.shape)} {t.dtype}" for n, t in block.named_buffers()]
    return out


def _setting(key: str, value: "str | bool | float | int | None") -> str:
    """A module's setting as :func:`_signature` compares it: words and flags as they are; a float by whether it is
    0 (a dropout's rate: a mask or none); an int or None by whether it is set (a layer's index differs between
    blocks and changes no memory; a sliding window given to some layers and not to others does)."""
    if isinstance(value, (str, bool)):
        return f"{key}={value!r}"
    if isinstance(value, float):
        return f"{key}{'=' if value == 0 else '!='}0"
    return f"{key} {'unset' if value is None else 'set'}"
