"""Faults during a run: a write of the run's own files (metrics.jsonl, TensorBoard, the export at the end)
that fails for space or permission stops the run after a checkpoint, in one line saying what failed and
what was kept, and the same command then resumes exactly (or writes the missing export)."""

import errno
import importlib.util
import json

import pytest
from trainer_utils import DEBUG_TOML, losses, overrides, run

from elr.config import load_config
from elr.errors import RunWriteFailed
from elr.train.metrics import EventFile, MetricsLogger
from elr.train.resume import finished_step

CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "1000"]


class FullFrom:
    """metrics.jsonl on a disk that fills up when the record of step `full_at` is written."""

    def __init__(self, file, full_at: int):
        self.file, self.full_at, self.name = file, full_at, file.name

    def write(self, text: str) -> int:
        if json.loads(text)["step"] >= self.full_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(text)

    def close(self) -> None:
        self.file.close()


def test_a_full_metrics_disk_saves_a_checkpoint_and_the_resume_is_exact(tmp_path, monkeypatch):
    reference = run(tmp_path / "reference", 6, *CKPT)

    opened = MetricsLogger.__init__

    def on_a_filling_disk(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        if self.jsonl is not None:
            self.jsonl = FullFrom(self.jsonl, full_at=3)

    monkeypatch.setattr(MetricsLogger, "__init__", on_a_filling_disk)
    dump = tmp_path / "run"
    with pytest.raises(
        RunWriteFailed,
        match=r"^metrics: could not write \S*metrics.jsonl at step 3 \(No space left "
        r"on device\); saved checkpoint step-3 in \S+; the same command resumes",
    ):
        run(dump, 6, *CKPT)
    assert (dump / "checkpoint" / "step-3").is_dir()
    assert sorted(losses(dump)) == [1, 2]  # nothing torn

    monkeypatch.undo()  # space freed
    run(dump, 6, *CKPT)
    assert losses(dump) == {s: loss for s, loss in reference.items() if s != 3}  # bit-exact; step 3's line is lost


class FullAt:
    """A TensorBoard event file on a disk that fills up when the scalars of step `full_at` are written."""

    def __init__(self, file, full_at: int):
        self.file, self.full_at, self.full = file, full_at, False

    def write(self, data: bytes) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def test_a_full_tensorboard_disk_is_one_line_after_a_checkpoint_and_the_resume_is_exact(tmp_path, monkeypatch, capfd):
    """TensorBoard's events are written where the step is logged: a failure is the metrics.jsonl line (naming
    the event file), never a writer thread's traceback with the run going on."""
    tensorboard = [*CKPT, "--metrics.enable_tensorboard", "true"]
    reference = run(tmp_path / "reference", 4, *tensorboard)

    opened, scalars = EventFile.__init__, EventFile.add_scalars

    def on_a_filling_disk(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        self.file = FullAt(self.file, full_at=2)

    def fills_at(self, values, step):
        self.file.full = step >= self.file.full_at
        scalars(self, values, step)

    monkeypatch.setattr(EventFile, "__init__", on_a_filling_disk)
    monkeypatch.setattr(EventFile, "add_scalars", fills_at)
    dump = tmp_path / "run"
    with pytest.raises(
        RunWriteFailed,
        match=r"^metrics: could not write \S*/tb/events\.out\.tfevents\.\S* at step 2 "
        r"\(No space left on device\); saved checkpoint step-2 in \S+; the same "
        r"command resumes",
    ):
        run(dump, 4, *tensorboard)
    assert "Traceback" not in capfd.readouterr().err  # no writer thread died
    assert (dump / "checkpoint" / "step-2").is_dir()
    assert sorted(losses(dump)) == [1]  # metrics.jsonl holds the steps TensorBoard holds

    monkeypatch.undo()  # space freed
    run(dump, 4, *tensorboard)
    assert losses(dump) == {s: loss for s, loss in reference.items() if s != 2}  # bit-exact


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.skipif(
    importlib.util.find_spec("safetensors") is None, reason='needs safetensors (pip install -e ".[hf]")'
)
def test_a_full_disk_during_the_final_export_keeps_the_checkpoint_and_the_same_command_writes_it(tmp_path, monkeypatch):
    from elr.interop import hf_export

    export = [*CKPT, "--checkpoint.export_dtype", "float32", "--checkpoint.export_format", "hf"]
    dump = tmp_path / "run"
    monkeypatch.setattr(hf_export, "write_tokenizer", no_space)  # the weights are written by then
    with pytest.raises(
        RunWriteFailed,
        match=r"^export: could not write \S*/step-2-hf \(No space left on device\); the "
        r"partial export was removed; checkpoint step-2 in \S+ is kept; the same "
        r"command writes the export once the folder can be written$",
    ):
        run(dump, 2, *export)
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]  # no step-2-hf(.tmp)
    metrics = (dump / "metrics.jsonl").read_bytes()
    cfg = load_config(DEBUG_TOML, overrides(dump, 2, *export))
    assert finished_step(cfg) is None  # train.py does not call the run finished: its export is missing

    monkeypatch.undo()  # space freed
    run(dump, 2, *export)
    assert (dump / "checkpoint" / "step-2-hf" / "model.safetensors").is_file()
    assert (dump / "metrics.jsonl").read_bytes() == metrics  # no step redone
    assert finished_step(cfg) == 2


def test_a_full_disk_during_the_dcp_model_export_removes_the_partial_folder(tmp_path, monkeypatch):
    """The model export written through DCP: its failure arrives wrapped in DCP's CheckpointException."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from elr.checkpoint import storage

    class FullDisk(HuggingFaceStorageWriter):
        def write_data(self, plan, planner):
            no_space()

    monkeypatch.setattr(storage, "tensor_writer", lambda folder: FullDisk(str(folder), save_distributed=True))
    dump = tmp_path / "run"
    with pytest.raises(
        RunWriteFailed,
        match=r"^export: could not write \S*/step-2-model \(No space left on device\); "
        r"the partial export was removed; checkpoint step-2 in \S+ is kept",
    ):
        run(dump, 2, *CKPT, "--checkpoint.export_dtype", "bfloat16")
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]


def test_an_undeletable_file_in_an_old_checkpoint_is_one_line_and_the_run_finishes(tmp_path, monkeypatch, caplog):
    """keep_latest_k = 1 prunes step-1 at the save of step-2, and its values.json cannot be deleted (an immutable
    file, another owner's folder): one warning naming the folder, the rest of it set aside under a name no resume
    reads, every newer checkpoint whole, and the run's closing line."""
    import logging
    import os

    from elr.checkpoint import verify

    unlink = os.unlink

    def undeletable(path, *, dir_fd=None):
        folder = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.path.dirname(path)
        if os.path.basename(path) == "values.json" and os.path.basename(folder).startswith("step-1"):
            raise PermissionError(errno.EPERM, "Operation not permitted", os.path.basename(path))
        return unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", undeletable)
    dump = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        run(dump, 3, "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1")
    folder = dump / "checkpoint"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        f"checkpoint: could not delete the old checkpoint {folder}/step-1 (Operation not permitted: values.json); "
        "what is left of it is in step-1.pruning (never resumed): the next save tries again, or delete it by hand"
    ]
    assert sorted(p.name for p in folder.iterdir()) == ["step-1.pruning", "step-3"]  # step-2 pruned at step-3's save
    assert [p.name for p in (folder / "step-1.pruning").iterdir()] == ["values.json"]
    verify(folder / "step-3", 3)  # the newest checkpoint whole
    assert caplog.records[-1].getMessage().startswith(f"finished at step 3/3; outputs: {dump / 'metrics.jsonl'}")
