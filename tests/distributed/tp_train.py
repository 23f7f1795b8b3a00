"""Trains like train.py (same config and overrides) and checks the loop counts each rank actually ran:
equal inside every tensor-parallel group, and, over the run, different across data-parallel replicas.
Launched by tests/test_tensor_parallel.py with torchrun (gloo, CPU).
"""

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from elr.config import load_config  # noqa: E402
from elr.train.trainer import Trainer  # noqa: E402


def main():
    trainer = Trainer(load_config(sys.argv[1], sys.argv[2:]))
    ran = []
    forward = trainer.model.forward

    def recording_forward(tokens, loops=1, cache=None, **kwargs):  # head=, every_loop=: the loss's own
        ran.append(loops)
        return forward(tokens, loops=loops, cache=cache, **kwargs)

    trainer.model.forward = recording_forward
    trainer.train()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (trainer.dims.dp_rank, ran))
    if dist.get_rank() == 0:
        by_replica = {}
        for dp_rank, counts in every:
            assert by_replica.setdefault(dp_rank, counts) == counts, f"a TP group ran different k: {every}"
        assert len(by_replica) == trainer.dims.dp_world, every
        assert len({tuple(c) for c in by_replica.values()}) > 1, f"replicas should differ in k somewhere: {every}"
        print("tp_train: loop counts agree inside TP groups and differ across replicas")
    trainer.close()


if __name__ == "__main__":
    main()
