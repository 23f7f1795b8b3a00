"""The bundled prose re-encoded as bytes: the text suite's data (same documents, same split)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from elr.errors import UserError
from elr.text.tokenizer import build_tokenizer, file_sha256

ROOT = Path(__file__).resolve().parents[2]
BYTES_TOKENIZER = ROOT / "data/tokenizer/bytes.tiktoken"


def byte_level_copy(src: Path, out: Path, src_tokenizer: Path) -> None:
    """Re-encode a prepared data folder as bytes (id = byte value, <|endoftext|> = 256).

    The documents, their order and the train/val split stay exactly as in `src`; only the
    tokenization changes, so a byte-level model sees the same text the BPE runs saw.
    """
    meta = json.loads((src / "meta.json").read_text())
    if meta.get("tokenizer_sha256") not in (None, file_sha256(src_tokenizer)):
        raise UserError(f"study: {src} was not tokenized with {src_tokenizer}")
    tokenizer = build_tokenizer(str(src_tokenizer))
    out.mkdir(parents=True, exist_ok=True)
    new_meta = {**meta, "vocab_size": 257, "eot_id": 256, "tokenizer": BYTES_TOKENIZER.name,
                "tokenizer_sha256": file_sha256(BYTES_TOKENIZER), "sources": [str(src)]}
    for split, info in meta["splits"].items():
        tokens = np.fromfile(src / info["file"], dtype=np.dtype(meta["dtype"]))
        ends = np.flatnonzero(tokens == meta["eot_id"])
        parts, start = [], 0
        for end in ends:
            text = tokenizer.encoding.decode_bytes(tokens[start:end].tolist())
            parts += [np.frombuffer(text, dtype=np.uint8).astype(np.uint16), np.array([256], dtype=np.uint16)]
            start = end + 1
        data = np.concatenate(parts)
        tmp = out / f".{info['file']}.tmp"
        data.tofile(tmp)
        os.replace(tmp, out / info["file"])
        new_meta["splits"][split] = {**info, "tokens": int(len(data)), "max_token_id": int(data.max())}
    (out / "meta.json").write_text(json.dumps(new_meta, indent=2) + "\n")  # last: marks the folder complete


def bundled_prose_as_bytes(folder: Path) -> Path:
    """`folder` holding the byte-level copy of data/tinyprose, made on first use."""
    if not (folder / "meta.json").is_file():
        byte_level_copy(ROOT / "data/tinyprose", folder, ROOT / "data/tokenizer/elr8k.tiktoken")
    return folder
