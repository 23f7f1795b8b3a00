#!/usr/bin/env python
"""Tokenize local text into memory-mapped token files for training.

Inputs are .txt files (one document per file) and .jsonl files (one document per line, in field
--text-field), named directly or found in directories (recursively, in sorted order). Writes to
--out:

    train.bin, val.bin   flat token streams; every document is followed by <|endoftext|>
    meta.json            dtype, vocab size, tokenizer file and sha256, documents / tokens /
                         UTF-8 text bytes per split, val fraction, sources

A document goes to val when a hash of its text falls below --val-fraction: the split is the same
on every run and machine whatever the input order, and no document straddles the two splits.
Outputs are written under temporary names and renamed only when complete.

    python scripts/prepare_data.py --tokenizer data/tokenizer/elr8k.tiktoken \\
        --out data/tinyprose path/to/texts/ more.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
from elr.train.tokenizer import Tokenizer, build_tokenizer, file_sha256  # noqa: E402

SPLITS = ("train", "val")
TEXT_SUFFIXES = (".txt", ".jsonl")


class InputError(Exception):
    """A problem with the user's inputs; reported as one line and exit status 1."""


def list_input_files(inputs: list[str]) -> list[tuple[str, list[Path]]]:
    """Each command-line input with the text files it stands for."""
    groups = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
            if not files:
                raise InputError(f"{name}: directory holds no .txt or .jsonl files")
        elif path.is_file():
            if path.suffix not in TEXT_SUFFIXES:
                raise InputError(f"{name}: expected a .txt or .jsonl file or a directory")
            files = [path]
        else:
            raise InputError(f"{name}: no such file or directory")
        groups.append((name, files))
    return groups


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The non-blank documents of one file: the whole of a .txt, one per line of a .jsonl."""
    try:
        if path.suffix == ".txt":
            text = path.read_text(encoding="utf-8")
            if text.strip():
                yield text
            return
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[text_field]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise InputError(
                        f"{path}:{lineno}: not a JSON object with a {text_field!r} field ({e})"
                    ) from None
                if not isinstance(text, str):
                    raise InputError(f"{path}:{lineno}: field {text_field!r} is not a string")
                if text.strip():
                    yield text
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not valid UTF-8 ({e})") from None


def iter_all_documents(
    groups: list[tuple[str, list[Path]]], text_field: str = "text"
) -> Iterator[str]:
    """Every document of every input (from `list_input_files`), failing on one with none."""
    for name, files in groups:
        count = 0
        for path in files:
            for text in read_documents(path, text_field):
                count += 1
                yield text
        if count == 0:
            raise InputError(f"{name}: no non-empty documents")


def is_val(text: str, val_fraction: float) -> bool:
    """Stable per-document coin: the first 8 bytes of a hash of the text, read as a fraction."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


def token_dtype(n_vocab: int) -> np.dtype:
    return np.dtype(np.uint16 if n_vocab <= 2**16 else np.uint32)


def display_path(path: Path) -> str:
    """Paths under the working directory are recorded relative to it, so meta.json is portable."""
    resolved = path.resolve()
    try:
        return str(resolved.relative_to(Path.cwd()))
    except ValueError:
        return str(resolved)


def prepare(
    inputs: list[str],
    tokenizer_path: str,
    out_dir: str,
    val_fraction: float = 0.05,
    text_field: str = "text",
    chunk_docs: int = 256,
) -> dict:
    """Tokenize `inputs` into `out_dir`; returns the meta.json contents."""
    if not 0.0 < val_fraction < 1.0:
        raise InputError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    tokenizer: Tokenizer = build_tokenizer(tokenizer_path)
    dtype = token_dtype(tokenizer.n_vocab)
    groups = list_input_files(inputs)  # fail on a missing input before any work
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tmp: dict[str, BinaryIO] = {}
    done = False
    try:
        for name in (*SPLITS, "meta"):  # hidden names of this process; "x" never shares a file
            tmp[name] = open(out / f".{name}.{os.getpid()}.tmp", "xb")
        counts = {s: {"documents": 0, "tokens": 0, "text_bytes": 0} for s in SPLITS}
        start = last_report = time.monotonic()

        def flush(texts: list[str]) -> None:
            for text, ids in zip(texts, tokenizer.encode_batch(texts)):
                split = "val" if is_val(text, val_fraction) else "train"
                ids.append(tokenizer.eot_id)
                np.asarray(ids, dtype=dtype).tofile(tmp[split])
                c = counts[split]
                c["documents"] += 1
                c["tokens"] += len(ids)
                c["text_bytes"] += len(text.encode("utf-8"))
            texts.clear()

        pending: list[str] = []
        for text in iter_all_documents(groups, text_field):
            pending.append(text)
            if len(pending) >= chunk_docs:
                flush(pending)
            if time.monotonic() - last_report > 5.0:
                last_report = time.monotonic()
                mb = sum(c["text_bytes"] for c in counts.values()) / 1e6
                print(
                    f"  {sum(c['documents'] for c in counts.values()):,} documents, "
                    f"{sum(c['tokens'] for c in counts.values()):,} tokens, {mb:,.1f} MB "
                    f"({mb / (last_report - start):.1f} MB/s)",
                    file=sys.stderr,
                    flush=True,
                )
        flush(pending)
        for split in SPLITS:
            if counts[split]["documents"] == 0:
                total = sum(c["documents"] for c in counts.values())
                raise InputError(
                    f"no document fell into the {split} split ({total} documents, val fraction "
                    f"{val_fraction}); add documents or change --val-fraction"
                )

        tok_file = Path(tokenizer_path)
        meta = {
            "dtype": dtype.name,
            "vocab_size": tokenizer.n_vocab,
            "eot_id": tokenizer.eot_id,
            "tokenizer": tok_file.name if tok_file.is_file() else tokenizer_path,
            "tokenizer_sha256": file_sha256(tok_file) if tok_file.is_file() else None,
            "val_fraction": val_fraction,
            "text_field": text_field,
            "splits": {s: {"file": f"{s}.bin", **counts[s]} for s in SPLITS},
            "sources": [display_path(p) for _, files in groups for p in files],
        }
        tmp["meta"].write(json.dumps(meta, indent=2).encode() + b"\n")
        for f in tmp.values():
            f.close()
        # A stale meta.json beside half-renamed token files must not look valid: drop it first
        # and put the new one in place last.
        (out / "meta.json").unlink(missing_ok=True)
        for split in SPLITS:
            os.replace(tmp[split].name, out / f"{split}.bin")
        os.replace(tmp["meta"].name, out / "meta.json")
        done = True
        return meta
    finally:
        if not done:
            for f in tmp.values():
                f.close()
                Path(f.name).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help=".txt / .jsonl files or directories")
    parser.add_argument("--tokenizer", required=True, help="ranks file or tiktoken encoding name")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--text-field", default="text", help="JSON field of .jsonl documents")
    args = parser.parse_args(argv)

    start = time.monotonic()
    try:
        meta = prepare(args.inputs, args.tokenizer, args.out, args.val_fraction, args.text_field)
    except (InputError, FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 1
    for split, c in meta["splits"].items():
        print(
            f"{split}: {c['documents']:,} documents, {c['tokens']:,} tokens "
            f"({c['text_bytes'] / c['tokens']:.2f} bytes/token) -> {Path(args.out) / c['file']}"
        )
    print(f"{meta['dtype']}, vocab {meta['vocab_size']}, {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
