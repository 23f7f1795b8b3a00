"""Muon under FSDP2 on 2 gloo ranks equals one process; launched by tests/test_distributed.py.

The toy holds the two sharded cases: a 2D matrix of 7 rows (split 4/3 by rows, so it is gathered
for the orthogonalisation) and an expert stack [3, 5, 8] (split 2/1 by experts, whole matrices on
each rank, orthogonalised locally). Every rank sees the same batch, so the averaged gradients
equal one process's exactly and any difference comes from the optimizer.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from elr.train.optimizer import MuonAdamW  # noqa: E402


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(8, 7)
        self.experts = nn.Parameter(torch.randn(3, 5, 8) * 0.3)

    def forward(self, x):
        h = torch.tanh(self.hidden(x)).square().mean()
        return h + torch.einsum("bi,eoi->beo", x, self.experts).tanh().square().mean()


def train(model: Toy, steps: int = 3) -> None:
    opt = MuonAdamW(
        [
            {"params": [model.hidden.weight, model.experts], "muon": True, "momentum": 0.9},
            {"params": [model.hidden.bias], "muon": False},
        ],
        lr=0.05,
        weight_decay=0.1,
        foreach=True,
    )
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=data)).backward()
        opt.step()
        opt.zero_grad()


def main():
    dist.init_process_group("gloo")
    reference, sharded = Toy(), Toy()
    train(reference)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    assert isinstance(sharded.experts, DTensor) and sharded.experts.to_local().shape[0] < 3
    train(sharded)
    for (name, want), got in zip(reference.named_parameters(), sharded.parameters()):
        diff = (got.full_tensor() - want).abs().max().item()
        moved = (want - Toy().get_parameter(name)).abs().max().item()
        print(f"rank {dist.get_rank()} {name}: max |FSDP - one process| = {diff:.2e} (moved {moved:.2e})")
        assert diff <= 1e-5 and moved > 1e-3, name
    dist.barrier()  # no rank tears gloo down while the other is still in the last gather (SIGABRT at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
