"""Trains like train.py (same config and overrides) under expert parallelism combined with tensor or
context parallelism, and checks what each rank actually did: every rank of an expert-parallel
process group (the all-to-alls of one TP/CP position) ran the same loop counts, and the expert stacks
are split by expert on the ep mesh, [E / ep, ...] per rank, outside the TP mesh.
Launched by tests/test_expert_parallel.py with torchrun (gloo, CPU).
"""

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from elr.config import load_config  # noqa: E402
from elr.parallel.expert_parallel import expert_weights  # noqa: E402
from elr.train.trainer import Trainer  # noqa: E402


def main():
    trainer = Trainer(load_config(sys.argv[1], sys.argv[2:]))
    dims, ran = trainer.dims, []
    forward = trainer.model.forward

    def recording_forward(tokens, loops=1, cache=None, **kwargs):
        ran.append(loops)
        return forward(tokens, loops=loops, cache=cache, **kwargs)

    trainer.model.forward = recording_forward
    trainer.train()

    experts = trainer.model.args.moe_experts
    for weight in expert_weights(trainer.model):
        assert weight.device_mesh is dims.ep_mesh, weight.device_mesh
        assert weight.to_local().shape[0] == experts // dims.ep, weight.to_local().shape
    group = dist.get_process_group_ranks(dims.ep_mesh.get_group("ep"))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (group, ran))
    if dist.get_rank() == 0:
        groups = {tuple(g) for g, _ in every}
        assert len(groups) == dist.get_world_size() // dims.ep, groups
        for g in groups:
            assert len({tuple(every[r][1]) for r in g}) == 1, f"an expert group ran different k: {every}"
        print(f"ep_tp_cp: expert groups {sorted(groups)} each ran one k sequence; experts split {dims.ep} ways")
    trainer.close()


if __name__ == "__main__":
    main()
