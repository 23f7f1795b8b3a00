"""Count the bytes a forward pass leaves alive for backward: the activation memory of one microbatch.

`LiveTensors` is a dispatch mode that notes every tensor an op creates; after the forward (with the
loss still referenced) the storages still alive are exactly what autograd, activation checkpointing
(region inputs, selectively saved outputs) and the caller keep for backward. `live_activation_bytes`
is the one counter built on it: the memory plan (elr/tools/memory_plan.py) runs it on the meta device
to predict a full-size model's activations from its layer shapes without allocating them, and the
tests run it on real CPU forwards to hold the plan to what the code keeps.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def storage_key(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):  # a wrapper: the memory is its local shard's
        t = t._local_tensor
    return t.untyped_storage()._cdata


class LiveTensors(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.created: dict[int, tuple[list[weakref.ref], int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, DTensor):  # a wrapper: its memory is the local shard (which the mode does not see)
                t = t._local_tensor
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                refs, _ = self.created.get(storage_key(t), ([], 0))
                refs.append(weakref.ref(t))
                self.created[storage_key(t)] = (refs, t.untyped_storage().nbytes())
        return out

    def live_bytes(self, exclude: set[int] = frozenset()) -> int:
        return sum(
            nbytes
            for key, (refs, nbytes) in self.created.items()
            if key not in exclude and any(r() is not None for r in refs)
        )


def live_activation_bytes(run: Callable[[], Any], module: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes that `run()` (a forward, and its loss) leaves alive while its result is still held: what
    backward will read. The module's parameters and buffers and the given inputs are not activations."""
    own = {storage_key(t) for t in [*module.parameters(), *module.buffers(), *inputs]}
    with LiveTensors() as live:
        result = run()
        total = live.live_bytes(own)
    del result
    return total
