"""Document masking in the model: what a packed row's document ids become for its layers.

A batch may carry `document_ids` [B, T] beside its tokens (`model(tokens, loops, document_ids=...)`):
equal neighbours are one document, a change of value starts the next (the loader packs several
documents into one row). So that documents packed into a row never see each other, the model turns
the ids, once per forward, into a `Documents` that every loop reuses:

    positions  each token's position within its document, 0 at a document start. RoPE restarts
               there; a GDP layer's state is zero before a position-0 token (the op's `resets`)
               and its short convolutions take only the taps that stay inside the document (tap
               j back counts iff j <= position).
    mask       the block-causal attention mask [B, 1, T, S]: a query sees the keys from its
               document's start up to itself. Built only when a layer takes it (attention).

Token-wise layers (dense FF, MoE routing, the ELR update and conditioning) need nothing. Under context
parallelism the ids of every shard are gathered first (a shard's first document may have started in
an earlier one): the positions are global and the mask's keys are those `gather_kv` hands attention,
this shard's and every earlier shard's. None for the ids is the model without masking, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Documents:
    positions: torch.Tensor  # [B, T] long: position within the document, 0 where one starts
    mask: torch.Tensor | None  # [B, 1, T, start + T] bool: block-causal (None: no layer takes it)

    def repeat(self, times: int) -> Documents:
        """The same documents for `times` copies of the batch stacked as rows (every_loop's exits)."""
        mask = self.mask.repeat(times, 1, 1, 1) if self.mask is not None else None
        return Documents(self.positions.repeat(times, 1), mask)


def check_document_ids(document_ids: torch.Tensor, tokens: torch.Tensor) -> None:
    """One line naming the problem if the ids cannot go with the tokens."""
    if not torch.is_tensor(document_ids) or document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool:
        kind = document_ids.dtype if torch.is_tensor(document_ids) else type(document_ids).__name__
        raise ValueError(f"document_ids must be an integer tensor [B, T], got {kind}")
    if document_ids.shape != tokens.shape:
        raise ValueError(
            f"document_ids has shape {tuple(document_ids.shape)}, the tokens {tuple(tokens.shape)}: one id per token"
        )


def document_layout(ids: torch.Tensor, start: int, length: int, with_mask: bool) -> Documents:
    """The `Documents` of tokens start..start + length - 1 of rows whose ids from position 0 are `ids`
    [B, >= start + length] (start > 0: this context-parallel shard's; the keys of its mask are
    positions 0..start + length - 1, the ones a causal query of the shard can reach)."""
    ids = ids[:, : start + length]
    index = torch.arange(ids.shape[1], device=ids.device)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    doc_start = torch.where(first, index, 0).cummax(dim=1).values  # [B, S]: where each token's document starts
    rows = slice(start, start + length)
    positions = (index - doc_start)[:, rows]
    mask = None
    if with_mask:
        keys = index[None, None, :]
        mask = (keys >= doc_start[:, rows, None]) & (keys <= index[rows, None])
        mask = mask[:, None]
    return Documents(positions, mask)
