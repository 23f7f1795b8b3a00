"""Context parallelism with compiled layers on 2 gloo ranks equals one eager process; run by the slow
tier (tests/test_context_parallel.py): inductor's cold compile takes about 7 minutes on 2 CPU cores,
a warm cache about 100 s.

    torchrun --standalone --nproc_per_node 2 tests/distributed/cp_compile.py [backend]

The debug model at k = 3 with its GDP and attention layers compiled (inductor by default; aot_eager
fails on the GDP layer's backward with or without CP, a view-stride error of its own), logits and
parameter gradients (summed over the CP ranks) against the uncompiled model on the whole sequence.
"""

import copy
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from elr.models import build_model  # noqa: E402
from elr.models.args import flavors  # noqa: E402
from elr.parallel.context_parallel import enable_context_parallel, shard_sequence  # noqa: E402

ARGS = dataclasses.replace(flavors["debug"], gdp_impl="chunk", cond_dim=16).with_recurrence(
    max_loops=3, update="adaptive_delta", conditioning=True
)


def main(backend: str = "inductor"):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    rank, group = mesh.get_local_rank(), mesh.get_group()
    model = build_model(ARGS)
    with torch.no_grad():
        model.init_weights()
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    tokens = torch.randint(0, ARGS.vocab_size, (2, 75))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    reference, sharded = copy.deepcopy(model), copy.deepcopy(model)
    enable_context_parallel(sharded, mesh)
    for layer in sharded.layers():
        if layer.kind in "GA":
            layer.compile(backend=backend)
    want = reference(inputs, loops=3)
    got = sharded(shard_sequence(inputs, rank, 2), loops=3)
    F.cross_entropy(want.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    F.cross_entropy(got.flatten(0, 1), shard_sequence(labels, rank, 2).flatten(), reduction="sum").backward()
    errors = [((got - shard_sequence(want, rank, 2)).abs().max() / want.abs().max()).item()]
    for p, p_cp in zip(reference.parameters(), sharded.parameters()):
        grad = p_cp.grad.clone()
        dist.all_reduce(grad, group=group)
        errors.append(((grad - p.grad).abs().max() / p.grad.abs().max()).item())
    print(f"rank {rank}, {backend}: logits {errors[0]:.1e}, gradients {max(errors[1:]):.1e} (max relative error)")
    assert max(errors) <= 1e-5, errors
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
