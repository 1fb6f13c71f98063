"""The framework callbacks when what they do on the side fails: a save that cannot be written, a report that
cannot be built, a folder that is no folder. Training must go on exactly as without memprof, with a
warning naming what failed, and an exception of the user's own must come through unchanged."""

from __future__ import annotations

import errno
import shutil
import warnings

import pytest
import torch

import memprof
from memprof.errors import InvalidArgumentError, MemprofWarning

from helpers import hook_registry
from test_integrations import _fit, _hf_train, _lightning, _Regression


def _disk_full(monkeypatch):
    """Every file memprof writes fails as on a full disk (the one function all its writers end in)."""
    import memprof.record.files

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(memprof.record.files, "write_bytes_atomic", full)


def _memprof_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, MemprofWarning)]


def _same_params(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


# ------------------------------------------------------------------ save_dir checked up front


@pytest.mark.parametrize("framework", ["transformers", "lightning"])
def test_a_save_dir_that_cannot_be_a_folder_is_refused_when_the_callback_is_made(tmp_path, framework):
    callback = pytest.importorskip(f"memprof.integrations.{framework}").MemprofCallback
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    with pytest.raises(InvalidArgumentError, match=r"save_dir=.*afile.* is a file, not a folder"):
        callback(save_dir=afile)
    # A folder beneath a file cannot be created (NotADirectoryError from os.makedirs without the check).
    with pytest.raises(InvalidArgumentError, match=r"save_dir=.*afile/sub.*memprof cannot write there"):
        callback(save_dir=afile / "sub")
    with pytest.raises(InvalidArgumentError, match=r"oom_dump=.*afile.* is a file, not a folder"):
        callback(oom_dump=afile)
    fresh = callback(save_dir=tmp_path / "new" / "deeper")  # a folder that does not exist yet is made
    assert (tmp_path / "new" / "deeper").is_dir() and fresh.report is None


# ------------------------------------------------------------------ HF Trainer


def test_the_trainer_trains_on_when_every_save_fails(tmp_path, monkeypatch):
    from memprof.integrations.transformers import MemprofCallback

    plain = _hf_train(tmp_path / "plain", [])
    _disk_full(monkeypatch)
    cb = MemprofCallback(schedule=memprof.schedule(wait=1, active=2), save_dir=tmp_path / "mp")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = _hf_train(tmp_path / "profiled", [cb], steps=6)
    assert trainer.state.global_step == 6 and _same_params(plain.model, trainer.model)
    said = _memprof_warnings(record)
    # The windows of steps 1-2 and 4-5, then the whole run: each failure named, file and OS error.
    assert [s.split(" (")[0] for s in said] == [
        f"memprof could not save {tmp_path / 'mp' / name}" for name in
        ("memprof-rank0-steps-1-2.json", "memprof-rank0-steps-4-5.json", "memprof-rank0.json")]
    assert all("No space left on device" in s for s in said)
    assert cb.report.num_steps == 6 and cb.report.trace.recorded_steps == ((1, 2), (4, 5))
    assert hook_registry(trainer.model) == hook_registry(plain.model)


def test_cb_stop_after_a_failed_train_never_raises_when_the_save_fails(tmp_path, monkeypatch):
    from transformers import TrainerCallback

    from memprof.integrations.transformers import MemprofCallback

    class Fails(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise RuntimeError("the user's own failure")

    _disk_full(monkeypatch)
    cb = MemprofCallback(save_dir=tmp_path / "mp")
    with pytest.raises(RuntimeError, match="the user's own failure") as info:
        _hf_train(tmp_path, [cb, Fails()])
    with pytest.warns(MemprofWarning, match=r"could not save .*memprof-rank0.json.*No space left on device"):
        cb.stop(info.value)
    assert cb.report.num_steps == 3 and cb.report.trace.error == "RuntimeError: the user's own failure"


def test_a_report_that_cannot_be_built_is_a_warning_not_the_end_of_training(tmp_path, monkeypatch):
    from memprof.integrations.transformers import MemprofCallback
    from memprof.report.profiling import Profiler

    plain = _hf_train(tmp_path / "plain", [])

    def broken(self):
        raise RuntimeError("report failed")

    monkeypatch.setattr(Profiler, "report", broken)
    cb = MemprofCallback(schedule=memprof.schedule(active=3), save_dir=tmp_path / "mp")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = _hf_train(tmp_path / "profiled", [cb])
    assert trainer.state.global_step == 6 and _same_params(plain.model, trainer.model)
    said = _memprof_warnings(record)
    # Two windows (steps 0-2, 3-5) at the step's end, and the report at the end of training.
    assert len(said) == 3 and all("RuntimeError: report failed" in s for s in said)
    assert cb.report is None and cb.profiler is None
    assert hook_registry(trainer.model) == hook_registry(plain.model)


# ------------------------------------------------------------------ Lightning


def test_lightning_trains_on_when_its_save_folder_is_removed_mid_run(tmp_path):
    L = _lightning()
    from memprof.integrations.lightning import MemprofCallback

    class RemoveFolder(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:  # after memprof's callback (added first) saved the window of steps 1-2
                assert (tmp_path / "mp" / "memprof-rank0-steps-1-2.json").is_file()
                shutil.rmtree(tmp_path / "mp")

    torch.manual_seed(0)
    plain = _Regression()
    _fit(tmp_path / "plain", plain, [], steps=6)
    torch.manual_seed(0)
    module = _Regression()
    cb = MemprofCallback(schedule=memprof.schedule(wait=1, active=2), save_dir=tmp_path / "mp")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path / "profiled", module, [cb, RemoveFolder()], steps=6)
    assert trainer.global_step == 6 and _same_params(plain, module)
    said = _memprof_warnings(record)
    # Steps 1-2 were saved before the folder went; then the window 4-5 and the whole run fail.
    assert [s.split(" (")[0] for s in said] == [
        f"memprof could not save {tmp_path / 'mp' / name}" for name in
        ("memprof-rank0-steps-4-5.json", "memprof-rank0.json")]
    assert cb.report.num_steps == 6 and cb.report.trace.recorded_steps == ((1, 2), (4, 5))


def test_lightning_lets_the_users_exception_through_when_the_save_fails(tmp_path, monkeypatch):
    from memprof.integrations.lightning import MemprofCallback

    _disk_full(monkeypatch)
    module = _Regression(fail_at=2)
    before = hook_registry(module)
    cb = MemprofCallback(save_dir=tmp_path / "mp")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="boom") as info:
            _fit(tmp_path, module, [cb])
    assert info.value is module.error  # the user's exception itself, not memprof's OSError
    said = _memprof_warnings(record)
    assert len(said) == 1 and "memprof-rank0.json" in said[0] and "No space left on device" in said[0]
    assert cb.report.num_steps == 2 and cb.report.trace.error == "RuntimeError: boom"
    after = hook_registry(module)
    assert {k: v for k, v in after.items() if k in before} == before


# ------------------------------------------------------------------ memprof's own errors inside training


def _end_step_fails_at(monkeypatch, step):
    """memprof's own code fails when closing ``step`` (a stand-in for any bug of memprof's inside a step)."""
    from memprof.collect.profiler import Profiler

    real = Profiler.end_step

    def end_step(self):
        if self.run.step == step:
            raise RuntimeError("memprof's own failure")
        real(self)

    monkeypatch.setattr(Profiler, "end_step", end_step)


def test_an_error_of_memprofs_own_in_a_trainer_step_ends_the_profile_not_training(tmp_path, monkeypatch):
    from memprof.integrations.transformers import MemprofCallback

    plain = _hf_train(tmp_path / "plain", [])
    _end_step_fails_at(monkeypatch, 2)
    cb = MemprofCallback()
    with pytest.warns(MemprofWarning, match=r"stopped profiling after an error of its own \(RuntimeError: memprof's"):
        trainer = _hf_train(tmp_path / "profiled", [cb])
    assert trainer.state.global_step == 6 and _same_params(plain.model, trainer.model)
    # Steps 0 and 1 closed at their ends; step 2 had run in full when closing it failed, and stop() closed it.
    assert cb.profiler is None and cb.report.num_steps == 3
    assert hook_registry(trainer.model) == hook_registry(plain.model)


def test_an_error_of_memprofs_own_in_a_lightning_step_ends_the_profile_not_training(tmp_path, monkeypatch):
    from memprof.integrations.lightning import MemprofCallback

    torch.manual_seed(0)
    plain = _Regression()
    _fit(tmp_path / "plain", plain, [])
    _end_step_fails_at(monkeypatch, 2)
    torch.manual_seed(0)
    module = _Regression()
    cb = MemprofCallback()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path / "profiled", module, [cb])
    assert trainer.global_step == 4 and _same_params(plain, module)
    said = _memprof_warnings(record)
    assert len(said) == 1 and "stopped profiling after an error of its own" in said[0]
    assert cb.profiler is None and cb.report.num_steps == 3  # as for the Trainer: 0, 1 and the failed 2


def test_a_logger_that_refuses_memprofs_metrics_ends_nothing(tmp_path):
    L = _lightning()
    from lightning.pytorch.loggers import CSVLogger

    from memprof.integrations.lightning import MemprofCallback

    class Refuses(CSVLogger):
        def log_metrics(self, metrics, step=None):
            if any(k.startswith("memprof/") for k in metrics):
                raise ValueError("unknown metric names")
            super().log_metrics(metrics, step)

    torch.manual_seed(0)
    module = _Regression()
    cb = MemprofCallback()
    trainer = L.Trainer(max_steps=4, callbacks=[cb], logger=Refuses(str(tmp_path)), accelerator="cpu",
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        log_every_n_steps=1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    assert trainer.global_step == 4 and cb.report.num_steps == 4
    said = _memprof_warnings(record)
    assert len(said) == 4 and all("could not log its metrics to Refuses (ValueError: unknown metric names)" in s
                                  for s in said)
