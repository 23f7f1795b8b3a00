"""What the 2-rank TP checks (tp_grads.py, tp_float8.py, tp_loss.py) share: the debug model they use,
a TP copy of a single-process reference, and the run-and-report frame (one line per failure, exit 1
if any)."""

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from elr.models import build_model, flavors  # noqa: E402
from elr.parallel.parallelize import SequenceShards  # noqa: E402
from elr.parallel.tensor_parallel import apply_tensor_parallel  # noqa: E402

# Every layer kind, a vocabulary TP 2 does not divide, every ELR path and route replay.
ARGS = dataclasses.replace(flavors["debug"], vocab_size=257, max_seq_len=128, moe_route_replay=True).with_recurrence(
    max_loops=3, update="adaptive_delta", conditioning=True
)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def plain_name(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "")


def tp_copy(ref: torch.nn.Module, args, mesh: DeviceMesh, before_tp: Callable = None, after_tp: Callable = None):
    """The reference's weights in a model split over `mesh`, built on the meta device as the trainer
    builds it: before_tp(model) (float8), apply_tensor_parallel and the sequence group, after_tp(model)
    (AC, compile)."""
    with torch.device("meta"):
        model = build_model(args)
    if before_tp:
        before_tp(model)
    apply_tensor_parallel(model, mesh)
    model.set_sequence_shards(SequenceShards(mesh.get_group()))  # as parallelize() does
    if after_tp:
        after_tp(model)
    model.to_empty(device="cpu")
    model.init_weights()  # rope tables; the weights come from the reference
    with torch.no_grad():
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(ref_params[plain_name(name)], mesh, p.placements))
    return model


def tokens_for(mesh: DeviceMesh) -> torch.Tensor:
    """Two sequences of 17 tokens per TP rank (sequence parallelism splits them evenly)."""
    return torch.randint(0, ARGS.vocab_size, (2, 17 * mesh.size()), generator=torch.Generator().manual_seed(1))


def run_checks(name: str, checks: Callable[[DeviceMesh, list], None]) -> None:
    """checks(mesh, failures) on a 1-D TP mesh of every gloo rank; rank 0 reports."""
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    failures = []
    checks(mesh, failures)
    if dist.get_rank() == 0:
        print("\n".join(failures) or f"{name}: all checks passed")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)
