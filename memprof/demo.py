"""Small built-in models for the demo, the docs and the benchmarks (no downloads)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyGPT", "synthetic_tokens"]


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        # Eager attention, as Korthikanti et al. count it: the s x s scores are saved.
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.heads))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = self.dropout(scores.masked_fill(mask, float("-inf")).softmax(dim=-1))
        out = (probs @ v).transpose(1, 2).reshape(b, s, h)
        y: torch.Tensor = self.dropout(self.proj(out))  # typed: nn.Module.__call__ returns an untyped value
        return y


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        y: torch.Tensor = x + self.mlp(self.ln2(x))  # typed: nn.Module.__call__ returns an untyped value
        return y


class TinyGPT(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-LN blocks, tied LM head."""

    def __init__(self, vocab: int = 1000, hidden: int = 256, layers: int = 4, heads: int = 4,
                 max_seq: int = 256, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_seq, hidden)
        self.blocks = nn.ModuleList([Block(hidden, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one storage, counted once

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))  # typed: nn.Module.__call__ returns an untyped value
        return logits

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def synthetic_tokens(batch: int, seq: int, vocab: int, *, device: "str | torch.device" = "cpu",
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets (deterministic for a seed)."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)
