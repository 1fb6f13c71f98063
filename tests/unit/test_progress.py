"""Progress shows in an interactive terminal only, and only with tqdm."""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

import memprof
from memprof.simulate import progress


class _FakeTqdm:
    made: list["_FakeTqdm"] = []

    def __init__(self, total=None, desc="", **kwargs):
        self.total, self.desc, self.updates, self.notes, self.closed = total, desc, 0, [], False
        _FakeTqdm.made.append(self)

    def update(self, n):
        self.updates += n

    def set_postfix_str(self, note, refresh=True):
        self.notes.append(note)

    def close(self):
        self.closed = True


def _fake_tqdm(monkeypatch):
    _FakeTqdm.made = []
    import importlib.machinery

    fake = types.ModuleType("tqdm")
    fake.__spec__ = importlib.machinery.ModuleSpec("tqdm", None)
    fake.tqdm = _FakeTqdm
    monkeypatch.setitem(sys.modules, "tqdm", fake)


def test_nothing_is_shown_where_nobody_watches(monkeypatch):
    _fake_tqdm(monkeypatch)
    monkeypatch.delenv("MEMPROF_PROGRESS", raising=False)
    monkeypatch.setenv("CI", "true")
    assert not progress.wanted()
    monkeypatch.delenv("CI")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)  # a pipe, a file, a notebook
    assert not progress.wanted()
    with progress.Progress(3, "x") as bar:
        bar.step("a")
    assert _FakeTqdm.made == []


def test_max_batch_size_shows_each_simulation_in_a_terminal(monkeypatch):
    _fake_tqdm(monkeypatch)
    monkeypatch.setenv("MEMPROF_PROGRESS", "1")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    plan = memprof.max_batch_size(model, None, lambda b: torch.empty(b, 64), "1 MiB", device="cpu")
    (bar,) = _FakeTqdm.made
    assert bar.desc == "max_batch_size" and bar.closed
    assert bar.updates == len(plan.points)  # one step per simulation run
    assert bar.notes[0] == "batch size 8"
    monkeypatch.setenv("MEMPROF_PROGRESS", "0")
    memprof.max_batch_size(model, None, lambda b: torch.empty(b, 64), "1 MiB", device="cpu")
    assert len(_FakeTqdm.made) == 1
