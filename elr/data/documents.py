"""Document ids of a training row, from the document starts its source records.

The interface the model reads (`data.document_masking`): beside inputs and labels a batch carries
`document_ids`, int32 [B, T] aligned with the inputs, non-decreasing along each row: position t holds the
number of document starts in (first, first + t], so a row begins at 0 (inside a document or at its start)
and each later start raises the id by one. Equal ids are one document; attention, the GDP state and the
RoPE positions restart where the id changes. A label at t is the token at t + 1: the last token of a
document (its <|endoftext|>) still predicts the next document's first token, from its own document alone.
"""

from __future__ import annotations

import numpy as np


def document_ids(starts: np.ndarray, first: int, length: int) -> np.ndarray:
    """int32 [length]: the document id of positions first .. first + length - 1, given the sorted stream
    positions where documents start (any outside (first, first + length) are ignored)."""
    marks = np.zeros(length, dtype=np.int32)
    inside = starts - first
    marks[inside[(inside > 0) & (inside < length)]] = 1
    return np.cumsum(marks, dtype=np.int32)
