"""Token files and their tokenizer: opening a prepared data folder's `train.bin` / `val.bin` with the
dtype its meta.json gives, refusing token ids past the vocabulary, and checking (before any work) that
the files were made by the configured tokenizer. The batches drawn from them are elr/data/loader.py's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from elr.config import JobConfig
from elr.errors import ConfigError, DataError
from elr.text.tokenizer import Tokenizer

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def read_meta(data_dir: str | Path) -> dict:
    """A prepared data folder's meta.json (scripts/prepare_data.py), or one DataError saying why not."""
    meta_path = Path(data_dir) / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"data.path: {meta_path} not found (make it with scripts/prepare_data.py)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{meta_path} is not readable JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("vocab_size", 0), int):
        raise DataError(f"{meta_path}: expected a JSON object with an integer vocab_size")
    splits = meta.get("splits", {})
    if not isinstance(splits, dict) or not all(isinstance(v, dict) for v in splits.values()):
        raise DataError(f"{meta_path}: `splits` must map each split name to an object (see scripts/prepare_data.py)")
    tokens = [v["tokens"] for v in splits.values() if "tokens" in v]
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in tokens):
        raise DataError(f"{meta_path}: a split's `tokens` must be an integer")
    return meta


def check_tokenizer(data_dir: Path, tokenizer: Tokenizer, cfg: JobConfig) -> None:
    """The data was tokenized by this tokenizer: same vocabulary size and, where recorded, the same
    file (a shuffled ranks file has the size but not the ids). Records the hash in the config."""
    meta = read_meta(data_dir)
    vocab, tok = meta["vocab_size"], cfg.tokenizer
    if vocab != tokenizer.n_vocab:
        raise ConfigError(
            f"data.path: {data_dir} was tokenized with a vocabulary of {vocab}, but tokenizer.path "
            f"{tok.path} has {tokenizer.n_vocab}"
        )
    have = tokenizer.sha256
    for key, want in (("data.path", meta.get("tokenizer_sha256")), ("tokenizer.sha256", tok.sha256)):
        if want and have and want != have:
            raise ConfigError(
                f"{key}: {'the data was tokenized by' if key == 'data.path' else 'expects'} a tokenizer "
                f"with SHA-256 {want}, but tokenizer.path {tok.path} has {have}"
            )
    tok.sha256 = tok.sha256 or have or ""


def load_tokens(path: str | Path) -> np.memmap:
    """Open a token file read-only, with the dtype from the meta.json beside it; every token id must
    be below meta.json's vocab_size (the largest id is read once per file content: `largest_token_id`)."""
    path = Path(path)
    meta_path = path.parent / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"token file {path} does not exist (see scripts/prepare_data.py)")
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} is missing: it gives the dtype of {path}")
    meta = read_meta(path.parent)
    if meta.get("dtype") not in DTYPES:
        raise DataError(f"{meta_path}: dtype {meta.get('dtype')!r} is not one of {list(DTYPES)}")
    dtype = np.dtype(DTYPES[meta["dtype"]])
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise DataError(f"{path}: size {size} bytes is not a positive multiple of {dtype.name}")
    n_tokens = size // dtype.itemsize
    expected = meta.get("splits", {}).get(path.stem, {}).get("tokens")
    if expected is not None and expected != n_tokens:
        raise DataError(f"{path}: holds {n_tokens} tokens but {meta_path} says {expected}")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    vocab = meta.get("vocab_size")
    if vocab is not None:
        largest = largest_token_id(path, tokens)
        if largest >= vocab:
            raise DataError(
                f"{path}: holds token id {largest}, but {meta_path} gives vocab_size {vocab}: "
                f"tokenized with another vocabulary, or not written as {dtype.name}"
            )
    return tokens


CHUNK_TOKENS = 1 << 26  # a streamed max reads the memory map this many tokens at a time


def check_cache() -> Path:
    """Where the largest id of each token file is remembered: outside every data folder (which may be
    read-only, or tracked by git), per user: $ELR_CACHE, else $XDG_CACHE_HOME/elr, else ~/.cache/elr."""
    if os.environ.get("ELR_CACHE"):
        return Path(os.environ["ELR_CACHE"]) / "token_max.json"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "elr" / "token_max.json"


def largest_token_id(path: Path, tokens: np.ndarray) -> int:
    """The file's largest token id: a streamed max over the memory map, once per file content. The cache
    is keyed by the file's resolved path, dtype, size and modification time, so a file rewritten in place (even
    at the same size) is read again; meta.json's own `max_token_id` is never trusted, since a copied
    meta.json or an edited .bin would carry a stale one."""
    stat = path.stat()
    key = f"{path.resolve()}|{tokens.dtype.name}|{stat.st_size}|{stat.st_mtime_ns}"
    cache_path = check_cache()
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict):
        cache = {}
    if isinstance(cache.get(key), int):
        return cache[key]
    largest = max(int(tokens[i : i + CHUNK_TOKENS].max()) for i in range(0, len(tokens), CHUNK_TOKENS))
    cache = {k: v for k, v in cache.items() if not k.startswith(f"{path.resolve()}|")}  # one entry per file
    cache[key] = largest
    try:  # atomically; where the cache cannot be written, the next open reads the file again
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_name(f".{cache_path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=0) + "\n")
        os.replace(tmp, cache_path)
    except OSError:
        pass
    return largest
