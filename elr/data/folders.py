"""The folders scripts/prepare_data.py writes, read as token stores: sharded, and the older single file.

A sharded folder (meta.json `"format": "shards"`) holds, for each split (train, val) and shard i:

    {split}-{i:05d}.bin      the shard's tokens (meta.json's dtype, uint16 or uint32): whole documents, each
                             followed by <|endoftext|>
    {split}-{i:05d}.starts   int64, little-endian: the position in the shard where each document starts
    shard-{i:05d}.json       what the shard was made from and holds (scripts/prepare_data.py's record)

and meta.json lists every shard's token and document counts (`splits.{split}.shards`: [[tokens, documents],
...]), so a source opens from meta.json alone. An older folder holds one `{split}.bin` per split; its
document starts are `{split}.starts` when recorded (`prepare_data.py --record-documents FOLDER` writes them
from its <|endoftext|> tokens), else it serves windows without document ids.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from elr.data.sources import Shard, Source, map_file
from elr.data.token_files import DTYPES, load_tokens, read_meta
from elr.errors import DataError

META = "meta.json"
SHARDED = "shards"  # meta.json's "format" of a sharded folder
STARTS = ".starts"


def shard_name(split: str, index: int) -> str:
    """`train-00012`: the stem of a shard's files."""
    return f"{split}-{index:05d}"


class FolderShard:
    """One token file mapped read-only, with its document starts when it has them."""

    def __init__(self, tokens: Path, dtype: np.dtype, num_tokens: int, starts: Path | None):
        self._tokens = map_file(tokens, dtype, num_tokens)
        self._starts = read_starts(starts, num_tokens) if starts is not None else None

    def tokens(self, a: int, b: int) -> np.ndarray:
        return self._tokens[a:b]

    def document_starts(self, a: int, b: int) -> np.ndarray:
        lo, hi = np.searchsorted(self._starts, [a, b])
        return np.asarray(self._starts[lo:hi], dtype=np.int64)


def read_starts(path: Path, num_tokens: int) -> np.ndarray:
    """A `.starts` file mapped read-only, its ends checked: a document at 0, none at or past the end."""
    starts = map_file(path, "<i8")
    if len(starts) == 0 or starts[0] != 0 or starts[-1] >= num_tokens:
        raise DataError(f"{path}: document starts must begin at 0 and stay below the {num_tokens} tokens")
    return starts


def open_folder(folder: Path, split: str, name: str) -> Source:
    """A prepared folder's `split` as a Source (sharded, or the older single file)."""
    meta = read_meta(folder)
    if meta.get("format") == "chat":
        raise DataError(f"{folder}: a chat folder serves one conversation per row; name it as data.path")
    if meta.get("dtype") not in DTYPES:
        raise DataError(f"{folder / META}: dtype {meta.get('dtype')!r} is not one of {list(DTYPES)}")
    dtype = np.dtype(DTYPES[meta["dtype"]])
    if meta.get("format") != SHARDED:
        tokens_path = folder / f"{split}.bin"
        tokens = load_tokens(tokens_path)  # checks the size and every id against the vocabulary, once per file
        starts = tokens_path.with_suffix(STARTS) if tokens_path.with_suffix(STARTS).is_file() else None
        shard = Shard(str(tokens_path), len(tokens), _opener(tokens_path, dtype, len(tokens), starts))
        return Source(name, [shard], has_documents=starts is not None, where=str(tokens_path))
    entry = meta.get("splits", {}).get(split)
    if entry is None:
        raise DataError(f"{folder / META}: has no {split} split")
    counts = entry.get("shards")
    if not isinstance(counts, list) or not all(isinstance(c, list) and len(c) == 2 for c in counts):
        raise DataError(f"{folder / META}: splits.{split}.shards must list [tokens, documents] per shard")
    shards = []
    for i, (n, _) in enumerate(counts):
        stem = folder / shard_name(split, i)
        tokens_path, starts = stem.with_name(stem.name + ".bin"), stem.with_name(stem.name + STARTS)
        shards.append(Shard(str(tokens_path), int(n), _opener(tokens_path, dtype, int(n), starts)))
    return Source(name, shards, has_documents=True, where=f"{folder} ({split})")


def _opener(tokens: Path, dtype: np.dtype, n: int, starts: Path | None):
    return lambda: FolderShard(tokens, dtype, n, starts)


def record_document_starts(folder: Path) -> dict[str, int]:
    """An older single-file folder's `{split}.starts`, from its <|endoftext|> tokens (every document, or
    document part, ends with one); written atomically. Returns the documents found per split."""
    meta = read_meta(folder)
    if meta.get("format") in (SHARDED, "chat"):
        raise DataError(f"{folder}: a {meta['format']} folder, not a single-file one; nothing to record")
    eot = meta.get("eot_id")
    if not isinstance(eot, int):
        raise DataError(f"{folder / META}: records no eot_id, so its document ends are unknown")
    found = {}
    for split in meta.get("splits", {}):
        tokens = load_tokens(folder / f"{split}.bin")
        ends = np.flatnonzero(np.asarray(tokens) == eot) + 1
        starts = np.concatenate([[0], ends[ends < len(tokens)]]).astype("<i8")
        target = folder / f"{split}{STARTS}"
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            starts.tofile(tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        found[split] = len(starts)
    return found


def split_tokens(folder: Path, split: str) -> np.ndarray:
    """A sharded folder's whole split as one array (for the tools that read a validation split end to end:
    evaluation, cloze items): one shard mapped, several joined in memory."""
    source = open_folder(Path(folder), split, split)
    if len(source.shards) == 1:
        return source.tokens(0, source.num_tokens)
    return np.concatenate([source.tokens(int(a), int(b)) for a, b in zip(source.offsets[:-1], source.offsets[1:])])
