"""Process-group layout: dp_replicate x dp_shard x cp x tp = world size, as one device mesh.

Starts the process group (`init_distributed`), owns the device mesh and answers which data-parallel
rank this process is: the trainer reads `dp_rank`/`dp_world` for data and loop draws and never
assumes dp_rank == global rank. Data
parallelism is replicate x shard only: the context-parallel (cp) and tensor-parallel (tp) ranks of
one data-parallel rank read the same sequences and run the same loop counts, since their layers
exchange activations every call. tp is the innermost dimension, so a TP group is neighbouring ranks.

Expert parallelism (`ep`) splits the dp_shard dimension into groups of ep neighbouring dp_shard
ranks with the same (dp_replicate, cp, tp) coordinates: each group owns one copy of every expert,
E / ep whole experts per rank (elr/parallel/expert_parallel.py). Under TP or CP each TP/CP position
has its own groups, whose all-to-alls carry that position's tokens. `ep_mesh` is (ep_replicate, ep):
ep_replicate spans every rank holding the same experts (the other groups, every cp and tp position),
ep the ranks of one group. A group's ranks are consecutive data-parallel ranks, so they share a loop
draw (the trainer draws per group), and their cp/tp positions run their data-parallel rank's k.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elr.errors import ConfigError

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device) of this process as torchrun started it; the process group is
    initialised when there are several (gloo on CPU; NCCL for CUDA tensors, gloo beside it for CPU ones)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    return (dist.get_rank() if world_size > 1 else 0), world_size, device


def expert_groups(ranks: torch.Tensor, ep: int) -> torch.Tensor:
    """The expert-parallel groups of a rank grid [dp_replicate, dp_shard, cp, tp], one per row
    [groups, ep]: ep neighbouring dp_shard ranks with the same dp_replicate, cp and tp coordinates."""
    replicate, shard, cp, tp = ranks.shape
    return ranks.reshape(replicate, shard // ep, ep, cp, tp).permute(0, 1, 3, 4, 2).reshape(-1, ep)


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    ep: int = 1
    cp: int = 1
    tp: int = 1
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    ep_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        """The rules that need the world size, known only at launch; the degrees themselves are checked with the
        config (`Parallelism.check`, elr/config/job.py), against the model in elr/models/from_config.py."""
        for key, degree in (("context_parallel_degree", self.cp), ("tensor_parallel_degree", self.tp)):
            if self.world_size % degree:
                raise ConfigError(f"parallelism.{key}: {degree} does not divide the world size {self.world_size}")
        dp_world = self.world_size // (self.cp * self.tp)
        if dp_world * self.cp * self.tp != self.world_size:
            raise ConfigError(
                f"parallelism: context_parallel_degree ({self.cp}) x tensor_parallel_degree ({self.tp}) "
                f"does not divide the world size ({self.world_size})"
            )
        if self.dp_shard == -1:
            if dp_world % self.dp_replicate:
                raise ConfigError(
                    f"parallelism.data_parallel_replicate_degree: {self.dp_replicate} does not divide "
                    f"the {dp_world} data-parallel ranks (world size / (cp x tp))"
                )
            self.dp_shard = dp_world // self.dp_replicate
        if self.dp_replicate * self.dp_shard * self.cp * self.tp != self.world_size:
            raise ConfigError(
                f"parallelism: data_parallel_replicate_degree ({self.dp_replicate}) x data_parallel_shard_degree "
                f"({self.dp_shard}) x context_parallel_degree ({self.cp}) x tensor_parallel_degree ({self.tp}) "
                f"must equal the world size ({self.world_size})"
            )
        if self.dp_shard % self.ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree: {self.ep} does not divide the data-parallel shard degree "
                f"{self.dp_shard}"
            )

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks: each one is a column of slots with its own data and loop counts."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The world's mesh (None for one process), kept for the sub-meshes below."""
        if self.world_size > 1:
            self.mesh = init_device_mesh(
                device_type, (self.dp_replicate, self.dp_shard, self.cp, self.tp), mesh_dim_names=MESH_DIMS
            )
            if self.ep > 1:
                groups = expert_groups(self.mesh.mesh, self.ep)
                self.ep_mesh = DeviceMesh(device_type, groups, mesh_dim_names=("ep_replicate", "ep"))
            if self.cp > 1:
                self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            if self.cp > 1 and self.tp > 1:
                self.mesh["cp", "tp"]._flatten("cp_tp")
        return self.mesh

    @property
    def ep_groups(self) -> int:
        """Loop-draw groups of data-parallel ranks: the ep ranks of an expert group run the same k
        (their all-to-alls run inside each MoE layer); only whole groups may differ. Each counts once
        however many cp x tp positions it spans. Without EP every data-parallel rank is its own group."""
        return self.dp_world // self.ep

    @property
    def loops_shared_by_all(self) -> bool:
        """Every rank runs the same k on every microbatch: there is one data-parallel rank (its cp and
        tp ranks alone, e.g. the 256K stage on CP 8), or one expert group spans the data-parallel ranks,
        whose cp/tp positions run their k (FSDP's dp_shard x cp mesh included)."""
        return self.dp_world == 1 or (self.ep > 1 and self.ep == self.dp_world)

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The data-parallel ranks (replicate x shard); None without data parallelism."""
        if self.mesh is None or self.dp_world == 1:
            return None
        return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.mesh["dp_shard"]

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP shards (and HSDP replicates) over; None when nothing is to be sharded.

        Context-parallel ranks join the shard dimension (torchtitan's dp_shard_cp): they hold the same
        parameters and each computes part of every gradient, so FSDP shards and reduces over them too.
        """
        if self.cp == 1:
            return self.dp_mesh
        if self.mesh is None:
            return None
        return self.mesh["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else self.mesh["dp_shard_cp"]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The tensor-parallel group of this rank; None when tp = 1."""
        return self.mesh["tp"] if self.mesh is not None and self.tp > 1 else None

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The context-parallel group of this rank; None when cp = 1."""
        return self.mesh["cp"] if self.mesh is not None and self.cp > 1 else None

    @property
    def sequence_mesh(self) -> DeviceMesh | None:
        """The ranks that split each sequence between them (cp x tp); None when each rank has whole
        sequences. The MoE balance loss counts routes over this group: it is defined per sequence."""
        if self.mesh is None or self.cp * self.tp == 1:
            return None
        return self.mesh["cp_tp"] if self.cp > 1 and self.tp > 1 else self.mesh["cp" if self.cp > 1 else "tp"]

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel index in 0..dp_world-1, from its mesh coordinates."""
        if self.mesh is None:
            return 0
        return self.mesh.get_local_rank("dp_replicate") * self.dp_shard + self.mesh.get_local_rank("dp_shard")

    @property
    def cp_rank(self) -> int:
        """This process's position in its context-parallel group: which slice of each sequence it holds."""
        return self.mesh.get_local_rank("cp") if self.mesh is not None and self.cp > 1 else 0
