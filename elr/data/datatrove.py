"""datatrove's tokenized output read directly: a folder of `.ds` files (datatrove.pipeline.tokens).

Each file `NAME.ds` (one per task of the tokenizing job, `00000_unshuffled.ds` ..., or a merger's output)
comes with:

    NAME.ds            the tokens, little-endian, 2 bytes each (uint16) or 4 (uint32)
    NAME.ds.index      uint64, little-endian: where each document ends, in tokens (the last is the file's end)
    NAME.ds.metadata   text: "<tokenizer>|<bytes per token>", the token count, the count for humans

A source is the folder's .ds files in name order; opening reads each metadata file and the .ds sizes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from elr.data.sources import Shard, Source, check_size, map_file
from elr.errors import DataError

TOKEN_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def files(path: Path) -> list[Path]:
    return sorted(path.glob("*.ds")) if path.is_dir() else []


def is_datatrove(path: Path) -> bool:
    return bool(files(path))


def token_dtype(ds: Path) -> np.dtype:
    """The token width a .ds file's metadata gives (its first line ends in `|2` or `|4`)."""
    metadata = ds.with_name(ds.name + ".metadata")
    try:
        first = metadata.read_text().splitlines()[0]
        width = int(first.rsplit("|", 1)[1])
    except (OSError, IndexError, ValueError):
        raise DataError(f"{metadata}: missing or unreadable (its first line gives the bytes per token)") from None
    if width not in TOKEN_DTYPES:
        raise DataError(f"{metadata}: {width} bytes per token; expected 2 or 4")
    return TOKEN_DTYPES[width]


class DatatroveShard:
    """One .ds file mapped, its document ends from the .ds.index."""

    def __init__(self, ds: Path, dtype: np.dtype, num_tokens: int):
        self._tokens = map_file(ds, dtype, num_tokens)
        index = ds.with_name(ds.name + ".index")
        if not index.is_file():
            raise DataError(f"{index}: missing (write the tokenized files with save_index=True)")
        self._ends = map_file(index, "<u8")
        if len(self._ends) == 0 or int(self._ends[-1]) != num_tokens:
            raise DataError(f"{index}: its last document should end at the file's {num_tokens} tokens")

    def tokens(self, a: int, b: int) -> np.ndarray:
        return self._tokens[a:b]

    def document_starts(self, a: int, b: int) -> np.ndarray:
        """A document starts at 0 and at every end but the last."""
        lo, hi = np.searchsorted(self._ends, np.array([max(a, 1), b], dtype=np.uint64))
        ends = np.asarray(self._ends[lo:hi], dtype=np.int64)
        return np.concatenate([[0], ends]).astype(np.int64) if a == 0 else ends


def open_datatrove(path: Path, name: str) -> Source:
    shards = []
    for ds in files(path):
        dtype = token_dtype(ds)
        n = check_size(ds, dtype.itemsize)
        shards.append(Shard(str(ds), n, _opener(ds, dtype, n)))
    return Source(name, shards, has_documents=True, where=str(path))


def _opener(ds: Path, dtype: np.dtype, n: int):
    return lambda: DatatroveShard(ds, dtype, n)
