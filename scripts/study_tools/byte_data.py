"""The text suite's two corpora as bytes: the bundled prose re-encoded (same documents, same split), and
Python source the repository does not hold (the standard library of the interpreter that runs the study)."""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import tempfile
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
    new_meta = {
        **meta,
        "vocab_size": 257,
        "eot_id": 256,
        "tokenizer": BYTES_TOKENIZER.name,
        "tokenizer_sha256": file_sha256(BYTES_TOKENIZER),
        "sources": [str(src)],
    }
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


# Parts of the standard library that are tests, vendored code or GUI demos rather than library source.
SKIPPED_STDLIB_PARTS = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "lib2to3",
    "turtledemo",
    "tkinter",
    "__pycache__",
    "ensurepip",
    "distutils",
}


def stdlib_sources() -> list[Path]:
    """The interpreter's standard-library .py files (about 10 MB on CPython 3.11), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [f for f in sorted(root.rglob("*.py")) if not SKIPPED_STDLIB_PARTS.intersection(f.relative_to(root).parts)]


def python_source_as_bytes(folder: Path) -> Path:
    """`folder` holding the standard library's source as bytes, one document per file, the last 2% of each
    file's bytes for validation (the prose's split): a second kind of data, made on first use. The stdlib
    differs between Python versions, so meta.json names the version it was cut from."""
    if (folder / "meta.json").is_file():
        return folder
    import prepare_data  # scripts/prepare_data.py: the trainer's token-file writer

    with tempfile.TemporaryDirectory() as tmp:
        docs = Path(tmp) / "stdlib.jsonl"
        with docs.open("w", encoding="utf-8") as f:
            for path in stdlib_sources():
                text = path.read_bytes().decode("utf-8", errors="replace")
                f.write(json.dumps({"text": text}) + "\n")
        prepare_data.prepare([str(docs)], str(BYTES_TOKENIZER), str(folder), val_fraction=0.02, split="tail")
    meta = json.loads((folder / "meta.json").read_text())
    meta["sources"] = [f"Python {sys.version.split()[0]} standard library ({len(stdlib_sources())} files)"]
    tmp = folder / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, folder / "meta.json")
    return folder
