"""What the code outside a layer kind's own file may know about it: the record each kind registers.

A layer kind (G, A, F, E in ModelArgs.layer_pattern) is one file in elr/models holding its sublayer
module and the functions its `LayerKind` names, plus one entry in `LAYER_KINDS` (elr/models/layers.py).
Whatever treats kinds differently reads the entry and nothing else: the model builds layers and counts
FLOPs with it, tensor parallelism (elr/parallel/tensor_parallel.py) splits each sublayer as its
`TensorSplit` says, context parallelism hands its hook to the kinds that mix tokens, inference
(elr/infer) keeps each kind's cache entries and counts their bytes, Muon leaves its gates to AdamW, and
checkpoint loading refuses weights saved in an older layout. Plain data and functions: nothing here
knows torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from elr.models.args import ModelArgs


@dataclass(frozen=True)
class Rows:
    """A replicated weight of which each tensor-parallel rank computes some rows: viewed as [groups,
    rows per group, ...], rank r uses group r * groups // tp (GQA kv heads fewer than the TP degree)."""

    groups: int


@dataclass(frozen=True)
class TensorSplit:
    """How tensor parallelism splits one sublayer, whose input and output are this rank's slice of
    the sequence (sequence parallel).

    how  "heads": the sublayer sees the whole sequence (gathered from the slices) and runs this
             rank's heads on local weights; its partial output is reduce-scattered back to slices.
             `weights` maps parameter names to the dim split over the ranks (0: output rows, 1:
             input columns) or to Rows; the others are replicated.
         "hidden": Megatron's feed-forward as DTensor plans: the linears named in `weights` with 0
             split their output rows (colwise), those with 1 their input columns (rowwise).
         "tokens": replicated, run on the rank's own slice: a token-wise layer needs no collective.
    divides: sizes the TP degree must divide, by what they are ({"attention heads": 8}).
    multiple_of: sizes the TP degree must be a multiple of where it exceeds them.
    expert_stacks: parameters expert parallelism splits instead; TP leaves them alone when it does.
    """

    how: str
    weights: dict[str, int | Rows] = field(default_factory=dict)
    divides: dict[str, int] = field(default_factory=dict)
    multiple_of: dict[str, int] = field(default_factory=dict)
    expert_stacks: tuple[str, ...] = ()


@dataclass(frozen=True)
class InferenceState:
    """What a layer of the kind keeps between decoding calls (elr/infer/cache.py, elr/infer/memory.py).

    new(sublayer, cache, dtype, device): one entry of `cache` (elr/models/cache.py's Cache, whose
    geometry, masks and `rows` the entry reads), the object the sublayer's forward takes as `cache`
    (it has `tensors()` and `commit()`, called when the forward ends). bytes(args, context_len,
    element_size): one entry's bytes for one request, the formula the measured entries must match.
    """

    name: str  # its key in the byte counts ("attention_kv", "gdp_state")
    new: Callable
    bytes: Callable[[ModelArgs, int, int], int]


@dataclass(frozen=True)
class WeightLayout:
    """A change in how the kind lays out its weights: a checkpoint of a format below `since_format`
    that holds `weight` (a submodule name only this kind has) holds it the old way, and is refused."""

    since_format: int
    weight: str
    old: str  # the old layout, for the refusal


@dataclass(frozen=True)
class LayerKind:
    letter: str  # in ModelArgs.layer_pattern
    name: str
    build: Callable[[ModelArgs], nn.Module]  # the sublayer: init_weights(out_std), forward(x, *inputs)
    flops_per_token: Callable[[ModelArgs, int], int]  # training FLOPs (3 x forward) per token at seq_len
    tensor_split: Callable[[ModelArgs, int], TensorSplit]  # at a TP degree
    # what forward takes after x, in order: "rope", "cache", "route", "document_mask" (the block-causal
    # attention mask), "document_positions" (each token's position in its document); elr/models/documents.py
    inputs: tuple[str, ...] = ()
    mixes_tokens: bool = False  # a position's output reads other positions: takes the CP hook
    inference_state: InferenceState | None = None  # None: nothing kept between decoding calls
    gates: tuple[str, ...] = ()  # linear submodules that produce gate values: AdamW, not Muon
    layouts: tuple[WeightLayout, ...] = ()
