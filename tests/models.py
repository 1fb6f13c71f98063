"""Small models used by the tests (deterministic: no dropout unless asked)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in=32, hidden=64, d_out=10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        return self.head(x.flatten(1))


class TiedTransformer(nn.Module):
    def __init__(self, vocab=50, d=32, heads=4, layers=2, seq=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.enc(self.emb(idx) + self.pos[: idx.shape[1]]))


class LSTMTagger(nn.Module):
    def __init__(self, vocab=40, d=16, hidden=24, tags=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, batch_first=True)
        self.out = nn.Linear(hidden, tags)

    def forward(self, idx):
        h, _ = self.lstm(self.emb(idx))
        return self.out(h)


def make(name):
    """(model, make_batch, loss_fn) for a model name."""
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        m = MLP()
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        return m, (x, y), lambda out, y: F.cross_entropy(out, y)
    if name == "cnn":
        m = CNN()
        x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
        return m, (x, y), lambda out, y: F.cross_entropy(out, y)
    if name == "transformer":
        m = TiedTransformer()
        x, y = torch.randint(0, 50, (3, 16), generator=g), torch.randint(0, 50, (3, 16), generator=g)
        return m, (x, y), lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
    if name == "lstm":
        m = LSTMTagger()
        x, y = torch.randint(0, 40, (4, 12), generator=g), torch.randint(0, 5, (4, 12), generator=g)
        return m, (x, y), lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
    raise KeyError(name)


MODEL_NAMES = ["mlp", "cnn", "transformer", "lstm"]
