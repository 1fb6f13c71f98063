"""A CUDA target runs attention and dropout as a CUDA device does: the fused attention kernel torch would
pick (its output and an fp32 logsumexp saved, not the s x s scores) and 1-byte dropout masks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memprof
from memprof import Category as C
from memprof.errors import InvalidArgumentError, UnknownNameError


class _Attention(nn.Module):
    def __init__(self, hidden, heads, p):
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in self.qkv(x).split(h, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class _Block(nn.Module):
    """A pre-LN GPT block, as Korthikanti et al. (2022), section 4.1, count its activations."""

    def __init__(self, hidden, heads, p=0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = _Attention(hidden, heads, p)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.drop1, self.drop2 = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


def _saved_per_layer(s, b=2, h=256, a=4, p=0.0, attention="auto"):
    with torch.device("meta"):
        block = _Block(h, a, p)
    est = memprof.estimate(block, None, inputs=torch.empty(b, s, h), device="cuda", precision="bf16",
                           attention=attention)
    forward = next(ph for ph in est.trace.phases if ph.phase.value == "forward")
    # The block's input is saved by ln1 (Korthikanti count it), but is the model's input: in inputs.
    return forward.end[C.ACTIVATIONS] + 2 * s * b * h, est


@pytest.mark.parametrize("s", [256, 512, 1024])
def test_a_bf16_block_with_flash_saves_32sbh_plus_4asb(s):
    b, h, a = 2, 256, 4
    saved, est = _saved_per_layer(s)
    # Korthikanti's 34sbh less the two dropout masks (no dropout), no 5as^2b (flash keeps no scores),
    # plus flash's fp32 logsumexp (4asb), the two layer norms' fp32 mean and rstd (2 * 2 * 4 * sb = 16sb)
    # and flash's RNG seed and offset (two tiny tensors, 512 bytes each in CUDA's allocator).
    assert saved == 32 * s * b * h + 4 * a * s * b + 16 * s * b + 2 * 512
    assert any("flash x2" in n for n in est.notes)  # two steps, one attention call each


def test_the_math_path_keeps_the_scores_and_dropout_keeps_1_byte_masks():
    s, b, h, a = 256, 2, 256, 4
    flash, _ = _saved_per_layer(s)
    math, est = _saved_per_layer(s, attention="math")
    # The math path saves the softmax (2 bytes x a s^2 b, bf16) and more: never less than flash.
    assert math - flash >= 2 * a * s * s * b
    assert any("math x2" in n for n in est.notes)
    dropped, est = _saved_per_layer(s, p=0.1)
    # Two dropout masks of one byte per element (sbh each); flash's own dropout keeps no mask.
    assert dropped - flash == 2 * s * b * h
    assert any("dropout, 1-byte masks x4" in n for n in est.notes)


def test_fp32_attention_with_a_mask_takes_the_memory_efficient_kernel():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x, mask):
            q = self.lin(x).view(2, 16, 4, 16).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum()

    with torch.device("meta"):
        model = Masked()
    est = memprof.estimate(model, None, inputs=(torch.empty(2, 16, 64), torch.ones(16, 16, dtype=torch.bool)),
                           device="cuda", loss_fn=lambda out: out)
    assert any("memory-efficient x2" in n for n in est.notes)


def test_attention_overrides_are_checked():
    model = nn.Linear(4, 4)
    with pytest.raises(UnknownNameError, match="unknown attention kernel"):
        memprof.estimate(model, None, inputs=torch.empty(2, 4), device="cuda", attention="fastest")
    with pytest.raises(InvalidArgumentError, match="chooses a CUDA kernel"):
        memprof.estimate(model, None, inputs=torch.empty(2, 4), device="cpu", attention="flash")


def test_the_planner_and_the_cli_take_the_attention_kernel(tmp_path, monkeypatch, capsys):
    from memprof.cli import main

    with torch.device("meta"):
        block = _Block(64, 4)
    make = lambda b: torch.empty(b, 128, 64)  # noqa: E731
    flash = memprof.max_batch_size(block, None, make, "64 MiB", device="cuda", multiple_of=1)
    math = memprof.max_batch_size(block, None, make, "64 MiB", device="cuda", multiple_of=1, attention="math")
    assert math.batch_size < flash.batch_size  # the scores the math path keeps cost room
    (tmp_path / "blk.py").write_text(
        "import torch\n"
        "from tests.integration.test_sim_kernels import _Block\n"
        "def build(batch_size):\n"
        "    return {'model': _Block(64, 4), 'inputs': torch.empty(batch_size, 128, 64)}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert main(["estimate", "blk:build", "--batch-size", "2", "--precision", "bf16", "--optimizer", "none",
                 "--attention", "math"]) == 0
    assert "math x2" in capsys.readouterr().out


class _Attend(nn.Module):
    """q from a projection; k and v with ``kv`` heads (grouped-query attention when fewer)."""

    def __init__(self, heads=8, kv=8, head_dim=16):
        super().__init__()
        self.heads, self.kv, self.d = heads, kv, head_dim
        self.q = nn.Linear(64, heads * head_dim)
        self.kv_proj = nn.Linear(64, 2 * kv * head_dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.d).transpose(1, 2)
        k, v = (t.view(b, s, self.kv, self.d).transpose(1, 2) for t in self.kv_proj(x).chunk(2, -1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.heads).sum()


def _kernel_estimate(precision=None, attention="auto", **kwargs):
    with torch.device("meta"):
        model = _Attend(**kwargs)
    return memprof.estimate(model, None, inputs=torch.empty(2, 64, 64), device="cuda", precision=precision,
                            loss_fn=lambda out: out, attention=attention)


def test_grouped_query_attention_takes_flash_natively_or_falls_back_to_math():
    flash = _kernel_estimate("bf16", kv=2)
    assert any("flash x2" in n for n in flash.notes) and not any("expanded" in n for n in flash.notes)
    # fp32 rules flash out, and the memory-efficient kernel takes no grouped-query attention: math.
    fp32 = _kernel_estimate(kv=2)
    assert any("math x2" in n for n in fp32.notes)
    assert fp32.peak_bytes == _kernel_estimate(kv=2, attention="math").peak_bytes
    with pytest.raises(InvalidArgumentError, match="could not run this attention"):
        _kernel_estimate(kv=2, attention="efficient")


def test_a_head_dim_off_the_multiple_of_8_is_padded_for_flash():
    est = _kernel_estimate("bf16", head_dim=12)
    assert any("flash head dim padded to a multiple of 8 x2" in n for n in est.notes)
    # Far below the math path, which keeps the 64 x 64 scores of every head.
    assert est.peak_bytes < _kernel_estimate("bf16", head_dim=12, attention="math").peak_bytes


def test_a_kernel_the_device_could_not_run_is_refused():
    with pytest.raises(InvalidArgumentError, match="torch would raise 'No available kernel'"):
        _kernel_estimate(attention="flash")  # fp32: flash takes fp16/bf16 only
