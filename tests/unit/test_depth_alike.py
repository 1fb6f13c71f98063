"""The depth fast path's precondition: every block of the stack is like the cuts' (memprof.simulate.depth_blocks.unlike)."""

from __future__ import annotations

import torch
from torch import nn

from memprof.simulate.depth_blocks import unlike as _unlike


class Block(nn.Module):
    def __init__(self, p: float = 0.0, kind: str = "full") -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(p)


def _stack(*blocks: nn.Module) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(blocks)
    return model


def test_blocks_alike_and_a_period_of_kinds_pass():
    assert _unlike(_stack(*(Block() for _ in range(6))), "layers") is None
    assert _unlike(_stack(*(Block(kind=k) for k in ["sliding", "full"] * 3)), "layers") is None


def test_a_frozen_block_is_named_with_what_differs():
    model = _stack(*(Block() for _ in range(6)))
    model.layers[5].fc.weight.requires_grad_(False)
    said = _unlike(model, "layers")
    assert said is not None and said.startswith("block 5 has parameter fc.weight (4, 4) torch.float32 "
                                                "requires_grad=False, block 0 has parameter fc.weight")


def test_a_hook_of_one_block_and_a_dropout_that_turns_on_differ():
    model = _stack(*(Block() for _ in range(6)))
    model.layers[3].register_forward_hook(lambda m, i, o: None)
    assert "block 3 has module (the block) Block training=True hooks=[1, 0, 0, 0]" in (_unlike(model, "layers") or "")
    # A drop path's rate growing with depth: 0 saves no mask, any other rate does; the rate itself is no kind.
    model = _stack(*(Block(p=0.1 * i) for i in range(6)))
    assert (_unlike(model, "layers") or "").startswith("block 1 has module drop Dropout")
    assert _unlike(_stack(*(Block(p=0.1 + 0.1 * i) for i in range(6))), "layers") is None


def test_a_block_in_eval_mode_differs():
    model = _stack(*(Block() for _ in range(6)))
    model.layers[4].eval()
    assert (_unlike(model, "layers") or "").startswith("block 4 has module (the block) Block training=False")


def test_a_setting_given_to_some_blocks_only_differs_and_an_index_does_not():
    # A sliding window on the later layers only (Qwen2's max_window_layers): set or not is what matters; a layer's
    # own index, set on every block, is no difference.
    blocks = [Block() for _ in range(6)]
    for i, b in enumerate(blocks):
        b.layer_idx, b.window = i, (None if i < 4 else 4096)
    assert (_unlike(_stack(*blocks), "layers") or "").startswith("block 4 has module (the block) Block")
    for b in blocks:
        b.window = 4096
    assert _unlike(_stack(*blocks), "layers") is None


class Windowed(Block):
    """Cohere2's layers: every fourth one has no sliding window (None), the others 4096; nothing else tells them."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.layer_idx, self.window = i, None if i % 4 == 3 else 4096


class NoRope(Block):
    """Llama 4's layers: every fourth one lacks the q/k norm the others hold."""

    def __init__(self, i: int) -> None:
        super().__init__()
        if i % 4 != 3:
            self.qk_norm = nn.LayerNorm(4, elementwise_affine=False)


def test_a_period_told_by_a_window_or_a_module_some_blocks_lack():
    from memprof.simulate.depth_blocks import period

    for cls in (Windowed, NoRope):
        model = _stack(*(cls(i) for i in range(8)))
        assert (period(model, "layers"), _unlike(model, "layers")) == (4, None)


def test_an_int_that_is_no_index_a_dtype_and_shared_parameters_differ():
    blocks = [Block() for _ in range(6)]
    for i, b in enumerate(blocks):
        b.repeats = 1 if i < 4 else 8  # an int that is not the block's index: its value counts
    assert (_unlike(_stack(*blocks), "layers") or "").startswith("block 4 has module (the block) Block")
    blocks = [Block() for _ in range(6)]
    blocks[5].compute = torch.float64
    blocks[0].compute = blocks[1].compute = blocks[2].compute = blocks[3].compute = blocks[4].compute = torch.float32
    assert "compute=torch.float64" in (_unlike(_stack(*blocks), "layers") or "")
    blocks = [Block() for _ in range(6)]
    blocks[4].fc.weight = blocks[0].fc.weight  # tied across blocks: the cut holds block 0's, the line counts 4's
    assert _unlike(_stack(*blocks), "layers") == "block 4 shares its parameter fc.weight with block 0"


def test_a_period_that_does_not_divide_the_stack_is_no_period():
    # One block unlike five: "period 5" in 6 blocks would call them alike.
    model = _stack(*(Block() for _ in range(6)))
    model.layers[4].fc.weight.requires_grad_(False)
    assert (_unlike(model, "layers") or "").startswith("block 4 has parameter fc.weight")


def test_hooks_for_every_module_refuse():
    # A feature tap registered for every module may keep the outputs of the later blocks only: no block shows it
    # (found by this stop's review: a peak 32 % under the whole model's on the CPU).
    from torch.nn.modules.module import register_module_forward_hook

    model = _stack(*(Block() for _ in range(6)))
    handle = register_module_forward_hook(lambda m, i, o: None)
    try:
        assert _unlike(model, "layers") == ("hooks for every module are registered (global_forward_hooks), which "
                                            "may act on some blocks only")
    finally:
        handle.remove()
    assert _unlike(model, "layers") is None
