"""Activation checkpointing (AC) of every layer call, including each of the k calls of a recurrent layer.

Modes (torchtitan's names): "none"; "full" recomputes each wrapped layer in backward and keeps only
its input; "selective" either by op (`selective_ac_option = "op"`: keep matmul and attention outputs,
recompute norms, activations, gates, rotations) or by layer (`selective_ac_option = "N"`: fully
checkpoint every N-th layer, counted over the whole stack in order).

A recurrent layer runs k times per microbatch; wrapping the layer module makes each of those calls its
own checkpoint region, so memory grows with k by one layer input per call rather than by a whole
layer's internals. The MoE load counter skips recomputed forwards (see MoE.choose_experts).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten

# Outputs of these ops are kept under selective-op AC: they are the expensive ones to recompute.
SAVE_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.elr.grouped_mm.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_op_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


class CheckpointedLayer(ActivationWrapper):
    """A Layer whose every call is one checkpoint region; state-dict keys stay those of the bare layer.

    With MoE route replay, loop 1 fills the route slot: the routes then leave the region as outputs,
    so a recomputation routes afresh instead of reading the slot it filled the first time.
    """

    def __init__(self, layer: nn.Module, selective_op: bool):
        super().__init__(layer)
        self.context_fn = selective_op_context if selective_op else None

    def _checkpoint(self, fn, *args):
        kwargs = {"context_fn": self.context_fn} if self.context_fn is not None else {}
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        film=None,
        route: dict | None = None,
        cache=None,
        documents=None,
        delta=None,
    ) -> torch.Tensor:
        layer = self._checkpoint_wrapped_module
        if cache is not None:  # inference keeps no activations for a backward: nothing to checkpoint
            return layer(x, rope, film=film, route=route, cache=cache, documents=documents, delta=delta)
        if route is not None and not route:

            def routed_layer(x):
                fresh = {}
                y = layer(x, rope, film=film, route=fresh, documents=documents, delta=delta)
                return y, fresh["indices"], fresh["weights"]

            y, indices, weights = self._checkpoint(routed_layer, x)
            route.update(indices=indices, weights=weights)
            return y
        return self._checkpoint(partial(layer, rope=rope, film=film, route=route, documents=documents, delta=delta), x)


def apply_activation_checkpointing(model: nn.Module, mode: str, selective_ac_option: str = "op") -> int:
    """Wrap the model's layers in place for `mode`; returns how many layers were wrapped."""
    if mode == "none":
        return 0
    selective_op = mode == "selective" and selective_ac_option == "op"
    every = int(selective_ac_option) if mode == "selective" and not selective_op else 1
    wrapped, count = 0, 0
    for blocks in (model.input_layers, model.recurrent.layers, model.output_layers):
        for i, layer in enumerate(blocks):
            count += 1
            if count % every == 0:
                blocks[i] = CheckpointedLayer(layer, selective_op)
                wrapped += 1
    return wrapped
