"""Checkpoints under faults and hostile input: a checkpoint holds no pickle and nothing stored in it
runs, every file is hash-checked before any is parsed, damage is found, a run is never lost, mixed
with another or silently restarted, nothing the project did not write is deleted, and inference
builds what was saved.

Folders are modified as an attacker or an accident would: files changed and commit.json's sizes and
hashes rewritten to match (`reseal`), so only reading the files themselves can tell. A marker file
`ran` appears if any crafted pickle is executed.
"""

import errno
import hashlib
import importlib.util
import json
import logging
import multiprocessing
import os
import pathlib
import pickle
import re
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from trainer_utils import DEBUG_TOML, ROOT, overrides, run

from elr.checkpoint import MARKER
from elr.config import load_config
from elr.errors import CheckpointError, ConfigError, FolderInUse, UserError
from elr.infer.load import load_model, load_tokenizer
from elr.train.checkpointer import CheckpointManager
from elr.train.nonfinite import NonFiniteLossError
from elr.train.run_lock import RunLock
from elr.train.train_state import ModelState
from elr.train.trainer import Trainer

CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"]
SHARD0 = "shard-00001-model-00001-of-00001.safetensors"  # the tensors of a one-process save
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


def plant_pickle(folder, ran, where: str) -> None:
    """A pickle that runs code, where an attacker might hope a loader unpickles it: prefixed to the
    tensors, as the whole values.json, or as the `.metadata` older formats kept (resealed)."""
    payload = pickle.dumps(RunsCode(ran))
    if where == "shard":
        (folder / SHARD0).write_bytes(payload + (folder / SHARD0).read_bytes())
    elif where == "values":
        (folder / "values.json").write_bytes(payload)
    else:
        (folder / ".metadata").write_bytes(payload)
        marker = json.loads((folder / MARKER).read_text())
        marker["files"][".metadata"], marker["sha256"][".metadata"] = 0, "0" * 64
        (folder / MARKER).write_text(json.dumps(marker))
    reseal(folder)


def rewrite_tensors(folder, change) -> None:
    """Rewrite the shard's tensors through `change(tensors, offsets)` (DCP's offsets kept), then reseal."""
    shard = folder / SHARD0
    with safe_open(str(shard), framework="pt") as f:
        metadata = f.metadata()
    tensors, offsets = load_file(str(shard)), json.loads(metadata["DCP_SHARDING_INFO"])
    change(tensors, offsets)
    save_file(tensors, str(shard), metadata={**metadata, "DCP_SHARDING_INFO": json.dumps(offsets)})
    reseal(folder)


def rewrite_values(folder, change) -> None:
    values = json.loads((folder / "values.json").read_text())
    change(values)
    (folder / "values.json").write_text(json.dumps(values))
    reseal(folder)


def snapshot(folder) -> dict:
    """Every path under `folder` with its bytes (None for a folder or a link)."""
    return {p: (None if p.is_dir() or p.is_symlink() else p.read_bytes()) for p in sorted(folder.rglob("*"))}


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


@pytest.mark.parametrize("where", ["shard", "values", "metadata"])
@pytest.mark.parametrize(
    "loader",
    [_resume, _initial_load_path, _load_model, _export_loader, _generate, _evaluate],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_planted_pickle_never_runs(dump, tmp_path, loader, where):
    ran = tmp_path / "ran"
    for name in ("step-2", "step-2-model"):
        plant_pickle(dump / "checkpoint" / name, ran, where)
    classes = (pathlib.PurePath, pathlib.Path, pathlib.PosixPath, Path)  # what the old exploit reached
    before = [dict(vars(cls)) for cls in classes]
    try:
        loader(dump, tmp_path)
    finally:  # checked first, whatever the loader then did
        assert not ran.exists(), "a pickle stored in the checkpoint was executed"
        assert [dict(vars(cls)) for cls in classes] == before, "a class of this process was changed"


def test_a_checkpoint_folder_holds_no_pickle(trained):
    """Every file is JSON or safetensors whose header and tensors account for every byte: no room for
    a pickle (protocol 2+ starts with 0x80, torch.save with a zip's PK)."""
    folders = [trained / "checkpoint" / name for name in ("step-1", "step-2", "step-2-model")]
    for path in (f for folder in folders for f in folder.iterdir()):
        data = path.read_bytes()
        assert not data.startswith((b"\x80", b"PK")), path
        if path.suffix == ".json":
            json.loads(data)
            continue
        assert path.suffix == ".safetensors", path
        size = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + size])
        assert all(isinstance(v, str) for v in header.pop("__metadata__").values())  # DCP's offsets, as JSON text
        assert 8 + size + max(entry["data_offsets"][1] for entry in header.values()) == len(data), path
    assert {p.name for p in folders[0].iterdir()} == {MARKER, SHARD0, "values.json", "config.json"}


def test_no_module_of_elr_unpickles():
    """`grep -rn pickle elr/` finds no reader: nothing in the library can unpickle what it reads."""
    reader = re.compile(r"pickle\.loads?\(|Unpickler|torch\.load\(|weights_only|FileSystemReader")
    hits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in sorted((ROOT / "elr").rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if reader.search(line)
    ]
    assert hits == []


def test_a_value_of_another_kind_is_refused_and_the_older_step_loads(dump, tmp_path, caplog):
    ran = tmp_path / "ran"
    rewrite_values(
        dump / "checkpoint" / "step-2",
        lambda values: values.update({"train_state.step": {"__reduce__": ["os.system", [f"touch {ran}"]]}}),
    )
    with caplog.at_level(logging.WARNING):
        _resume(dump, tmp_path)
    assert not ran.exists()
    assert any(
        "train_state.step as a JSON object, where this job has a number" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize("name", ["values.json", "config.json", MARKER])
def test_json_nested_past_the_parsers_depth_is_one_line(dump, name):
    step = dump / "checkpoint" / "step-2"
    (step / name).write_text("[" * 200_000 + "]" * 200_000)
    if name != MARKER:
        reseal(step)
    with pytest.raises(CheckpointError, match=f"unreadable {name}") as error:
        load_model(step)
    assert "\n" not in str(error.value)


def test_a_model_tensor_recast_as_a_value_is_one_clear_error(dump):
    step = dump / "checkpoint" / "step-2"
    key = "model.tok_embeddings.weight"
    rewrite_tensors(step, lambda tensors, offsets: (tensors.pop(key), offsets.pop(key)))
    rewrite_values(step, lambda values: values.update({key: [[0.5]]}))
    with pytest.raises(
        CheckpointError, match=f"stored as a tensor where a value is requested or the other way round: {key}"
    ) as error:
        trainer(dump, 3)
    assert "\n" not in str(error.value)
    with pytest.raises(CheckpointError, match="no model.tok_embeddings.weight as a tensor"):
        load_model(step)


def test_shards_that_do_not_tile_a_tensor_are_refused(dump, caplog):
    """Offsets in the header that leave part of a tensor unwritten (or overlap) never load."""
    key = "model.tok_embeddings.weight"
    rewrite_tensors(dump / "checkpoint" / "step-2", lambda tensors, offsets: offsets[key].update(saved_offsets=[1, 0]))
    with pytest.raises(CheckpointError, match=f"holds {key} in shards that do not cover it exactly"):
        load_model(dump / "checkpoint" / "step-2")
    with caplog.at_level(logging.WARNING):
        _resume(dump, None)


# ---- damage is found ----


def test_a_flipped_byte_is_found_by_its_checksum(dump, caplog):
    shard = dump / "checkpoint" / "step-2" / SHARD0
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


@pytest.mark.parametrize("damage", ["header", "marker"])
def test_when_no_checkpoint_loads_the_run_stops_naming_each_and_deletes_nothing(dump, damage):
    folder = dump / "checkpoint"
    for step in ("step-1", "step-2"):
        if damage == "header":  # e.g. written by a tool whose safetensors this one cannot read
            (folder / step / SHARD0).write_bytes(b"\x00" * 64)
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
    result = subprocess.run(
        [sys.executable, "train.py", *overrides(dump, 4, *CKPT)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
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


def test_a_rollback_leaves_a_users_own_step_folders_and_links_as_they_are(dump, tmp_path):
    folder = dump / "checkpoint"
    (folder / "step-5").mkdir()
    (folder / "step-5" / "notes.txt").write_text("mine")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (folder / "step-6").symlink_to(elsewhere, target_is_directory=True)
    t = trainer(dump, 1, "--checkpoint.load_step", "1")
    t.close()
    assert [p.name for p in folder.iterdir() if p.name.startswith("step-2.abandoned-")]  # ours: set aside
    assert (folder / "step-5" / "notes.txt").read_text() == "mine" and (folder / "step-6").is_symlink()
    assert not [p for p in folder.iterdir() if p.name.startswith(("step-5.", "step-6."))]


def test_pruning_never_deletes_the_unreadable_newer_checkpoint(dump):
    folder = dump / "checkpoint"
    (folder / "step-2" / SHARD0).write_bytes(b"\x00" * 64)
    reseal(folder / "step-2")
    t = trainer(dump, 3, "--checkpoint.keep_latest_k", "1")
    assert t.step == 1
    t.train()
    t.close()
    assert [p.name for p in folder.iterdir() if p.name.startswith("step-2.abandoned-")]  # kept, not overwritten
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step-") and "." not in p.name) == ["step-3"]


def test_saves_delete_only_what_the_project_wrote_and_report_the_rest_once(tmp_path, caplog):
    folder, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    ckpt = CheckpointManager(folder, interval=1)
    ckpt.save(4, {"model": ModelState(torch.nn.Linear(2, 2))})
    os.rename(folder / "step-4", folder / "step-4.tmp")  # a killed save of ours, files and all
    (folder / "step-3.tmp").mkdir()  # killed before it wrote anything
    (folder / "important.tmp").mkdir()
    (folder / "important.tmp" / "data").write_text("keep me")
    (folder / "notes.tmp").write_text("a file, not a folder")
    (folder / "step-9.tmp").mkdir()  # not a save of ours: it holds a file no save writes
    (folder / "step-9.tmp" / "notes.txt").write_text("mine")
    elsewhere.mkdir()
    (elsewhere / "values.json").write_text("{}")
    (folder / "step-7.tmp").symlink_to(elsewhere)
    (folder / "my-notes").mkdir()
    before = snapshot(tmp_path)
    with caplog.at_level(logging.WARNING):
        ckpt.save(1, {"model": ModelState(torch.nn.Linear(2, 2))})
        ckpt.save(2, {"model": ModelState(torch.nn.Linear(2, 2))})
    assert sorted(p.name for p in folder.iterdir()) == [
        "important.tmp",
        "my-notes",
        "notes.tmp",
        "step-1",
        "step-2",
        "step-7.tmp",
        "step-9.tmp",
    ]
    kept = {p: data for p, data in before.items() if "step-4.tmp" not in str(p) and "step-3.tmp" not in str(p)}
    assert {p: data for p, data in snapshot(tmp_path).items() if p in kept} == kept  # nothing else touched
    lines = [r.getMessage() for r in caplog.records if r.name == "elr.train.checkpointer"]
    assert len(lines) == 1, lines
    assert all(
        name in lines[0]
        for name in ("important.tmp", "my-notes", "notes.tmp", "step-9.tmp", "step-7.tmp (a symbolic link)")
    )


def test_a_save_refuses_a_step_name_someone_else_holds(tmp_path):
    (tmp_path / "step-1.tmp").mkdir()
    (tmp_path / "step-1.tmp" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="step-1.tmp exists and was not written by this project"):
        CheckpointManager(tmp_path, interval=1).save(1, {"model": ModelState(torch.nn.Linear(2, 2))})
    assert (tmp_path / "step-1.tmp" / "notes.txt").read_text() == "mine"


# ---- one run per folder ----


def test_a_second_trainer_on_the_same_folder_is_refused_in_one_line(dump):
    first = trainer(dump, 3)  # holds the lock while the second starts
    try:
        result = subprocess.run(
            [sys.executable, "train.py", *overrides(dump, 3, *CKPT)],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=240,
        )
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


def _race_for_the_lock(folder: str, start, done, results) -> None:
    start.wait()
    try:
        lock = RunLock.acquire({"job.dump_folder": Path(folder)}, 0)
        results.put("won")
    except FolderInUse:
        lock = None
        results.put("refused")
    done.wait()  # the winner holds the lock until both have tried
    if lock is not None:
        lock.release()


def test_two_trainers_taking_over_a_stale_lock_at_once_one_wins(tmp_path):
    child = subprocess.Popen(["true"])
    child.wait()  # its pid is now free
    stale = json.dumps({"pid": child.pid, "host": socket.gethostname(), "started": "earlier"})
    fork = multiprocessing.get_context("fork")
    for attempt in range(15):
        folder = tmp_path / f"run{attempt}"
        folder.mkdir()
        (folder / "train.lock").write_text(stale)
        start, done, results = fork.Barrier(2), fork.Barrier(2), fork.Queue()
        racers = [fork.Process(target=_race_for_the_lock, args=(str(folder), start, done, results)) for _ in range(2)]
        for racer in racers:
            racer.start()
        outcomes = sorted(results.get(timeout=60) for _ in racers)
        for racer in racers:
            racer.join(timeout=60)
        assert outcomes == ["refused", "won"], (attempt, outcomes)
        assert not (folder / "train.lock").exists()  # released by the winner


def test_a_trainer_pointed_at_a_running_runs_checkpoints_is_refused(dump, tmp_path):
    first = trainer(dump, 3)  # holds the dump folder's and the checkpoint folder's locks
    before = snapshot(dump / "checkpoint")
    try:
        result = subprocess.run(
            [
                sys.executable,
                "train.py",
                *overrides(tmp_path / "other", 3, *CKPT, "--checkpoint.folder", str(dump / "checkpoint")),
            ],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert snapshot(dump / "checkpoint") == before  # nothing set aside, deleted or written
    finally:
        first.close()
    assert result.returncode == 2, result.stderr[-2000:]
    line = one_error_line(result.stderr)
    assert "checkpoint.folder" in line and "in use by another run" in line and f"pid {os.getpid()}" in line


# ---- every file is hash-checked before any of it is parsed ----


@pytest.mark.parametrize("edit", ["valid_json", "invalid_json"])
def test_an_edited_config_json_is_found_by_its_hash_before_it_is_read(dump, caplog, capsys, edit):
    config = dump / "checkpoint" / "step-2" / "config.json"
    text = config.read_text()
    if edit == "valid_json":  # the same size; read first, it would say "cannot change on resume"
        config.write_text(re.sub(r'"max_loops": (\d)', lambda m: f'"max_loops": {int(m[1]) % 9 + 1}', text))
    else:
        config.write_text("{" + " " * (len(text) - 1))
    assert config.stat().st_size == len(text)
    with pytest.raises(CheckpointError, match="config.json whose SHA-256 differs"):
        load_model(dump / "checkpoint" / "step-2")
    with pytest.raises(CheckpointError, match="config.json whose SHA-256 differs"):
        trainer(dump.parent / "next", 2, "--checkpoint.initial_load_path", str(dump / "checkpoint" / "step-2"))
    capsys.readouterr()
    argv = ["--checkpoint", str(dump / "checkpoint" / "step-2"), "--out", str(dump.parent / "hf")]
    assert script("export_hf").main(argv) == 2
    assert "config.json whose SHA-256 differs" in one_error_line(capsys.readouterr().err)
    assert not (dump.parent / "hf").exists()
    with caplog.at_level(logging.WARNING):
        _resume(dump, None)  # fell back to step-1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped checkpoint")]
    assert len(lines) == 1 and "step-2: has file config.json whose SHA-256 differs" in lines[0], lines


def test_a_file_added_to_a_step_folder_or_a_link_in_it_is_refused(dump, tmp_path):
    step = dump / "checkpoint" / "step-2"
    (step / "extra.safetensors").write_bytes((step / SHARD0).read_bytes())
    with pytest.raises(CheckpointError, match="has extra.safetensors, which commit.json does not list"):
        load_model(step)
    (step / "extra.safetensors").unlink()
    (tmp_path / "outside.json").write_text((step / "values.json").read_text())
    (step / "values.json").unlink()
    (step / "values.json").symlink_to(tmp_path / "outside.json")
    with pytest.raises(CheckpointError, match="has values.json, a symbolic link"):
        load_model(step)


# ---- a folder that holds a run is continued or refused, never silently restarted ----


def test_a_rerun_without_checkpoints_is_refused_then_starts_over_on_request(tmp_path, caplog):
    dump = tmp_path / "run"
    run(dump, 2)  # no checkpoints
    before = snapshot(dump)
    result = subprocess.run(
        [sys.executable, "train.py", *overrides(dump, 2)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    line = one_error_line(result.stderr)
    assert "holds a run (config.json, metrics.jsonl)" in line and "--job.start_over true" in line, line
    assert snapshot(dump) == before
    with caplog.at_level(logging.INFO):
        run(dump, 1, "--job.start_over", "true")
    assert any(r.getMessage().startswith(f"starting over in {dump} (job.start_over)") for r in caplog.records)
    aside = sorted(p.name for p in dump.iterdir() if ".abandoned-" in p.name)
    assert [name.split(".abandoned-")[0] for name in aside] == ["config.json", "metrics.jsonl"]
    assert (dump / aside[1]).read_bytes() == before[dump / "metrics.jsonl"]  # kept, not deleted
    assert [r["step"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())] == [1]


def test_starting_over_sets_the_earlier_checkpoints_aside(dump):
    kept = {hashlib.sha256(data).hexdigest() for data in snapshot(dump).values() if data is not None}
    t = trainer(dump, 2, "--job.start_over", "true")
    t.close()
    assert t.step == 0
    folder = dump / "checkpoint"
    assert not [p for p in folder.iterdir() if re.fullmatch(r"step-\d+(-model)?", p.name)]
    assert len([p for p in folder.iterdir() if ".abandoned-" in p.name]) == 3  # step-1, step-2, step-2-model
    assert kept <= {hashlib.sha256(data).hexdigest() for data in snapshot(dump).values() if data is not None}


@pytest.mark.parametrize("change", ["model", "data"])
def test_a_finished_run_of_another_model_or_data_is_refused_not_called_finished(dump, tmp_path, change):
    if change == "model":
        extra = ["--elr.max_loops", "2"]
    else:  # another corpus, even one holding the same bytes
        shutil.copytree(ROOT / "data" / "tinyprose", tmp_path / "mycorpus")
        extra = ["--data.path", str(tmp_path / "mycorpus")]
    before = snapshot(dump)
    result = subprocess.run(
        [sys.executable, "train.py", *overrides(dump, 2, *CKPT, *extra)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    line = one_error_line(result.stderr)
    key = "elr.max_loops" if change == "model" else "data.path"
    assert f"{key}: cannot change on resume" in line and "--job.start_over true" in line, line
    assert snapshot(dump) == before


def test_an_old_format_checkpoint_stops_train_py_in_one_line_naming_the_conversion(dump):
    for step in ("step-1", "step-2"):
        marker = json.loads((dump / "checkpoint" / step / MARKER).read_text())
        marker["format"] = 3
        (dump / "checkpoint" / step / MARKER).write_text(json.dumps(marker))
    before = snapshot(dump)
    result = subprocess.run(
        [sys.executable, "train.py", *overrides(dump, 4, *CKPT)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "python scripts/convert_checkpoint.py" in one_error_line(result.stderr)
    assert snapshot(dump) == before


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
    import elr.train.checkpointer as checkpoint

    ckpt = CheckpointManager(tmp_path / "ckpt", interval=1)
    layer = torch.nn.Linear(64, 64)
    room = shutil.disk_usage(tmp_path)
    full = room._replace(free=1000)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: full)
    with pytest.raises(
        CheckpointError,
        match=r"not enough space to save step-1: the disk holding .* \(mounted at "
        r".*\) has 0\.0 MB free, the save needs about",
    ):
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


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_learning_rate_that_is_not_finite_fails_the_config_check(value):
    with pytest.raises(
        ConfigError, match=f"^optimizer.lr: expected a finite number below 2\\^63 in size, got {value}$"
    ):
        load_config(DEBUG_TOML, ["--optimizer.lr", value])


def test_a_folder_that_cannot_be_written_is_one_line_before_any_work(dump, monkeypatch):
    """A read-only (or full, or forbidden) dump folder: a ConfigError naming the key and the errno's
    text, from the lock, before a model is built; nothing is left behind."""
    from elr.train import run_lock

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(run_lock.os, "open", read_only)
    with pytest.raises(ConfigError, match=r"^job.dump_folder: cannot write in .* \(Read-only file system\)"):
        run_lock.RunLock.acquire({"job.dump_folder": dump}, rank=0)
    assert not (dump / "train.lock").exists()

    blocked = dump / "a-file"
    blocked.write_text("")
    result = subprocess.run(
        [sys.executable, "train.py", *overrides(blocked / "run", 2)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "cannot write in" in one_error_line(result.stderr)
