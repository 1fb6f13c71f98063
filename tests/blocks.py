"""A Megatron-like transformer block, shared by the anatomy and reconciler tests."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def _dropout(x, p, train=True):
    out, mask = torch.ops.aten.native_dropout(x, p, train)  # the CUDA path: bool mask, 1 B/element
    return out


class Block(nn.Module):
    """Megatron-style pre-LN block in [s, b, h] layout."""

    def __init__(self, h, a, *, p=0.1, attention="eager", mlp="gelu", ffn=None):
        super().__init__()
        self.h, self.a, self.p, self.attention, self.mlp = h, a, p, attention, mlp
        f = ffn or 4 * h
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        if mlp == "gelu":
            self.fc1 = nn.Linear(h, f)
        else:
            self.gate = nn.Linear(h, f, bias=False)
            self.up = nn.Linear(h, f, bias=False)
        self.fc2 = nn.Linear(f, h)

    def forward(self, x):
        s, b, h = x.shape
        a, d = self.a, h // self.a
        q, k, v = self.qkv(self.ln1(x)).view(s, b, a, 3 * d).permute(1, 2, 0, 3).chunk(3, dim=-1)
        if self.attention == "eager":
            scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
            probs = torch.softmax(scores, dim=-1)
            if self.p:
                probs = _dropout(probs, self.p)
            ctx = probs @ v
        else:
            ctx = F.scaled_dot_product_attention(q, k, v)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, h)
        out = self.proj(ctx)
        if self.p:
            out = _dropout(out, self.p)
        x = x + out
        y = self.ln2(x)
        if self.mlp == "gelu":
            y = self.fc2(F.gelu(self.fc1(y)))
        else:
            y = self.fc2(F.silu(self.gate(y)) * self.up(y))
        if self.p:
            y = _dropout(y, self.p)
        return x + y
