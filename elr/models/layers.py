"""The layer kinds, one registration each, and the pre-norm residual layer that holds one of them.

`LAYER_KINDS` is the only place a letter of ModelArgs.layer_pattern is matched to code: each entry
(elr/models/kinds.py says what it holds) names the functions of its kind's own file. The model, tensor
and context parallelism, inference caches and their byte counts, Muon's parameter choice and the
checkpoint format check all read the entry, so a new kind is its file plus one entry here. Order
matters only for messages: tensor parallelism checks the kinds' sizes in this order.
"""

from __future__ import annotations

import torch
from torch import nn

from elr.errors import ConfigError
from elr.models.args import ModelArgs
from elr.models.attention import Attention, AttentionKV, attention_flops, attention_kv_bytes, attention_split
from elr.models.documents import Documents
from elr.models.ffn import MoE, dense_feed_forward, dense_flops, dense_split, moe_flops, moe_split
from elr.models.gdp import HEAD_MAJOR, GatedDeltaProduct, GDPState, gdp_flops, gdp_split, gdp_state_bytes
from elr.models.kinds import InferenceState, LayerKind

LAYER_KINDS: dict[str, LayerKind] = {
    kind.letter: kind
    for kind in (
        LayerKind(
            "A",
            "attention",
            Attention,
            attention_flops,
            attention_split,
            inputs=("rope", "cache", "document_mask"),
            mixes_tokens=True,
            inference_state=InferenceState("attention_kv", AttentionKV, attention_kv_bytes),
        ),
        LayerKind(
            "G",
            "Gated DeltaProduct",
            GatedDeltaProduct,
            gdp_flops,
            gdp_split,
            inputs=("cache", "document_positions"),
            mixes_tokens=True,
            inference_state=InferenceState("gdp_state", GDPState, gdp_state_bytes),
            gates=("a_proj", "b_proj"),
            layouts=(HEAD_MAJOR,),
        ),
        LayerKind("F", "dense feed-forward", dense_feed_forward, dense_flops, dense_split),
        LayerKind("E", "mixture of experts", MoE, moe_flops, moe_split, inputs=("route",), gates=("router",)),
    )
}


def layer_kind(letter: str) -> LayerKind:
    if letter not in LAYER_KINDS:
        raise ValueError(f"layer_pattern has an unknown layer kind {letter!r}; use one of {', '.join(LAYER_KINDS)}")
    return LAYER_KINDS[letter]


class Layer(nn.Module):
    """One pre-norm residual sublayer, x + sublayer(norm(x)), of a registered kind.

    In the recurrent block a FiLM triple (scale, shift, gate) from the loop conditioning turns
    this into x + (1 + gate) * sublayer(norm(x) * (1 + scale) + shift); all zeros is the plain layer.
    The sublayer is handed what its kind takes beside its input (`LayerKind.inputs`); `documents`
    (elr/models/documents.py) gives "document_mask" and "document_positions", None without masking. `delta` (a
    later loop's own low-rank map, elr/models/recurrence.py's LoopDeltas) adds delta(h) to the sublayer's output.
    """

    def __init__(self, kind: str, args: ModelArgs):
        super().__init__()
        spec = layer_kind(kind)
        self.kind, self.inputs = kind, spec.inputs
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.sublayer = spec.build(args)

    def init_weights(self, out_std: float):
        self.norm.reset_parameters()
        self.sublayer.init_weights(out_std)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        film=None,
        route=None,
        cache=None,
        documents: Documents | None = None,
        delta=None,
    ) -> torch.Tensor:
        h = self.norm(x)
        gate = None
        if film is not None:
            scale, shift, *gate = film
            h = h * (1 + scale) + shift
            gate = gate[0] if gate else None
        given = {"rope": rope, "cache": cache, "route": route, "document_mask": None, "document_positions": None}
        if documents is not None:
            given.update(document_mask=documents.mask, document_positions=documents.positions)
        y = self.sublayer(h, *[given[name] for name in self.inputs])
        if delta is not None:
            y = y + delta(h)
        return x + (y if gate is None else (1 + gate) * y)


def check_tensor_parallel(args: ModelArgs, tp: int) -> None:
    """Refuse a tensor-parallel degree the layer kinds cannot split evenly, before any weight exists; one line
    naming the key. The vocabulary may split unevenly: DTensor pads the last shard. The one check of it: the job
    config's model check runs it (elr/models/from_config.py), and tensor parallelism on the model it splits."""
    if tp == 1:
        return
    splits = [LAYER_KINDS[letter].tensor_split(args, tp) for letter in LAYER_KINDS if letter in args.layer_pattern]
    for split in splits:
        for what, size in split.multiple_of.items():
            if tp % size:
                raise ConfigError(
                    f"parallelism.tensor_parallel_degree: {tp} must be a multiple of the {size} {what} "
                    "when it exceeds them (each rank keeps a replicated one)"
                )
    for split in splits:
        for what, size in split.divides.items():
            if size % tp:
                raise ConfigError(f"parallelism.tensor_parallel_degree: {tp} does not divide the {size} {what}")
