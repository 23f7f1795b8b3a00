"""2-rank checkpoint checks, launched by tests/test_checkpoint.py with torchrun (gloo, CPU).

One launch covers: (a) FSDP2 save on 2 ranks (+ full-tensor references for the 1-process side),
(b) load of a 1-process checkpoint into 2 sharded ranks (1 -> 2), (c) async save with 2 ranks,
(d) all ranks falling back together past a corrupt newest checkpoint, (e) export_model from shards.
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from elr.train.checkpointer import CheckpointManager  # noqa: E402
from elr.train.train_state import ModelState, OptimizerState  # noqa: E402
from tests.test_checkpoint import make_model, make_opt, train  # noqa: E402


def full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def full_snapshot(model, opt):
    """Unsharded copies of model weights and flattened optimizer state (a collective)."""
    return {
        "model": {k: full(v).clone() for k, v in ModelState(model).state_dict().items()},
        "optimizer": {
            k: full(v).clone() if isinstance(v, torch.Tensor) else v
            for k, v in OptimizerState(model, opt).state_dict().items()
        },
    }


def assert_same(got, want, what):
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for k, v in want.items():
        ok = torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
        assert ok, f"{what}: {k} differs"


def sharded(seed):
    model = make_model(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.body:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, make_opt(model)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True, help="folder shared with the test process")
    work = Path(parser.parse_args().work)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    # (a) save from 2 FSDP2 ranks; each rank sees different data, like data parallelism.
    model, opt = sharded(seed=0)
    train(model, opt, steps=3, seed=10 + rank)
    ckpt = CheckpointManager(work / "from2", interval=1)
    ckpt.save(
        3, {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "train_state": {"step": 3, "world": 2}}
    )
    ref = full_snapshot(model, opt)
    if rank == 0:
        torch.save(ref, work / "from2_ref.pt")

    # (d) a corrupt newest checkpoint: every rank must fall back to the same one (step 3).
    train(model, opt, steps=1, seed=20 + rank)
    ckpt.save(4, {"model": ModelState(model), "optimizer": OptimizerState(model, opt)})
    if rank == 0:
        (work / "from2" / "step-4" / "shard-00002-model-00001-of-00001.safetensors").unlink()  # rank 1's shards
    dist.barrier()
    fresh, fresh_opt = sharded(seed=1)
    train_state = {"step": 0, "world": 0}
    got = ckpt.load(
        {"model": ModelState(fresh), "optimizer": OptimizerState(fresh, fresh_opt), "train_state": train_state}
    )
    assert got == 3 and train_state == {"step": 3, "world": 2}, (got, train_state)
    assert_same(full_snapshot(fresh, fresh_opt)["model"], ref["model"], "fallback model")
    assert_same(full_snapshot(fresh, fresh_opt)["optimizer"], ref["optimizer"], "fallback optim")

    # (e) export the step-3 weights as full bf16 tensors (read back by the test process).
    ckpt.export_model(3, fresh, torch.bfloat16)

    # (b) 1 -> 2: the test process saved `from1` from a plain module in one process.
    model, opt = sharded(seed=2)
    loaded = CheckpointManager(work / "from1", interval=1).load(
        {"model": ModelState(model), "optimizer": OptimizerState(model, opt)}
    )
    assert loaded == 5, loaded
    want = torch.load(work / "from1_ref.pt")
    got = full_snapshot(model, opt)
    assert_same(got["model"], want["model"], "1->2 model")
    assert_same(got["optimizer"], want["optimizer"], "1->2 optimizer")
    train(model, opt, steps=1, seed=30 + rank)  # the loaded optimizer steps

    # (c) async save on 2 ranks: state changed right after save() must not leak into the checkpoint.
    ckpt = CheckpointManager(work / "async2", interval=1, async_save=True)
    before = full_snapshot(model, opt)
    ckpt.save(1, {"model": ModelState(model), "optimizer": OptimizerState(model, opt)})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ckpt.save(2, {"model": ModelState(model), "optimizer": OptimizerState(model, opt)})
    ckpt.wait()
    assert sorted(os.listdir(work / "async2")) == ["step-1", "step-2"], os.listdir(work / "async2")
    fresh, fresh_opt = sharded(seed=3)
    assert ckpt.load({"model": ModelState(fresh), "optimizer": OptimizerState(fresh, fresh_opt)}, step=1) == 1
    assert_same(full_snapshot(fresh, fresh_opt)["model"], before["model"], "async model")
    assert_same(full_snapshot(fresh, fresh_opt)["optimizer"], before["optimizer"], "async optim")

    dist.barrier()
    if rank == 0:
        print("ckpt_reshard: all checks passed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
