"""Checkpointing: bit-identical round trips, atomic commits (including a real kill -9), fallback
past a corrupt newest checkpoint, the late switch's narrow allow_missing, async save, export, and
resharding 2 -> 1 and 1 -> 2 with torchrun (tests/distributed/ckpt_reshard.py). The files of a
step folder: safetensors shards (one per rank) and values.json (tests/test_checkpoint_safety.py
proves they hold no pickle)."""

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # also imported by tests/distributed/ckpt_reshard.py
from elr.checkpoint import MARKER, Stored, load_model_export, verify  # noqa: E402
from elr.errors import CheckpointError  # noqa: E402
from elr.train.checkpointer import CheckpointManager  # noqa: E402
from elr.train.train_state import ModelState, OptimizerState  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
SHARD0 = "shard-00001-model-00001-of-00001.safetensors"  # the tensors of a one-process save
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Toy(nn.Module):
    """Two Linear layers (sizes that shard unevenly on 2 ranks) and an optional zero-initialised
    `conditioning` layer, the shape of ELR's late switch: it changes nothing until trained."""

    def __init__(self, conditioning: bool = False):
        super().__init__()
        if conditioning:  # registered first: it leads its optimizer param groups
            self.conditioning = nn.Linear(8, 5)
            nn.init.zeros_(self.conditioning.weight)
            nn.init.zeros_(self.conditioning.bias)
        self.body = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 5))

    def forward(self, x):
        y = self.body(x)
        return y + self.conditioning(x) if hasattr(self, "conditioning") else y


def make_model(seed: int, conditioning: bool = False) -> Toy:
    torch.manual_seed(seed)
    return Toy(conditioning)


def make_opt(model):
    """AdamW with the trainer's two groups: matrices decay, vectors do not."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1
    )


def train(model, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def states(model, opt=None, **extra):
    out = {"model": ModelState(model)}
    if opt is not None:
        out["optimizer"] = OptimizerState(model, opt)
    return {**out, **extra}


def snapshot(model, opt):
    clone = lambda v: v.clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {
        "model": {k: clone(v) for k, v in ModelState(model).state_dict().items()},
        "optimizer": {k: clone(v) for k, v in OptimizerState(model, opt).state_dict().items()},
    }


def same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def assert_same(got, want):
    assert got.keys() == want.keys()
    for part in want:
        assert got[part].keys() == want[part].keys(), part
        for k, v in want[part].items():
            assert same(got[part][k], v), f"{part}.{k} differs"


def filled(step: int) -> nn.Linear:
    """A layer whose weights all equal `step`, to tell checkpoints apart at a glance."""
    layer = nn.Linear(16, 16)
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(step)
    return layer


def test_round_trip_is_bit_identical_and_resumes(tmp_path):
    model, ckpt = make_model(0), CheckpointManager(tmp_path, interval=1)
    opt = make_opt(model)
    train(model, opt, steps=3, seed=1)
    opt.param_groups[0]["lr"] = 3e-3  # as an LR scheduler would
    train_state = {
        "step": 3,
        "rng": torch.get_rng_state(),
        "note": "x",
        "ratio": float("inf"),
        "counters": {"tokens": 12345, "per_k": [1, 2, 0]},
    }
    ckpt.save(3, states(model, opt, train_state=train_state))
    assert sorted(p.name for p in (tmp_path / "step-3").iterdir()) == [MARKER, SHARD0, "values.json"]

    model2 = make_model(1)
    opt2 = make_opt(model2)
    opt2.param_groups[0]["lr"] = 1.0
    restored = {
        "step": 0,
        "rng": torch.zeros_like(train_state["rng"]),
        "note": "",
        "ratio": 0.0,
        "counters": {"tokens": 0, "per_k": []},
    }
    assert ckpt.load(states(model2, opt2, train_state=restored)) == 3
    assert_same(snapshot(model2, opt2), snapshot(model, opt))
    assert torch.equal(restored.pop("rng"), train_state.pop("rng")) and restored == train_state
    assert opt2.param_groups[0]["lr"] == 3e-3
    assert opt2.param_groups[0]["betas"] == (0.9, 0.999)  # a tuple again, as the optimizer made it

    train(model, opt, steps=2, seed=7)
    train(model2, opt2, steps=2, seed=7)
    assert_same(snapshot(model2, opt2), snapshot(model, opt))


def test_keep_latest_k_latest_step_and_load_step(tmp_path):
    ckpt = CheckpointManager(tmp_path, interval=2, keep_latest_k=2)
    assert ckpt.should_save(4) and not ckpt.should_save(3)
    assert ckpt.latest_step() is None and ckpt.load(states(filled(0))) is None
    for step in range(1, 5):
        ckpt.save(step, states(filled(step), train_state={"step": step}))
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-4"]
    assert ckpt.latest_step() == 4
    ckpt.save(4, states(filled(40), train_state={"step": 4}))  # a re-save replaces the folder
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-4"]

    layer, train_state = filled(0), {"step": 0}
    assert ckpt.load(states(layer, train_state=train_state), step=3) == 3
    assert train_state == {"step": 3} and torch.equal(layer.weight, filled(3).weight)
    assert ckpt.load(states(layer, train_state=train_state)) == 4
    assert torch.equal(layer.weight, filled(40).weight)
    with pytest.raises(CheckpointError, match="step-1 does not exist"):
        ckpt.load(states(layer, train_state=train_state), step=1)


def test_folders_without_marker_are_ignored_and_stale_tmp_removed(tmp_path):
    ckpt = CheckpointManager(tmp_path, interval=1)
    ckpt.save(1, states(filled(1)))
    shutil.copytree(tmp_path / "step-1", tmp_path / "step-2")  # complete files, but no marker
    (tmp_path / "step-2" / MARKER).unlink()
    (tmp_path / "step-3.tmp").mkdir()  # a save that never finished
    assert ckpt.latest_step() == 1
    layer = filled(0)
    assert ckpt.load(states(layer)) == 1 and torch.equal(layer.weight, filled(1).weight)
    ckpt.save(4, states(filled(4)))
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-2", "step-4"]


KILLED_SAVER = r"""
import sys, time, torch
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from pathlib import Path
from elr.train.checkpointer import CheckpointManager
from elr.train.train_state import ModelState

folder, sentinel = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
ckpt = CheckpointManager(folder, interval=1)
ckpt.save(1, {"model": ModelState(model)})

write_data = HuggingFaceStorageWriter.write_data
def slow_write_data(self, plan, planner):  # shard files written; config, hashes and commit to come
    result = write_data(self, plan, planner)
    sentinel.touch()
    time.sleep(600)
    return result
HuggingFaceStorageWriter.write_data = slow_write_data

with torch.no_grad():
    model.weight.add_(1.0)
ckpt.save(2, {"model": ModelState(model)})
"""


@pytest.mark.slow  # a process of its own, killed (in this process: a save that never finished, above)
def test_kill_9_during_save_keeps_previous_checkpoint(tmp_path):
    folder, sentinel = tmp_path / "ckpt", tmp_path / "writing"
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVER, str(folder), str(sentinel)], env=ENV, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not sentinel.exists():
            assert child.poll() is None, "the saving process died before the kill"
            assert time.monotonic() < deadline, "the saving process never reached its second save"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert sorted(os.listdir(folder)) == ["step-1", "step-2.tmp"]
    assert sorted(p.name for p in (folder / "step-2.tmp").iterdir()) == [SHARD0, "values.json"]

    ckpt = CheckpointManager(folder, interval=1)
    layer = nn.Linear(64, 64)
    assert ckpt.load({"model": ModelState(layer)}) == 1
    torch.manual_seed(0)
    assert torch.equal(layer.weight, nn.Linear(64, 64).weight)
    ckpt.save(3, {"model": ModelState(layer)})
    assert sorted(os.listdir(folder)) == ["step-1", "step-3"]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _truncate_and_fix_marker(folder: Path) -> None:
    """Damage that neither sizes nor hashes can see (the marker rewritten to match), so that reading
    the safetensors file itself fails."""
    _truncate(folder / SHARD0)
    marker = json.loads((folder / MARKER).read_text())
    marker["files"][SHARD0] = (folder / SHARD0).stat().st_size
    marker["sha256"][SHARD0] = hashlib.sha256((folder / SHARD0).read_bytes()).hexdigest()
    (folder / MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("damage", ["delete", "truncate", "garbage_header", "resealed_truncation"])
def test_corrupt_latest_falls_back_with_one_line(tmp_path, caplog, damage):
    ckpt = CheckpointManager(tmp_path, interval=1)
    for step in (1, 2, 3):
        ckpt.save(step, states(filled(step), train_state={"step": step}))
    newest = tmp_path / "step-3"
    if damage == "delete":
        (newest / SHARD0).unlink()
    elif damage == "truncate":
        _truncate(newest / SHARD0)
    elif damage == "garbage_header":  # same size: the hash tells
        shard = newest / SHARD0
        shard.write_bytes(b"\x00" * 64 + shard.read_bytes()[64:])
    else:
        _truncate_and_fix_marker(newest)

    layer, train_state = filled(0), {"step": 0}
    with caplog.at_level(logging.WARNING):
        assert ckpt.load(states(layer, train_state=train_state)) == 2
    assert train_state == {"step": 2} and torch.equal(layer.weight, filled(2).weight)
    ours = [r.getMessage() for r in caplog.records if r.name == "elr.train.checkpointer"]
    assert len(ours) == 1 and str(newest) in ours[0] and "\n" not in ours[0], ours
    with pytest.raises(CheckpointError, match="step-3"):
        ckpt.load(states(layer, train_state=train_state), step=3)


def test_late_switch_loads_old_checkpoint_into_model_with_new_params(tmp_path):
    ckpt = CheckpointManager(tmp_path, interval=1)
    old = make_model(0)
    old_opt = make_opt(old)
    train(old, old_opt, steps=3, seed=1)
    for group, lr in zip(old_opt.param_groups, (3e-3, 2e-3)):  # as an LR schedule would
        group["lr"] = lr
    ckpt.save(3, states(old, old_opt))
    want = snapshot(old, old_opt)

    new = make_model(5, conditioning=True)
    new_opt = make_opt(new)
    before = snapshot(new, new_opt)
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: model\.conditioning"):
        ckpt.load(states(new, new_opt))
    with pytest.raises(CheckpointError, match=r"\d+ requested keys missing.*conditioning\.weight"):
        ckpt.load(states(new, new_opt), allow_missing=lambda key: "gate" in key)
    assert_same(snapshot(new, new_opt), before)  # a refused load changes nothing

    assert ckpt.load(states(new, new_opt), allow_missing=lambda key: "conditioning" in key) == 3
    got = snapshot(new, new_opt)
    for part in want:  # old entries restored; new ones as they were, except group hyperparameters
        for key, value in got[part].items():
            if key in want[part]:
                assert same(value, want[part][key]), key
            else:
                assert "conditioning" in key, key
                assert key.startswith("param_groups.") or same(value, before[part][key]), key
    assert torch.count_nonzero(new.conditioning.weight) == 0
    assert [g["lr"] for g in new_opt.param_groups] == [3e-3, 2e-3]  # a group keeps saved values
    assert new_opt.state[new.conditioning.weight]["step"] == 0  # as if never stepped

    # One more step: old params continue, the new ones take a fresh AdamW first step.
    fresh = nn.Parameter(new.conditioning.weight.detach().clone())
    fresh_opt = torch.optim.AdamW([fresh], lr=3e-3, weight_decay=0.1)
    new(torch.randn(4, 8)).square().mean().backward()
    fresh.grad = new.conditioning.weight.grad.clone()
    new_opt.step()
    fresh_opt.step()
    assert torch.equal(new.conditioning.weight, fresh)
    assert new_opt.state[new.conditioning.weight]["step"] == 1
    assert new_opt.state[new.body[0].weight]["step"] == 4


def test_unexpected_and_misshapen_keys_are_errors(tmp_path):
    ckpt = CheckpointManager(tmp_path, interval=1)
    switched = make_model(0, conditioning=True)
    ckpt.save(1, states(switched, make_opt(switched)))
    plain = make_model(0)
    with pytest.raises(CheckpointError, match=r"keys not requested: model\.conditioning"):
        ckpt.load(states(plain, make_opt(plain)), allow_missing=lambda key: True)
    # a top-level name that is not asked for is fine: evaluation loads only the model
    assert ckpt.load(states(switched)) == 1
    one_group = torch.optim.AdamW(switched.parameters())  # the checkpoint has two groups
    with pytest.raises(CheckpointError, match="one param group here, mixed saved weight_decay"):
        ckpt.load(states(switched, one_group))
    wider = make_model(0, conditioning=True)
    wider.conditioning = nn.Linear(8, 7)
    with pytest.raises(CheckpointError, match=r"shapes differ.*conditioning\.weight \(5, 8\)"):
        ckpt.load(states(wider))


def test_async_save_round_trip(tmp_path):
    ckpt = CheckpointManager(tmp_path, interval=1, async_save=True)
    model = make_model(0)
    opt = make_opt(model)
    train(model, opt, steps=2, seed=1)
    want = snapshot(model, opt)
    ckpt.save(2, states(model, opt, train_state={"step": 2}))
    train(model, opt, steps=1, seed=2)  # training goes on while the files are written
    ckpt.wait()
    assert (tmp_path / "step-2" / MARKER).is_file()
    restored, train_state = make_model(1), {"step": 0}
    restored_opt = make_opt(restored)
    assert ckpt.load(states(restored, restored_opt, train_state=train_state)) == 2
    assert_same(snapshot(restored, restored_opt), want) and train_state == {"step": 2}

    ckpt.save(3, states(model, opt, train_state={"step": 3}))
    ckpt.save(4, states(model, opt, train_state={"step": 4}))  # commits step 3 first
    assert (tmp_path / "step-3" / MARKER).is_file()
    assert ckpt.load(states(restored, restored_opt, train_state=train_state)) == 4  # waits


def test_export_model_full_tensors_in_dtype(tmp_path):
    ckpt = CheckpointManager(tmp_path, interval=1)
    model = make_model(0)
    for dtype in (torch.float32, torch.bfloat16):
        path = ckpt.export_model(1, model, dtype)
        assert path == tmp_path / "step-1-model" and (path / MARKER).is_file()
        saved = Stored(path, verify(path)).tensors
        assert sorted(saved) == sorted(model.state_dict())  # weights only, plain names
        assert all(m.properties.dtype == dtype for m in saved.values())
        loaded = make_model(1)
        load_model_export(path, loaded)
        for k, v in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v.to(dtype).float()), k
    assert ckpt.latest_step() is None  # an export is not a training checkpoint


@pytest.mark.slow  # multi-process: the slow tier
def test_reshard_with_torchrun(tmp_path):
    """2 FSDP2 ranks <-> 1 plain process, model and AdamW state bit-identical (one launch)."""
    model = make_model(7)
    opt = make_opt(model)
    train(model, opt, steps=5, seed=3)
    CheckpointManager(tmp_path / "from1", interval=1).save(5, states(model, opt))
    torch.save(snapshot(model, opt), tmp_path / "from1_ref.pt")

    worker = REPO / "tests" / "distributed" / "ckpt_reshard.py"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(worker),
        "--work",
        str(tmp_path),
    ]
    run = subprocess.run(cmd, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "all checks passed" in run.stdout

    # 2 -> 1: the sharded run's checkpoint into a plain module and a fresh AdamW
    want = torch.load(tmp_path / "from2_ref.pt")
    plain = make_model(9)
    plain_opt = make_opt(plain)
    train_state = {"step": 0, "world": 0}
    ckpt = CheckpointManager(tmp_path / "from2", interval=1)
    assert ckpt.load(states(plain, plain_opt, train_state=train_state), step=3) == 3
    assert_same(snapshot(plain, plain_opt), want)
    assert train_state == {"step": 3, "world": 2}
    # the export written from shards holds full bf16 tensors
    path = tmp_path / "from2" / "step-3-model"
    for name, meta in Stored(path, verify(path)).tensors.items():
        assert [tuple(c.sizes) for c in meta.chunks] == [tuple(want["model"][name].shape)]
    exported = make_model(11)
    load_model_export(path, exported)
    for k, v in want["model"].items():
        assert torch.equal(exported.state_dict()[k], v.to(torch.bfloat16).float()), k


def old_format(folder: Path, step: int, state: dict, fmt: int = 3) -> Path:
    """A step folder as versions before format 4 wrote it: DCP's own files (a pickled `.metadata`)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=folder, no_dist=True)
    files = {p.name: p.stat().st_size for p in folder.iterdir()}
    marker = {"format": fmt, "step": step, "files": files}
    if fmt >= 3:
        marker["sha256"] = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in files}
    if fmt == 1:
        del marker["format"]
    (folder / MARKER).write_text(json.dumps(marker))
    return folder


def convert(*paths) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "convert_checkpoint.py"), *map(str, paths)],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_an_old_format_is_refused_naming_the_conversion_which_round_trips(tmp_path):
    model = make_model(0)
    opt = make_opt(model)
    train(model, opt, steps=2, seed=1)
    want = snapshot(model, opt)
    folder = tmp_path / "ckpt"
    old_format(folder / "step-2", 2, {**states(model, opt), "train_state": {"step": 2, "note": "x"}})
    ckpt = CheckpointManager(folder, interval=1)
    fresh = make_model(1)
    fresh_opt = make_opt(fresh)
    line = rf"format 3, whose DCP \.metadata is a pickle .*python scripts/convert_checkpoint\.py {folder / 'step-2'}$"
    with pytest.raises(CheckpointError, match=line):
        ckpt.load(states(fresh, fresh_opt))
    with pytest.raises(CheckpointError, match=line):
        ckpt.latest_step()
    with pytest.raises(CheckpointError, match=line):
        load_model_export(folder / "step-2", fresh)

    result = convert(folder)
    assert result.returncode == 0, result.stderr
    assert f"converted {folder / 'step-2'} (format 3 -> 4)" in result.stdout
    assert sorted(os.listdir(folder)) == ["step-2", "step-2.format-3"]  # the original kept
    train_state = {"step": 0, "note": ""}
    assert ckpt.load(states(fresh, fresh_opt, train_state=train_state)) == 2
    assert_same(snapshot(fresh, fresh_opt), want) and train_state == {"step": 2, "note": "x"}
    again = convert(folder / "step-2")
    assert again.returncode == 0 and "already in format 4" in again.stdout


@pytest.mark.slow
def test_the_conversion_refuses_gdp_weights_in_the_old_row_order(tmp_path):
    """A format-1 marker (before GDP's head-major k/v/beta rows) holding GDP weights would load them
    permuted: not converted; without GDP weights it converts."""
    gdp = old_format(
        tmp_path / "gdp" / "step-1", 1, {"model": nn.ModuleDict({"k_proj": nn.Linear(8, 8)}).state_dict()}, 1
    )
    result = convert(gdp)
    assert result.returncode == 2 and "order used before 2026-12-01" in result.stderr
    assert sorted(os.listdir(gdp.parent)) == ["step-1"] and (gdp / ".metadata").is_file()  # untouched
    plain = old_format(tmp_path / "plain" / "step-1", 1, {"model": filled(1).state_dict()}, 1)
    assert convert(plain).returncode == 0
    layer = filled(0)
    assert CheckpointManager(plain.parent, interval=1).load(states(layer)) == 1
    assert torch.equal(layer.weight, filled(1).weight)
