"""The framework callbacks against the real frameworks: tiny models built from configs, no downloads."""

from __future__ import annotations

import csv
import functools
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


def _storage_bytes(*objs):
    """Bytes of the distinct storages of the tensors in ``objs`` (nested in lists, tuples and dicts)."""
    seen = {}

    def walk(o):
        if isinstance(o, torch.Tensor):
            seen[o.untyped_storage()._cdata] = o.untyped_storage().nbytes()
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x)
        elif isinstance(o, dict):
            for x in o.values():
                walk(x)

    walk(objs)
    return sum(seen.values())


def _logged_as_reported(logged, step):
    """``logged`` (one log line's memprof metrics) holds exactly what the report has for ``step``, at the
    moment of its highest phase peak: a category the report calls not measured is absent, never a number."""
    top = max(step.phases, key=lambda p: p.peak.total)
    for c in C:
        key, value = f"memprof/{c.value}_bytes", top.peak[c]
        if value is None:
            assert key not in logged, f"{key} logged as {logged.get(key)!r}, but the report says not measured"
        else:
            assert int(logged[key]) == value, key
    assert int(logged["memprof/peak_bytes"]) == top.peak.total


def test_a_framework_older_than_supported_is_refused_with_the_fix():
    from memprof.integrations import require

    with pytest.raises(InvalidArgumentError, match=r"needs lightning >= 2.0, found 1.9.5.*torch-memprof\[lightning\]"):
        require("lightning", "lightning", (2, 0), "1.9.5")
    require("lightning", "lightning", (2, 0), "2.6.6+cpu")


def test_mark_inputs_counts_a_batch_made_in_the_block_as_inputs_and_names_misuse():
    from memprof.errors import ProfilerStateError

    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    prof = memprof.Profiler(model)
    with pytest.raises(ProfilerStateError, match=r"mark_inputs\(\) is only valid while the profiler runs"):
        prof.mark_inputs(torch.ones(1))
    prof.start()
    batch = [torch.randn(8, 16), torch.randn(8, 1)]  # made inside: temporaries until marked
    prof.mark_inputs({"batch": batch})
    model(batch[0]).sum().backward()
    del batch
    prof.stop()
    # 8 x 16 + 8 x 1 float32 = 544 B while they lived (the model's call alone marks x, 512 B, not the target).
    (forward,) = [p for p in prof.report().trace.steps[0].phases if p.phase.value == "forward"]
    assert forward.peak[C.INPUTS] == 544 and prof.report().end[C.INPUTS] == 0


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


def test_the_trainer_with_torch_compile_profiles_the_compiled_model_it_calls(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from memprof.integrations.transformers import MemprofCallback

    handed = []  # what the Trainer hands the model it calls, each call, seen from outside memprof

    class Watched(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if not handed:
                model.register_forward_pre_hook(lambda m, a, k: handed.append(_storage_bytes(a, k)), with_kwargs=True)
            return super().training_step(model, inputs, num_items_in_batch)

    class Record(TrainerCallback):
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                self.logs.append((state.global_step, dict(logs)))

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    # The eager backend: dynamo's wrapper and its frame as with inductor, without inductor's compile time.
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             seed=0, torch_compile=True, torch_compile_backend="eager")
    record, cb = Record(), MemprofCallback()
    trainer = Watched(model=model, args=args, train_dataset=_Tokens(), callbacks=[record, cb])
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    rep = cb.report
    assert rep.num_steps == 3 and all("forward" in _kinds(s) for s in rep.trace.steps)
    # At step 0's peak (in backward) the inputs are what the model was handed: the batch (input_ids and labels,
    # 4 x 16 int64 each, 2 x 512 B) and the token count the Trainer passes along; nothing else yet.
    top = max(rep.trace.steps[0].phases, key=lambda p: p.peak.total)
    assert top.phase.value == "backward" and handed[0] >= 1024 and top.peak[C.INPUTS] == handed[0]
    assert [step for step, _ in record.logs] == [1, 2, 3]
    for (_, logs), step in zip(record.logs, rep.trace.steps):
        _logged_as_reported({k: v for k, v in logs.items() if k.startswith("memprof/")}, step)
    assert record.logs[0][1]["memprof/inputs_bytes"] == handed[0]


# ---------------------------------------------------------------------- Lightning


def _lightning():
    """Lightning, imported by the tests that use it: at module level every test process imported it while
    collecting, and a machine without it skipped the whole module, the other frameworks' tests too."""
    return pytest.importorskip("lightning.pytorch")


@functools.cache
def _regression_type():
    L = _lightning()

    class Regression(L.LightningModule):
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

    return Regression


def _Regression(**kwargs):
    return _regression_type()(**kwargs)


def _fit(tmp_path, module, callbacks, accumulate=1, steps=4, data=None):
    L = _lightning()
    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    data = data if data is not None else torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
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


class _Pairs(torch.utils.data.Dataset):
    """64 (x, y) pairs made when asked for: no tensor of the data exists before training."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randn(1, generator=g)


@pytest.mark.parametrize("compiled", [False, True])
def test_lightning_logs_only_what_the_report_measured_and_the_batch_as_inputs(tmp_path, compiled):
    from memprof.integrations.lightning import MemprofCallback

    batches = []

    class Batches(_lightning().Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batches.append(_storage_bytes(batch))

    torch.manual_seed(0)
    module = _Regression()
    cb = MemprofCallback()
    # fit(torch.compile(m)): Lightning unwraps it and compiles training_step, where no hook of memprof's runs.
    _fit(tmp_path, torch.compile(module, backend="eager") if compiled else module, [cb, Batches()], data=_Pairs())
    rep = cb.report
    # Each batch: x 8 x 16 and y 8 x 1 float32, (128 + 8) x 4 = 544 B.
    assert batches == [544] * 4
    optimizer_phases = [p for step in rep.trace.steps for p in step.phases if p.phase.value == "optimizer"]
    assert [p.peak[C.INPUTS] for p in optimizer_phases] == [544] * 4
    (path,) = glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)
    rows = list(csv.DictReader(open(path)))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    for row, step in zip(rows, rep.trace.steps):
        _logged_as_reported({k: v for k, v in row.items() if k.startswith("memprof/") and v != ""}, step)
    # Compiled, the forward runs where memprof cannot see: activations are not measured, and not logged.
    assert (rep.peak[C.ACTIVATIONS] is None) == compiled
