"""Count the bytes a forward pass leaves alive for backward: the activation memory of one microbatch.

`LiveTensors` is a dispatch mode that notes every tensor an op creates; after the forward (with the
loss still referenced) the storages still alive are exactly what autograd, activation checkpointing
(region inputs, selectively saved outputs) and the caller keep for backward. It runs the same on the
meta device, which is how scripts/plan_memory.py predicts a full-size model's activations from its
layer shapes without allocating them; tests hold it to real CPU runs and to saved_tensors_hooks.
"""

from __future__ import annotations

import weakref

import torch
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
            nbytes for key, (refs, nbytes) in self.created.items()
            if key not in exclude and any(r() is not None for r in refs)
        )


def forward_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor, loops: int, loss_fn) -> int:
    """Bytes retained for backward after model(tokens, loops) and loss_fn(logits, tokens).

    Parameters and buffers are not activations and are left out.
    """
    own = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    with LiveTensors() as live:
        loss = loss_fn(model(tokens, loops=loops), tokens)
        total = live.live_bytes(own)
    del loss
    return total


def saved_tensor_bytes(model: torch.nn.Module, tokens: torch.Tensor, loops: int, loss_fn) -> int:
    """Bytes autograd saves for backward, counted with saved_tensors_hooks (unique storages, no
    parameters or buffers). Inside activation-checkpoint regions torch's own hooks take over, so
    this sees everything only without AC."""
    own = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        if storage_key(t) not in own:
            seen[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(tokens, loops=loops), tokens)
    del loss
    return sum(seen.values())
