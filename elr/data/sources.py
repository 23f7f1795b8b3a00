"""A token store as training reads it: its token count, the tokens in [a, b) and the document starts in [a, b).

A `Source` is a sequence of shards read as one stream (a prepared folder's train-00000.bin, train-00001.bin,
...; a Megatron dataset's .bin files; datatrove's .ds files). Opening it reads only the shard sizes, from a
small index (meta.json, the .idx headers, the file sizes), so a store of thousands of shards opens in
milliseconds; a shard's files are mapped the first time a window reads it, and at most `open_shards` stay
mapped (the least recently read is closed first), so thousands of shards never mean thousands of open files.
Every position is an integer in int64 (numpy) or Python's unbounded ints: exact far past 10^13 tokens.
Every shard starts a document (no format lets one straddle two files), so its first position is a start.

The readers of each format (elr/data/folders.py, megatron.py, datatrove.py) build the shards;
elr/data/stores.py picks one by what a path holds. docs/data.md describes the formats.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from elr.errors import DataError

OPEN_SHARDS = 64  # shards a source keeps mapped at once (two files each at most)


class ShardReader(Protocol):
    """An opened shard; positions are local to it."""

    def tokens(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) in the shard's own dtype."""
        ...

    def document_starts(self, a: int, b: int) -> np.ndarray:
        """int64, sorted: the positions in [a, b) where a document starts (0 is always one)."""
        ...


@dataclass(frozen=True)
class Shard:
    """One shard as the index describes it: its file (for messages), its token count, and how to open it."""

    file: str
    num_tokens: int
    open: Callable[[], ShardReader]


class Source:
    """Shards read as one stream of tokens: position p is token p - offsets[i] of shard i."""

    def __init__(
        self, name: str, shards: list[Shard], has_documents: bool, where: str = "", open_shards: int = OPEN_SHARDS
    ):
        """name: the source's name in metrics; where: the store, in messages (the token file, folder/split, the
        prefix or folder)."""
        self.name, self.where = name, where or name
        if not shards:
            raise DataError(f"{self.where}: holds no shards")
        self.shards, self.has_documents = shards, has_documents
        self.offsets = np.zeros(len(shards) + 1, dtype=np.int64)
        np.cumsum([s.num_tokens for s in shards], out=self.offsets[1:])
        self.num_tokens = int(self.offsets[-1])
        self.open_shards = open_shards
        self._open: OrderedDict[int, ShardReader] = OrderedDict()

    def locate(self, position: int) -> tuple[int, int]:
        """(shard, position within it) of a position in [0, num_tokens); empty shards are skipped."""
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"{self.where}: position {position} is outside [0, {self.num_tokens})")
        shard = int(np.searchsorted(self.offsets, position, side="right")) - 1
        return shard, position - int(self.offsets[shard])

    def tokens(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of the stream, crossing shard boundaries where the range does."""
        pieces = []
        while a < b:
            shard, local = self.locate(a)
            take = min(b - a, self.shards[shard].num_tokens - local)
            pieces.append(self._reader(shard).tokens(local, local + take))
            a += take
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def document_starts(self, a: int, b: int) -> np.ndarray:
        """int64, sorted: the stream positions in [a, b) where a document starts."""
        if not self.has_documents:
            raise DataError(f"{self.where}: records no document starts")
        pieces = []
        while a < b:
            shard, local = self.locate(a)
            take = min(b - a, self.shards[shard].num_tokens - local)
            pieces.append(self._reader(shard).document_starts(local, local + take) + (a - local))
            a += take
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    def _reader(self, shard: int) -> ShardReader:
        """The opened shard, least recently read closed first beyond `open_shards`."""
        reader = self._open.get(shard)
        if reader is None:
            try:
                reader = self.shards[shard].open()
            except OSError as e:
                raise DataError(f"{self.shards[shard].file}: cannot be read ({e.strerror or e})") from None
            self._open[shard] = reader
            if len(self._open) > self.open_shards:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(shard)
        return reader

    def close(self) -> None:
        """Unmap every open shard (a later read opens it again)."""
        self._open.clear()

    def __getstate__(self):  # a copy (a worker process, deepcopy) opens its own shards
        return {**self.__dict__, "_open": OrderedDict()}


def map_file(path: Path, dtype, expected: int | None = None) -> np.ndarray:
    """A file mapped read-only as a 1-D array of `dtype`: one open and one mmap (np.memmap costs several times
    more, which matters when most windows open a shard). Its size must be a whole number of items, and
    `expected` of them when given."""
    dtype = np.dtype(dtype)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size % dtype.itemsize or (expected is not None and size // dtype.itemsize != expected):
            check_size(path, dtype.itemsize, expected)  # raises, saying which
        if size == 0:
            return np.zeros(0, dtype=dtype)
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # holds its own descriptor until unmapped
    return np.frombuffer(buffer, dtype=dtype)


def check_size(path: Path, itemsize: int, expected: int | None = None) -> int:
    """The number of items a file holds, refusing a size that is not a multiple of the item (a torn
    write) or that differs from what its index says."""
    size = path.stat().st_size
    if size % itemsize:
        raise DataError(f"{path}: size {size} bytes is not a multiple of {itemsize}-byte tokens")
    if expected is not None and size // itemsize != expected:
        raise DataError(f"{path}: holds {size // itemsize} tokens but its index says {expected}")
    return size // itemsize
