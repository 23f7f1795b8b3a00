"""Checkpointing: bit-identical round trips, atomic commits (including a real kill -9), fallback
past a corrupt newest checkpoint, the late switch's narrow allow_missing, async save, export, and
resharding 2 -> 1 and 1 -> 2 with torchrun (tests/distributed/ckpt_reshard.py)."""

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
import torch.distributed.checkpoint as dcp
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # also imported by tests/distributed/ckpt_reshard.py
from elr.checkpoint import load_model_export  # noqa: E402
from elr.checkpoint import MARKER  # noqa: E402
from elr.errors import CheckpointError  # noqa: E402
from elr.train.checkpoint import CheckpointManager  # noqa: E402
from elr.train.train_state import ModelState, OptimizerState  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
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
    train_state = {"step": 3, "rng": torch.get_rng_state(), "note": "x", "blob": b"\x00\x01",
                   "counters": {"tokens": 12345, "per_k": [1, 2, 0]}}
    ckpt.save(3, states(model, opt, train_state=train_state))
    assert sorted(p.name for p in (tmp_path / "step-3").iterdir()) == [
        ".metadata", "__0_0.distcp", MARKER]

    model2 = make_model(1)
    opt2 = make_opt(model2)
    opt2.param_groups[0]["lr"] = 1.0
    restored = {"step": 0, "rng": torch.zeros_like(train_state["rng"]), "note": "", "blob": b"",
                "counters": {"tokens": 0, "per_k": []}}
    assert ckpt.load(states(model2, opt2, train_state=restored)) == 3
    assert_same(snapshot(model2, opt2), snapshot(model, opt))
    assert torch.equal(restored.pop("rng"), train_state.pop("rng")) and restored == train_state
    assert opt2.param_groups[0]["lr"] == 3e-3

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
import torch.distributed.checkpoint as dcp
from pathlib import Path
from elr.train.checkpoint import CheckpointManager
from elr.train.train_state import ModelState

folder, sentinel = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
ckpt = CheckpointManager(folder, interval=1)
ckpt.save(1, {"model": ModelState(model)})

write_data = dcp.FileSystemWriter.write_data
def slow_write_data(self, plan, planner):  # shard files written; .metadata and commit to come
    result = write_data(self, plan, planner)
    sentinel.touch()
    time.sleep(600)
    return result
dcp.FileSystemWriter.write_data = slow_write_data

with torch.no_grad():
    model.weight.add_(1.0)
ckpt.save(2, {"model": ModelState(model)})
"""


def test_kill_9_during_save_keeps_previous_checkpoint(tmp_path):
    folder, sentinel = tmp_path / "ckpt", tmp_path / "writing"
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVER, str(folder), str(sentinel)],
                             env=ENV, cwd=REPO)
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
    assert any(p.suffix == ".distcp" for p in (folder / "step-2.tmp").iterdir())

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
    """Damage that neither sizes nor hashes can see (the marker rewritten to match), so that DCP
    itself fails (CheckpointException)."""
    _truncate(folder / "__0_0.distcp")
    marker = json.loads((folder / MARKER).read_text())
    marker["files"]["__0_0.distcp"] = (folder / "__0_0.distcp").stat().st_size
    marker["sha256"]["__0_0.distcp"] = hashlib.sha256((folder / "__0_0.distcp").read_bytes()).hexdigest()
    (folder / MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("damage", ["delete", "truncate", "garbage_metadata", "dcp_read_fails"])
def test_corrupt_latest_falls_back_with_one_line(tmp_path, caplog, damage):
    ckpt = CheckpointManager(tmp_path, interval=1)
    for step in (1, 2, 3):
        ckpt.save(step, states(filled(step), train_state={"step": step}))
    newest = tmp_path / "step-3"
    if damage == "delete":
        (newest / "__0_0.distcp").unlink()
    elif damage == "truncate":
        _truncate(newest / "__0_0.distcp")
    elif damage == "garbage_metadata":  # same size, so only reading it can tell
        meta = newest / ".metadata"
        meta.write_bytes(b"\x00" * meta.stat().st_size)
    else:
        _truncate_and_fix_marker(newest)

    layer, train_state = filled(0), {"step": 0}
    with caplog.at_level(logging.WARNING):
        assert ckpt.load(states(layer, train_state=train_state)) == 2
    assert train_state == {"step": 2} and torch.equal(layer.weight, filled(2).weight)
    ours = [r.getMessage() for r in caplog.records if r.name == "elr.train.checkpoint"]
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
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        assert sorted(saved) == sorted(model.state_dict())  # weights only, plain names
        assert all(m.properties.dtype == dtype for m in saved.values())
        loaded = make_model(1)
        load_model_export(path, loaded)
        for k, v in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v.to(dtype).float()), k
    assert ckpt.latest_step() is None  # an export is not a training checkpoint


@pytest.mark.slow  # multi-process: the slow tier (the default tier keeps one 2-rank FSDP check)
def test_reshard_with_torchrun(tmp_path):
    """2 FSDP2 ranks <-> 1 plain process, model and AdamW state bit-identical (one launch)."""
    model = make_model(7)
    opt = make_opt(model)
    train(model, opt, steps=5, seed=3)
    CheckpointManager(tmp_path / "from1", interval=1).save(5, states(model, opt))
    torch.save(snapshot(model, opt), tmp_path / "from1_ref.pt")

    worker = REPO / "tests" / "distributed" / "ckpt_reshard.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(worker), "--work", str(tmp_path)]
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
    for name, meta in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items():
        assert [tuple(c.sizes) for c in meta.chunks] == [tuple(want["model"][name].shape)]
    exported = make_model(11)
    load_model_export(path, exported)
    for k, v in want["model"].items():
        assert torch.equal(exported.state_dict()[k], v.to(torch.bfloat16).float()), k


def test_checkpoints_with_gdp_weights_in_the_old_row_order_are_refused(tmp_path):
    """A marker without "format" (saved before GDP's head-major k/v/beta rows) holding GDP weights
    would load them permuted: training loads and model exports refuse it; without GDP weights it loads."""
    gdp = nn.ModuleDict({"k_proj": nn.Linear(8, 8)})
    ckpt = CheckpointManager(tmp_path, interval=1)
    ckpt.save(1, {"model": ModelState(gdp)})
    export = ckpt.export_model(1, gdp, torch.float32)
    assert ckpt.load({"model": ModelState(gdp)}, step=1) == 1  # this version's format loads
    for folder in (tmp_path / "step-1", export):
        marker = json.loads((folder / MARKER).read_text())
        del marker["format"]
        (folder / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="order used before 2026-12-01"):
        ckpt.load({"model": ModelState(gdp)}, step=1)
    with pytest.raises(CheckpointError, match="order used before 2026-12-01"):
        load_model_export(export, gdp)
    plain = filled(1)
    CheckpointManager(tmp_path / "plain", interval=1).save(1, {"model": ModelState(plain)})
    marker_path = tmp_path / "plain" / "step-1" / MARKER
    marker = json.loads(marker_path.read_text())
    del marker["format"]
    marker_path.write_text(json.dumps(marker))
    assert CheckpointManager(tmp_path / "plain", interval=1).load({"model": ModelState(plain)}, step=1) == 1
