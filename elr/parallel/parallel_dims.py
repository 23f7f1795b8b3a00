"""Process-group layout: dp_replicate x dp_shard = world size (HSDP when both exceed 1)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elr.config import ConfigError


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int

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

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks: each one is a column of slots with its own data and loop counts."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )
