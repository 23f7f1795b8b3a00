"""Checkpoints under faults and hostile input: nothing stored in a checkpoint runs, damage is found,
a run is never lost or mixed with another, and inference builds what was saved.

Folders are modified as an attacker or an accident would: files changed and commit.json's sizes and
hashes rewritten to match (`reseal`), so only reading the files themselves can tell. A marker file
`ran` appears if any crafted pickle is executed.
"""

import dataclasses
import hashlib
import importlib.util
import io
import json
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from elr.config import load_config
from elr.errors import CheckpointError, UserError
from elr.infer.load import load_model, load_tokenizer
from elr.checkpoint import MARKER
from elr.train.checkpoint import CheckpointManager
from elr.train.train_state import ModelState
from elr.train.nonfinite import NonFiniteLossError
from elr.train.trainer import Trainer
from trainer_utils import DEBUG_TOML, ROOT, overrides, run

CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run: checkpoint/step-1, step-2 and the export step-2-model."""
    dump = tmp_path_factory.mktemp("safety") / "run"
    run(dump, 2, *CKPT, "--checkpoint.export_dtype", "float32")
    return dump


@pytest.fixture
def dump(trained, tmp_path):
    """A copy of the trained run to damage."""
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def trainer(dump, steps, *extra) -> Trainer:
    return Trainer(load_config(DEBUG_TOML, overrides(dump, steps, *CKPT, *extra)))


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reseal(folder) -> None:
    """Rewrite commit.json's sizes (and hashes, where it has them) to match the files, as an attacker would."""
    marker = json.loads((folder / MARKER).read_text())
    for name in marker["files"]:
        marker["files"][name] = (folder / name).stat().st_size
        if "sha256" in marker:
            marker["sha256"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / MARKER).write_text(json.dumps(marker))


class RunsCode:
    """Unpickled by a plain unpickler, this creates the file `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def prefix_pickle(folder, ran) -> None:
    meta = folder / ".metadata"
    meta.write_bytes(pickle.dumps(RunsCode(ran)) + meta.read_bytes())
    reseal(folder)


def poison_bytes_item(folder, fqn: str, ran) -> None:
    """Point a clean `.metadata`'s non-tensor item `fqn` at a torch.save payload appended to a shard."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # a file this test wrote itself
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    payload = io.BytesIO()
    torch.save(RunsCode(ran), payload)
    shard = folder / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(folder)


def rewrite_configs(dump, key: str, value) -> None:
    """Set elr.`key` in the run's config.json and in step-2's own (resealed), where there is one."""
    for path in (dump / "config.json", dump / "checkpoint" / "step-2" / "config.json"):
        if path.exists():
            config = json.loads(path.read_text())
            config["elr"][key] = value
            path.write_text(json.dumps(config))
    reseal(dump / "checkpoint" / "step-2")


def one_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


# ---- nothing stored in a checkpoint runs ----

def _resume(dump, tmp_path):
    t = trainer(dump, 2)
    t.close()
    assert t.step == 1  # the poisoned step-2 was skipped


def _initial_load_path(dump, tmp_path):
    with pytest.raises(UserError):
        trainer(tmp_path / "next", 2, "--checkpoint.initial_load_path", str(dump / "checkpoint" / "step-2"))


def _load_model(dump, tmp_path):
    with pytest.raises(UserError):
        load_model(dump / "checkpoint" / "step-2")


def _export_loader(dump, tmp_path):
    from elr.checkpoint import load_model_export

    model, _ = load_model(dump / "checkpoint" / "step-1")
    with pytest.raises(UserError):
        load_model_export(dump / "checkpoint" / "step-2-model", model)


def _generate(dump, tmp_path):
    argv = ["--checkpoint", str(dump / "checkpoint" / "step-2"), "--prompt", "The", "--max-new-tokens", "1"]
    assert script("generate").main(argv) == 2


def _evaluate(dump, tmp_path):
    argv = ["--checkpoint", str(dump / "checkpoint" / "step-2"), "--val-batches", "0", "--latency-new-tokens", "0"]
    assert script("evaluate").main(argv) == 2


@pytest.mark.parametrize("loader", [_resume, _initial_load_path, _load_model, _export_loader, _generate, _evaluate],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_pickle_prefixed_to_metadata_never_runs(dump, tmp_path, loader):
    ran = tmp_path / "ran"
    for name in ("step-2", "step-2-model"):
        prefix_pickle(dump / "checkpoint" / name, ran)
    try:
        loader(dump, tmp_path)
    finally:  # checked first, whatever the loader then did
        assert not ran.exists(), "a pickle stored in the checkpoint was executed"


def test_a_torch_save_payload_in_a_non_tensor_item_never_runs(dump, tmp_path, caplog):
    ran = tmp_path / "ran"
    poison_bytes_item(dump / "checkpoint" / "step-2", "train_state.step", ran)
    try:
        with caplog.at_level(logging.WARNING):
            _resume(dump, tmp_path)
    finally:
        assert not ran.exists(), "a torch.save payload stored in the checkpoint was executed"
    assert any("train_state.step" in r.getMessage() and "not a plain value" in r.getMessage() for r in caplog.records)


# ---- damage is found ----

def test_a_flipped_byte_is_found_by_its_checksum(dump, caplog):
    shard = dump / "checkpoint" / "step-2" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the hash can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_model(dump / "checkpoint" / "step-2")
    with caplog.at_level(logging.WARNING):
        _resume(dump, None)
    assert any("step-2" in r.getMessage() and "SHA-256" in r.getMessage() for r in caplog.records)


def test_inference_needs_the_commit_marker(dump):
    (dump / "checkpoint" / "step-2" / MARKER).unlink()
    with pytest.raises(CheckpointError, match="no commit.json"):
        load_model(dump / "checkpoint" / "step-2")


# ---- a run is never lost ----

@pytest.mark.parametrize("damage", ["metadata", "marker"])
def test_when_no_checkpoint_loads_the_run_stops_naming_each_and_deletes_nothing(dump, damage):
    folder = dump / "checkpoint"
    for step in ("step-1", "step-2"):
        if damage == "metadata":  # e.g. written by a torch whose metadata this one cannot read
            (folder / step / ".metadata").write_bytes(b"\x00" * 64)
            reseal(folder / step)
        else:
            (folder / step / MARKER).unlink()
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    with pytest.raises(CheckpointError, match=r"none of the 2 checkpoints.*step-2 .*; step-1 ") as error:
        trainer(dump, 4)
    assert "\n" not in str(error.value)
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before


def test_train_py_stops_in_one_line_when_no_checkpoint_loads(dump):
    for step in ("step-1", "step-2"):
        (dump / "checkpoint" / step / MARKER).unlink()
    result = subprocess.run([sys.executable, "train.py", *overrides(dump, 4, *CKPT)], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "none of the 2 checkpoints" in one_error_line(result.stderr)


def test_a_rollback_keeps_the_abandoned_checkpoint_aside(dump):
    folder = dump / "checkpoint"
    original = (folder / "step-2" / MARKER).read_text()
    t = trainer(dump, 2, "--checkpoint.load_step", "1")
    assert t.step == 1
    assert CheckpointManager(folder, interval=1).latest_step() == 1  # a plain resume would not pick it
    t.train()  # saves its own step-2
    t.close()
    aside = [p for p in folder.iterdir() if p.name.startswith("step-2.abandoned-")]
    assert len(aside) == 1 and (aside[0] / MARKER).read_text() == original
    assert (folder / f"step-2-model.abandoned-{aside[0].name.split('abandoned-')[1]}").is_dir()
    assert (folder / "step-2" / MARKER).is_file()  # the rolled-back run's own step 2


def test_pruning_never_deletes_the_unreadable_newer_checkpoint(dump):
    folder = dump / "checkpoint"
    (folder / "step-2" / ".metadata").write_bytes(b"\x00" * 64)
    reseal(folder / "step-2")
    t = trainer(dump, 3, "--checkpoint.keep_latest_k", "1")
    assert t.step == 1
    t.train()
    t.close()
    assert [p.name for p in folder.iterdir() if p.name.startswith("step-2.abandoned-")]  # kept, not overwritten
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step-") and "." not in p.name) == ["step-3"]


def test_saves_clean_only_their_own_tmp_folders(tmp_path):
    (tmp_path / "important.tmp").mkdir()
    (tmp_path / "important.tmp" / "data").write_text("keep me")
    (tmp_path / "notes.tmp").write_text("a file, not a folder")
    (tmp_path / "step-3.tmp").mkdir()  # a killed save of ours
    CheckpointManager(tmp_path, interval=1).save(1, {"model": ModelState(torch.nn.Linear(2, 2))})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["important.tmp", "notes.tmp", "step-1"]
    assert (tmp_path / "important.tmp" / "data").read_text() == "keep me"


# ---- one run per folder ----

def test_a_second_trainer_on_the_same_folder_is_refused_in_one_line(dump):
    first = trainer(dump, 3)  # holds the lock while the second starts
    try:
        result = subprocess.run([sys.executable, "train.py", *overrides(dump, 3, *CKPT)], cwd=ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                                timeout=240)
    finally:
        first.close()
    assert result.returncode == 2, result.stderr[-2000:]
    line = one_error_line(result.stderr)
    assert "job.dump_folder" in line and "in use by another run" in line and f"pid {os.getpid()}" in line
    assert not (dump / "train.lock").exists()  # released by close()


def test_a_dead_runs_lock_is_taken_over_and_another_hosts_is_refused(dump):
    child = subprocess.Popen(["true"])
    child.wait()  # its pid is now free
    lock = dump / "train.lock"
    lock.write_text(json.dumps({"pid": child.pid, "host": socket.gethostname(), "started": "earlier"}))
    t = trainer(dump, 2)
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    t.close()
    lock.write_text(json.dumps({"pid": 1, "host": "another-host", "started": "earlier"}))
    with pytest.raises(UserError, match="in use by another run .*another-host"):
        trainer(dump, 2)


# ---- inference builds what was saved ----

def test_a_config_json_rewritten_by_another_run_does_not_change_the_model(dump):
    tokens = torch.tensor([[3, 14, 15, 92, 65]])
    saved, _ = load_model(dump / "checkpoint" / "step-2")
    config = json.loads((dump / "config.json").read_text())
    config["elr"]["update"] = "replace"  # a later run in the same dump folder
    (dump / "config.json").write_text(json.dumps(config))
    model, cfg = load_model(dump / "checkpoint" / "step-2")
    assert model.args.recurrence.update == "adaptive_delta" and cfg["elr"]["update"] == "adaptive_delta"
    with torch.no_grad():
        assert torch.equal(model(tokens, 2), saved(tokens, 2))


def test_checkpoint_weights_the_model_lacks_are_an_error(dump):
    """The saved config itself describes another network (replace has no step size): refused, not dropped."""
    rewrite_configs(dump, "update", "replace")
    with pytest.raises(CheckpointError, match="checkpoint keys not requested: .*step_size"):
        load_model(dump / "checkpoint" / "step-2")


def shuffled_tokenizer(tmp_path):
    """The bundled BPE with its ranks permuted: the same size, other ids."""
    lines = (ROOT / "data" / "tokenizer" / "elr8k.tiktoken").read_text().splitlines()
    tokens, ranks = zip(*(line.split() for line in lines))
    path = tmp_path / "shuffled.tiktoken"
    path.write_text("\n".join(f"{t} {r}" for t, r in zip(tokens, reversed(ranks))) + "\n")
    return path


def test_another_tokenizer_of_the_same_size_is_refused(dump, tmp_path):
    shuffled = shuffled_tokenizer(tmp_path)
    with pytest.raises(UserError, match="data.path: the data was tokenized by a tokenizer with SHA-256"):
        trainer(tmp_path / "fresh", 1, "--tokenizer.path", str(shuffled))
    _, cfg = load_model(dump / "checkpoint" / "step-2")
    with pytest.raises(UserError, match="trained with"):
        load_tokenizer(cfg, str(shuffled))


# ---- NaN never reaches or leaves a checkpoint ----

def test_nan_weights_are_refused_at_load(dump, caplog):
    t = trainer(dump, 3)
    with torch.no_grad():
        next(t.model.parameters()).fill_(float("nan"))
    t.checkpointer.save(3, t.states())  # the manager writes what it is given; the trainer would not
    t.close()
    with pytest.raises(CheckpointError, match="NaN"):
        load_model(dump / "checkpoint" / "step-3")
    with caplog.at_level(logging.WARNING):
        resumed = trainer(dump, 4)
    resumed.close()
    assert resumed.step == 2 and any("step-3" in r.getMessage() and "NaN" in r.getMessage() for r in caplog.records)
    assert all(torch.isfinite(p).all() for p in resumed.model.parameters())


def test_a_run_with_nan_weights_saves_no_checkpoint(tmp_path):
    t = trainer(tmp_path / "run", 3, "--training.max_nonfinite_steps", "10")
    with torch.no_grad():
        next(t.model.parameters()).fill_(float("nan"))  # e.g. loaded that way
    with pytest.raises(NonFiniteLossError, match="not saving"):
        t.train()
    t.close()
    folder = tmp_path / "run" / "checkpoint"
    assert not folder.exists() or not [p for p in folder.iterdir() if p.name.startswith("step-")]


# ---- the smaller faults: one line each ----

def test_a_full_disk_is_named_with_the_bytes_needed(tmp_path, monkeypatch):
    import elr.train.checkpoint as checkpoint

    ckpt = CheckpointManager(tmp_path / "ckpt", interval=1)
    layer = torch.nn.Linear(64, 64)
    room = shutil.disk_usage(tmp_path)
    full = room._replace(free=1000)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: full)
    with pytest.raises(CheckpointError, match=r"not enough space to save step-1: the disk holding .* \(mounted at "
                                              r".*\) has 0\.0 MB free, the save needs about"):
        ckpt.save(1, {"model": ModelState(layer)})
    assert not (tmp_path / "ckpt" / "step-1.tmp").exists()

    # Room before the save, none left when the writer fails (with whatever it says): the same line.
    free = iter([room, full])
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: next(free))

    def fails(*args, **kwargs):
        raise RuntimeError("unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint.dcp, "save", fails)
    with pytest.raises(CheckpointError, match=r"not enough space.*unexpected pos 704 vs 598"):
        ckpt.save(1, {"model": ModelState(layer)})


@pytest.mark.parametrize("fault", ["malformed_marker", "config_error", "old_gdp_format"])
def test_generate_and_evaluate_end_user_errors_in_one_line(dump, capsys, fault):
    step = dump / "checkpoint" / "step-2"
    if fault == "malformed_marker":
        marker = json.loads((step / MARKER).read_text())
        marker["files"] = 5
        (step / MARKER).write_text(json.dumps(marker))
    elif fault == "config_error":  # the saved config holds a value this version refuses
        rewrite_configs(dump, "max_loops", 0)
    else:  # a marker from before GDP's head-major rows: a CheckpointError
        marker = json.loads((step / MARKER).read_text())
        del marker["format"]
        (step / MARKER).write_text(json.dumps(marker))
    capsys.readouterr()
    _generate(dump, None)
    assert one_error_line(capsys.readouterr().err).startswith("generate: error:")
    _evaluate(dump, None)
    assert one_error_line(capsys.readouterr().err).startswith("evaluate: error:")


def test_sigterm_with_checkpoints_disabled_saves_nothing(tmp_path, caplog):
    t = Trainer(load_config(DEBUG_TOML, overrides(tmp_path / "run", 3)))
    t.stop.requested = True  # as the SIGTERM handler sets it
    with caplog.at_level(logging.INFO):
        t.train()
    t.close()
    assert t.step == 1 and not (tmp_path / "run" / "checkpoint").exists()
    assert any("without saving (checkpoint.enable is false)" in r.getMessage() for r in caplog.records)
