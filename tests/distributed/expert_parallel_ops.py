"""Expert parallelism's pieces on 2 gloo ranks; launched once by tests/test_expert_parallel.py.

1. dispatch/combine: each rank owns half of the experts; rows routed on both ranks (uneven counts,
   an expert with no rows, a rank sending nothing to one expert) go through the two all-to-alls and
   the local grouped GEMM. Outputs and input gradients equal the grouped GEMM over all experts in one
   process; the owners' weight gradients equal the sum of both ranks' reference gradients.
2. An FSDP2 unit called k times per forward (the recurrent layers as separate units, allowed when
   every rank runs the same k) gives the same gradients and updates as one process.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from elr.models.experts import grouped_experts, permute_tokens  # noqa: E402
from elr.parallel.expert_parallel import dispatch_combine  # noqa: E402
from elr.parallel.parallel_dims import ParallelDims  # noqa: E402


def check_dispatch_combine(rank: int, world: int) -> None:
    E, dim, hidden, top_k = 6, 8, 12, 2  # rows of 16-byte multiples (torch._grouped_mm)
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(E, hidden, dim, generator=gen), torch.randn(E, dim, hidden, generator=gen)
    # Per-rank routing: rank 0 never picks expert 4, and no rank picks expert 1.
    n_tokens = 7 + 4 * rank
    choices = torch.tensor([0, 2, 3, 5] if rank == 0 else [0, 2, 3, 4, 5])
    pick = torch.stack([torch.randperm(len(choices), generator=gen)[:top_k] for _ in range(n_tokens)])
    indices = choices[pick]
    x = torch.randn(n_tokens, dim, generator=gen)
    order, token_of, offsets = permute_tokens(indices, E)
    rows = x[token_of]

    ref_rows = rows.clone().requires_grad_()
    ref_w1, ref_w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    ref = grouped_experts(ref_rows, ref_w1, ref_w2, offsets)
    upstream = torch.randn(ref.shape, generator=gen)
    (ref * upstream).sum().backward()

    mine = slice(rank * E // world, (rank + 1) * E // world)
    ep_rows = rows.clone().requires_grad_()
    ep_w1, ep_w2 = w1[mine].clone().requires_grad_(), w2[mine].clone().requires_grad_()
    out = dispatch_combine(ep_rows, offsets, ep_w1, ep_w2, dist.group.WORLD)
    (out * upstream).sum().backward()

    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    assert torch.allclose(ep_rows.grad, ref_rows.grad, atol=1e-5)
    for ref_w, ep_w in ((ref_w1, ep_w1), (ref_w2, ep_w2)):
        total = ref_w.grad.clone()
        dist.all_reduce(total)  # every rank's tokens reach the owner
        assert torch.allclose(ep_w.grad, total[mine], atol=1e-4), (ep_w.grad - total[mine]).abs().max()
    print(f"rank {rank}: dispatch/combine == grouped GEMM over all experts (forward, row and weight gradients)")


class Looped(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x, loops):
        h = self.embed(x)
        for _ in range(loops):
            for layer in self.layers:
                h = h + torch.tanh(layer(h))
        return self.head(h).square().mean()


def check_unit_called_k_times(rank: int, world: int) -> None:
    reference, sharded = Looped(), Looped()
    mesh = init_device_mesh("cpu", (world,))
    for layer in sharded.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    data = torch.Generator().manual_seed(1)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in (reference, sharded)]
    for loops in (3, 1, 2):
        x = torch.randn(4, 6, generator=data)
        for model, opt in zip((reference, sharded), opts):
            model(x, loops).backward()
            opt.step()
            opt.zero_grad()
    for (name, want), got in zip(reference.named_parameters(), sharded.parameters()):
        diff = (got.full_tensor() - want).abs().max().item()
        assert diff <= 1e-6, (name, diff)
    print(f"rank {rank}: FSDP2 units called k = 3, 1, 2 times == one process after 3 AdamW steps")


def check_dims(world: int) -> None:
    dims = ParallelDims(1, -1, world, ep=world)
    dims.build_mesh("cpu")
    assert dims.ep_mesh.size(1) == world and dims.ep_groups == 1 and dims.loops_shared_by_all


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    check_dispatch_combine(rank, world)
    check_unit_called_k_times(rank, world)
    check_dims(world)
    dist.barrier()  # no rank tears gloo down while the other is still in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
