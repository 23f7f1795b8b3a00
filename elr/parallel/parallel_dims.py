"""Process-group layout: dp_replicate x dp_shard = world size (HSDP when both exceed 1).

Owns the device mesh and answers which data-parallel rank this process is: the trainer reads
`dp_rank`/`dp_world` for data and loop draws and never assumes dp_rank == global rank, so tensor,
context or expert dimensions can join the mesh later without touching it.

Expert parallelism (`ep`) splits the dp_shard dimension into groups of ep consecutive ranks: each
group owns one copy of every expert, E / ep whole experts per rank (elr/parallel/expert_parallel.py).
`ep_mesh` is (ep_replicate, ep): the groups, and the ranks within one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elr.config import ConfigError


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    ep: int = 1
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    ep_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.dp_shard == -1:
            if self.world_size % self.dp_replicate:
                raise ConfigError(
                    f"parallelism.data_parallel_replicate_degree: {self.dp_replicate} does not divide "
                    f"the world size {self.world_size}"
                )
            self.dp_shard = self.world_size // self.dp_replicate
        if self.dp_replicate * self.dp_shard != self.world_size:
            raise ConfigError(
                f"parallelism: data_parallel_replicate_degree ({self.dp_replicate}) x "
                f"data_parallel_shard_degree ({self.dp_shard}) must equal the world size ({self.world_size})"
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
        """The world's mesh (None for one process), kept for dp_mesh and dp_rank."""
        if self.world_size > 1:
            self.mesh = init_device_mesh(
                device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
            )
            if self.ep > 1:  # consecutive dp_shard ranks form a group: rows of the rank grid, ep wide
                ranks = self.mesh.mesh.reshape(-1, self.ep)
                self.ep_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("ep_replicate", "ep"))
        return self.mesh

    @property
    def ep_groups(self) -> int:
        """Expert-parallel groups: ranks of one group run the same k (their all-to-alls run inside
        each MoE layer); only whole groups may differ. Without EP every rank is its own group."""
        return self.dp_world // self.ep

    @property
    def loops_shared_by_all(self) -> bool:
        """Every data-parallel rank runs the same k on every microbatch (one expert group spans them)."""
        return self.ep > 1 and self.ep == self.dp_world

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP shards (and HSDP replicates) over; None without a process group."""
        if self.mesh is None:
            return None
        return self.mesh if self.dp_replicate > 1 else self.mesh["dp_shard"]

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel index in 0..dp_world-1, from its mesh coordinates."""
        if self.mesh is None:
            return 0
        return self.mesh.get_local_rank("dp_replicate") * self.dp_shard + self.mesh.get_local_rank("dp_shard")
