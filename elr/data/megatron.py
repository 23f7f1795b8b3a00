"""Megatron-LM / NeMo indexed datasets read directly with numpy: `prefix.bin` (tokens) and `prefix.idx`.

The .idx layout (megatron/core/datasets/indexed_dataset.py, "MMIDIDX" version 1), little-endian:

    9 bytes      b"MMIDIDX\\x00\\x00"
    uint64       version, 1
    uint8        the tokens' dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16; 6, 7 floats)
    uint64       S, the number of sequences
    uint64       D + 1, the number of document indices
    int32[S]     each sequence's length in tokens
    int64[S]     each sequence's byte offset in the .bin
    int64[D + 1] document j is sequences [indices[j], indices[j + 1]) (one sequence per document unless the
                 data was split into sentences); multimodal files add int8[S] modes, not read here

A source is one prefix, or a folder of prefixes (every `*.idx` with its `.bin`, in name order: the files
a tokenizing job writes, one per worker, or `merge_datasets.py`'s output). Opening reads each header and
the .bin's size; the index arrays are mapped when a window first reads the shard.
"""

from __future__ import annotations

import bisect
import struct
from pathlib import Path

import numpy as np

from elr.data.sources import Shard, Source, check_size, map_file
from elr.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices: 34 bytes
TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def prefixes(path: Path) -> list[Path]:
    """The dataset prefixes `path` names: itself (path.idx exists) or every *.idx of a folder, sorted."""
    if path.with_name(path.name + ".idx").is_file():
        return [path]
    if path.is_dir():
        return [p.with_suffix("") for p in sorted(path.glob("*.idx"))]
    return []


def is_megatron(path: Path) -> bool:
    return bool(prefixes(path))


def read_header(idx: Path) -> tuple[np.dtype, int, int]:
    """(token dtype, sequences, document indices) of an .idx file; one DataError naming it if malformed."""
    with open(idx, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise DataError(f"{idx}: shorter than a Megatron index header")
    magic, version, code, sequences, documents = HEADER.unpack(raw)
    if magic != MAGIC or version != 1:
        raise DataError(f"{idx}: not a Megatron indexed dataset index (MMIDIDX version 1)")
    if code not in TOKEN_DTYPES:
        raise DataError(f"{idx}: dtype code {code} is not an integer token type")
    return np.dtype(TOKEN_DTYPES[code]).newbyteorder("<"), sequences, documents


class MegatronShard:
    """One prefix mapped: tokens from the .bin, document starts from the .idx's pointers and indices."""

    def __init__(self, prefix: Path, num_tokens: int):
        idx = prefix.with_name(prefix.name + ".idx")
        dtype, sequences, documents = read_header(idx)
        self.num_tokens, self.itemsize = num_tokens, dtype.itemsize
        self._tokens = map_file(prefix.with_name(prefix.name + ".bin"), dtype, num_tokens)
        index = map_file(idx, np.uint8)
        lengths_at = HEADER.size
        pointers_at = lengths_at + 4 * sequences
        indices_at = pointers_at + 8 * sequences
        if len(index) < indices_at + 8 * documents:
            raise DataError(f"{idx}: shorter than its header's {sequences} sequences and {documents} documents")
        self._pointers = np.frombuffer(index, dtype="<i8", count=sequences, offset=pointers_at)
        self._indices = np.frombuffer(index, dtype="<i8", count=documents, offset=indices_at)
        self._documents = max(documents - 1, 0)  # the last index closes the last document
        lengths = np.frombuffer(index, dtype="<i4", count=sequences, offset=lengths_at)
        end = int(self._pointers[-1]) // self.itemsize + int(lengths[-1]) if sequences else 0
        if end != num_tokens:
            raise DataError(f"{idx}: its sequences end at token {end}, its .bin holds {num_tokens}")

    def tokens(self, a: int, b: int) -> np.ndarray:
        return self._tokens[a:b]

    def _start(self, document: int) -> int:
        sequence = int(self._indices[document])
        return int(self._pointers[sequence]) // self.itemsize if sequence < len(self._pointers) else self.num_tokens

    def document_starts(self, a: int, b: int) -> np.ndarray:
        """Binary search over the documents' first sequences: no array of starts is built."""
        every = range(self._documents)
        lo = bisect.bisect_left(every, a, key=self._start)
        hi = bisect.bisect_left(every, b, key=self._start)
        sequences = np.asarray(self._indices[lo:hi])
        starts = np.asarray(self._pointers[sequences[sequences < len(self._pointers)]]) // self.itemsize
        return np.unique(starts)  # an empty document repeats the next one's start


def open_megatron(path: Path, name: str) -> Source:
    shards = []
    for prefix in prefixes(path):
        dtype, _, _ = read_header(prefix.with_name(prefix.name + ".idx"))
        tokens = prefix.with_name(prefix.name + ".bin")
        if not tokens.is_file():
            raise FileNotFoundError(f"{tokens}: missing beside its .idx")
        n = check_size(tokens, dtype.itemsize)
        shards.append(Shard(str(tokens), n, _opener(prefix, n)))
    return Source(name, shards, has_documents=True, where=str(path))


def _opener(prefix: Path, n: int):
    return lambda: MegatronShard(prefix, n)
