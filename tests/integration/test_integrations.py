"""The framework callbacks against the real frameworks: tiny models built from configs, no downloads."""

from __future__ import annotations

import csv
import glob
import os
import warnings

import pytest
import torch
from torch import nn

import memprof
from memprof import Category as C
from memprof.errors import InvalidArgumentError, MemprofWarning

from helpers import hook_registry, optimizer_state_bytes, weight_bytes

METRICS = {"memprof/peak_bytes"} | {f"memprof/{c.value}_bytes" for c in C if c.value not in
                                    ("allocator_overhead", "outside_torch")}


def test_a_framework_older_than_supported_is_refused_with_the_fix():
    from memprof.integrations import require

    with pytest.raises(InvalidArgumentError, match=r"needs lightning >= 2.0, found 1.9.5.*torch-memprof\[lightning\]"):
        require("lightning", "lightning", (2, 0), "1.9.5")
    require("lightning", "lightning", (2, 0), "2.6.6+cpu")


# ---------------------------------------------------------------------- HF Trainer


transformers = pytest.importorskip("transformers")


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _hf_train(tmp_path, callbacks, steps=6):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=steps,
                             logging_steps=2, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=callbacks)
    trainer.train()
    return trainer


def test_the_trainer_is_profiled_and_trains_as_without_memprof(tmp_path):
    from transformers import TrainerCallback

    from memprof.integrations.transformers import MemprofCallback

    class Record(TrainerCallback):  # a reporting callback, added before memprof's as report_to's are
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    plain = _hf_train(tmp_path, [])
    record, cb = Record(), MemprofCallback(save_dir=tmp_path / "memprof")
    trainer = _hf_train(tmp_path, [record, cb])
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), trainer.model.parameters()))
    rep = cb.report
    assert rep.num_steps == 6
    assert rep.end[C.WEIGHTS] == weight_bytes(trainer.model)
    assert rep.end[C.OPTIMIZER_STATES] == optimizer_state_bytes(trainer.optimizer.optimizer)
    # Every training log line (steps 2, 4, 6) carries the step's memory, under exactly these names.
    train_logs = [log for log in record.logs if "loss" in log]
    assert len(train_logs) == 3 and all(METRICS <= set(log) for log in train_logs)
    assert all(isinstance(log["memprof/peak_bytes"], int) for log in train_logs)
    assert METRICS <= set(trainer.state.log_history[0])
    assert os.listdir(tmp_path / "memprof") == ["memprof-rank0.json"]
    assert memprof.load(tmp_path / "memprof" / "memprof-rank0.json").trace == rep.trace
    assert hook_registry(trainer.model) == hook_registry(plain.model)


def test_the_trainer_with_a_schedule_saves_each_window(tmp_path):
    from memprof.integrations.transformers import MemprofCallback

    cb = MemprofCallback(schedule=memprof.schedule(wait=1, active=2), save_dir=tmp_path / "mp")
    _hf_train(tmp_path, [cb], steps=6)
    assert sorted(os.listdir(tmp_path / "mp")) == ["memprof-rank0-steps-1-2.json", "memprof-rank0-steps-4-5.json",
                                                   "memprof-rank0.json"]
    assert cb.report.trace.recorded_steps == ((1, 2), (4, 5))


# A schedule whose step after the last one (6) would be recorded, after a warmup step (5): the callback
# closes step 5 at its end, and what the Trainer does after it (zero_grad) must not become a step 6.
WARMUP_LAST = [
    (dict(skip_first=1, warmup=1, active=1), ((2, 2), (4, 4))),  # 0 skip, 1 W, 2 A, 3 W, 4 A, 5 W
    (dict(wait=1, warmup=1, active=2), ((2, 3),)),  # 0 wait, 1 W, 2-3 A, 4 wait, 5 W
]


def _ran_as_scheduled(rep, folder, recorded):
    assert rep.num_steps == 6
    assert rep.trace.recorded_steps == recorded
    assert [s.index for s in rep.trace.steps] == [i for a, b in recorded for i in range(a, b + 1)]
    # The run's peak lies in a recorded step (a warmup step's peak is forgotten, the steps before it are not).
    assert any(a <= rep.trace.peak_step <= b for a, b in recorded)
    assert rep.peak.total == max(p.peak.total for s in rep.trace.steps for p in s.phases)
    assert sorted(os.listdir(folder)) == sorted([f"memprof-rank0-steps-{a}-{b}.json" for a, b in recorded]
                                                + ["memprof-rank0.json"])


@pytest.mark.parametrize("plan, recorded", WARMUP_LAST)
def test_the_trainer_with_a_schedule_counts_only_the_steps_that_ran(tmp_path, plan, recorded):
    from memprof.integrations.transformers import MemprofCallback

    cb = MemprofCallback(schedule=memprof.schedule(**plan), save_dir=tmp_path / "mp")
    trainer = _hf_train(tmp_path, [cb], steps=6)
    assert trainer.state.global_step == 6
    _ran_as_scheduled(cb.report, tmp_path / "mp", recorded)


# ---------------------------------------------------------------------- Lightning


L = pytest.importorskip("lightning.pytorch")


class _Regression(L.LightningModule):
    def __init__(self, manual=False, fail_at=None, error=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.automatic_optimization = not manual
        self.fail_at = fail_at
        self.error = error or RuntimeError("boom")

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise self.error
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(tmp_path, module, callbacks, accumulate=1, steps=4):
    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    trainer = L.Trainer(max_steps=steps, callbacks=callbacks, logger=CSVLogger(str(tmp_path)), accelerator="cpu",
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        accumulate_grad_batches=accumulate, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and logging intervals
        warnings.simplefilter("always", MemprofWarning)  # memprof's own reach the test
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return trainer


def _kinds(step):
    return [p.phase.value for p in step.phases if p.phase.value != "other"]


@pytest.mark.parametrize("manual, accumulate, expected", [
    (False, 1, ["forward", "backward", "optimizer"]),  # forward and backward run inside optimizer.step(closure)
    (True, 1, ["forward", "backward", "optimizer"]),
    (False, 2, ["forward", "backward", "forward", "backward", "optimizer"]),
])
def test_lightning_phases_are_right_in_every_optimisation_style(tmp_path, manual, accumulate, expected):
    from memprof.integrations.lightning import MemprofCallback

    torch.manual_seed(0)
    module = _Regression(manual=manual)
    cb = MemprofCallback()
    _fit(tmp_path, module, [cb], accumulate=accumulate)
    rep = cb.report
    assert rep.num_steps == 4
    assert all(_kinds(s) == expected for s in rep.trace.steps)
    assert rep.end[C.WEIGHTS] == weight_bytes(module)


def test_lightning_logs_the_metrics_and_trains_as_without_memprof(tmp_path):
    from memprof.integrations.lightning import MemprofCallback

    torch.manual_seed(0)
    plain = _Regression()
    _fit(tmp_path / "plain", plain, [])
    torch.manual_seed(0)
    module = _Regression()
    _fit(tmp_path / "profiled", module, [MemprofCallback()])
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), module.parameters()))
    (path,) = glob.glob(str(tmp_path / "profiled" / "**" / "metrics.csv"), recursive=True)
    rows = list(csv.DictReader(open(path)))
    assert METRICS <= set(rows[0]) and [r["step"] for r in rows] == ["0", "1", "2", "3"]


def test_lightning_removes_every_hook_when_training_raises(tmp_path):
    from memprof.integrations.lightning import MemprofCallback

    module = _Regression(fail_at=2)
    before = hook_registry(module)
    cb = MemprofCallback()
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, module, [cb])
    assert cb.profiler is None and cb.report is not None and cb.report.num_steps == 2
    after = hook_registry(module)
    # Gradients exist now and were not there before: they must carry no hook either.
    assert {k: v for k, v in after.items() if k in before} == before
    assert all(v == 0 for k, v in after.items() if k not in before)


def test_lightning_writes_an_oom_dump_when_training_runs_out_of_memory(tmp_path):
    from memprof.integrations.lightning import MemprofCallback

    err = torch.OutOfMemoryError("CUDA out of memory (simulated)")
    module = _Regression(fail_at=2, error=err)
    cb = MemprofCallback(oom_dump=tmp_path / "dumps")
    with pytest.raises(torch.OutOfMemoryError) as info:
        _fit(tmp_path, module, [cb])
    assert info.value is err
    (dump,) = glob.glob(str(tmp_path / "dumps" / "memprof-oom-0-*.json"))
    trace = memprof.load(dump).trace
    assert trace.oom.message == "OutOfMemoryError: CUDA out of memory (simulated)"
    assert trace.live_at_error[C.WEIGHTS] == weight_bytes(module)
    assert cb.report.trace.oom == trace.oom


@pytest.mark.parametrize("plan, recorded", WARMUP_LAST)
def test_lightning_with_a_schedule_counts_only_the_steps_that_ran(tmp_path, plan, recorded):
    from memprof.integrations.lightning import MemprofCallback

    cb = MemprofCallback(schedule=memprof.schedule(**plan), save_dir=tmp_path / "mp")
    trainer = _fit(tmp_path, _Regression(), [cb], steps=6)
    assert trainer.global_step == 6
    _ran_as_scheduled(cb.report, tmp_path / "mp", recorded)
