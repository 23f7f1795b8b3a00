#!/usr/bin/env python
"""Tokenize local text into memory-mapped token files for training.

Inputs are .txt files (one document per file) and .jsonl files (one document per line, in field
--text-field), named directly or found in directories (recursively, in sorted order). Writes to
--out:

    train.bin, val.bin   flat token streams; every document (or part of one, with --split tail)
                         is followed by <|endoftext|>
    meta.json            dtype, vocab size, tokenizer file and sha256, split kind, documents /
                         tokens / UTF-8 text bytes / largest token id per split, val fraction, sources

--split auto (the default): tail for a single .txt file (one document: a document split would leave
one of the splits empty), document otherwise.

--split document (right for large corpora): a document goes to val when a hash of
its text falls below --val-fraction. The split is the same on every run and machine whatever the
input order, and no document straddles the two splits.

--split tail (right for a small corpus of few, long documents, where a handful of whole documents
would make val a different domain from train): every document is cut at a token boundary; its
last floor(n * val_fraction) of n tokens go to val and the rest to train, each part followed by
<|endoftext|>. A cut that would fall inside a UTF-8 character moves later to the next character
boundary, so both parts decode to text; a document too short to give val a token stays whole in
train. Train parts are written in input order (the loader shuffles windows); val parts are held
in memory and written in the order of a hash of their document's text, so that the first windows
of val.bin (which validation reads) mix the sources, and val.bin does not depend on input order.

--format chat reads .jsonl conversations, one per line: {"messages": [{"role": "system|user|assistant|tool",
"content": ...}, ...]}, ShareGPT {"conversations": [{"from": "human|gpt|...", "value": ...}]} or
{"prompt": ..., "completion": ...} (strings, or lists of messages), with tool calls (elr/text/chat_formats.py:
the shapes, and which turns train); renders them with elr/text/chat.py's template and writes token,
scored-flag and offset files per split (elr/text/chat_data.py; split by a hash of each conversation);
--max-tokens refuses a conversation longer than the training row (seq_len + 1), naming its line.

Outputs are written under temporary names and renamed only when complete.

    python scripts/prepare_data.py --tokenizer data/tokenizer/elr8k.tiktoken \\
        --out data/tinyprose path/to/texts/ more.jsonl
    python scripts/prepare_data.py --tokenizer data/tokenizer/elr8k.tiktoken \\
        --out data/tinyprose --split tail --val-fraction 0.02 path/to/texts/
    python scripts/prepare_data.py --format chat --tokenizer data/tokenizer/elr8k.tiktoken \\
        --out data/chat --val-fraction 0.15 --max-tokens 129 data/chat/conversations.jsonl
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

from elr.cli import HelpFormatter
from elr.console.progress import duration
from elr.errors import DataError
from elr.text.chat_data import prepare_chat
from elr.text.tokenizer import Tokenizer, build_tokenizer, file_sha256

SPLITS = ("train", "val")
BUNDLED_TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "tokenizer" / "elr8k.tiktoken"
SPLIT_KINDS = ("document", "tail")
SPLIT_CHOICES = ("auto", *SPLIT_KINDS)
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
                    raise InputError(f"{path}:{lineno}: not a JSON object with a {text_field!r} field ({e})") from None
                if not isinstance(text, str):
                    raise InputError(f"{path}:{lineno}: field {text_field!r} is not a string")
                if text.strip():
                    yield text
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not valid UTF-8 ({e})") from None


def iter_all_documents(groups: list[tuple[str, list[Path]]], text_field: str = "text") -> Iterator[str]:
    """Every document of every input (from `list_input_files`), failing on one with none."""
    for name, files in groups:
        count = 0
        for path in files:
            for text in read_documents(path, text_field):
                count += 1
                yield text
        if count == 0:
            raise InputError(f"{name}: no non-empty documents")


def text_hash(text: str) -> int:
    """Stable per-document number in [0, 2^64): the first 8 bytes of a hash of the text."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def is_val(text: str, val_fraction: float) -> bool:
    """Stable per-document coin: the text's hash, read as a fraction, below val_fraction."""
    return text_hash(text) / 2**64 < val_fraction


def tail_cut(ids: list[int], val_fraction: float, token_bytes) -> int:
    """Where --split tail cuts a document's ids: the last floor(n * val_fraction) go to val,
    the cut moved later past tokens that continue a UTF-8 character (`token_bytes(id)` gives a
    token's bytes). Returns len(ids) when val gets nothing; never 0, as val_fraction < 1."""
    cut = len(ids) - int(len(ids) * val_fraction)
    while cut < len(ids) and token_bytes(ids[cut])[0] & 0xC0 == 0x80:
        cut += 1
    return cut


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
    split: str = "auto",
) -> dict:
    """Tokenize `inputs` into `out_dir`; returns the meta.json contents."""
    if not 0.0 < val_fraction < 1.0:
        raise InputError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    if split not in SPLIT_CHOICES:
        raise InputError(f"--split must be one of {', '.join(SPLIT_CHOICES)}, got {split!r}")
    tokenizer: Tokenizer = build_tokenizer(tokenizer_path)
    dtype = token_dtype(tokenizer.n_vocab)
    groups = list_input_files(inputs)  # fail on a missing input before any work
    if split == "auto":
        files = [f for _, group in groups for f in group]
        split = "tail" if len(files) == 1 and files[0].suffix == ".txt" else "document"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tmp: dict[str, BinaryIO] = {}
    done = False
    try:
        for name in (*SPLITS, "meta"):  # hidden names of this process; "x" never shares a file
            tmp[name] = open(out / f".{name}.{os.getpid()}.tmp", "xb")
        # max_token_id: checked against vocab_size whenever the data is opened (elr/data/loader.py)
        counts = {s: {"documents": 0, "tokens": 0, "text_bytes": 0, "max_token_id": 0} for s in SPLITS}
        start = last_report = time.monotonic()
        tty = sys.stderr.isatty()  # on a terminal one line redrawn in place, else a line every 5 s
        token_bytes = tokenizer.encoding.decode_single_token_bytes
        tails: list[tuple[int, np.ndarray]] = []  # --split tail: (document hash, val part)

        def add(part: str, ids: list[int], text_bytes: int) -> np.ndarray:
            """Count one document (or part) of `part`, with its <|endoftext|>; its tokens."""
            tokens = np.asarray([*ids, tokenizer.eot_id], dtype=dtype)
            c = counts[part]
            c["documents"] += 1
            c["tokens"] += len(tokens)
            c["text_bytes"] += text_bytes
            c["max_token_id"] = max(c["max_token_id"], int(tokens.max()))
            return tokens

        def flush(texts: list[str]) -> None:
            for text, ids in zip(texts, tokenizer.encode_batch(texts)):
                n_bytes = len(text.encode("utf-8"))
                if split == "document":
                    part = "val" if is_val(text, val_fraction) else "train"
                    add(part, ids, n_bytes).tofile(tmp[part])
                    continue
                cut = tail_cut(ids, val_fraction, token_bytes)
                val_bytes = sum(len(token_bytes(t)) for t in ids[cut:])
                add("train", ids[:cut], n_bytes - val_bytes).tofile(tmp["train"])
                if cut < len(ids):
                    tails.append((text_hash(text), add("val", ids[cut:], val_bytes)))
            texts.clear()

        pending: list[str] = []
        for text in iter_all_documents(groups, text_field):
            pending.append(text)
            if len(pending) >= chunk_docs:
                flush(pending)
            if time.monotonic() - last_report > (0.5 if tty else 5.0):  # the progress counter
                last_report = time.monotonic()
                mb = sum(c["text_bytes"] for c in counts.values()) / 1e6
                line = (
                    f"prepare_data: {sum(c['documents'] for c in counts.values()):,} documents, "
                    f"{sum(c['tokens'] for c in counts.values()):,} tokens, {mb:,.1f} MB "
                    f"({mb / (last_report - start):.1f} MB/s) | {duration(last_report - start)}"
                )
                sys.stderr.write("\r" + line + "\033[K" if tty else line + "\n")
                sys.stderr.flush()
        flush(pending)
        if tty and last_report > start:
            sys.stderr.write("\n")
        # Sorted by hash alone, a tie is two identical documents with identical tails.
        for _, tokens in sorted(tails, key=lambda t: t[0]):
            tokens.tofile(tmp["val"])
        for part in SPLITS:
            if counts[part]["documents"] > 0:
                continue
            if split == "document":
                total = sum(c["documents"] for c in counts.values())
                raise InputError(
                    f"no document fell into the {part} split ({total} documents, val fraction "
                    f"{val_fraction}); add documents or change --val-fraction, or use --split tail (the end "
                    "of every document goes to val: right for a few long documents)"
                )
            raise InputError(  # tail: train always gets a part, val may not
                f"no document is long enough to give the val split a token with --split tail "
                f"({counts['train']['documents']} documents, val fraction {val_fraction}); add "
                "text or raise --val-fraction"
            )

        tok_file = Path(tokenizer_path)
        meta = {
            "dtype": dtype.name,
            "vocab_size": tokenizer.n_vocab,
            "eot_id": tokenizer.eot_id,
            "tokenizer": tok_file.name if tok_file.is_file() else tokenizer_path,
            "tokenizer_path": str(tok_file.resolve()) if tok_file.is_file() else None,  # the trainer's default
            "tokenizer_sha256": file_sha256(tok_file) if tok_file.is_file() else None,
            "split": split,
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
        for part in SPLITS:
            os.replace(tmp[part].name, out / f"{part}.bin")
        os.replace(tmp["meta"].name, out / "meta.json")
        done = True
        return meta
    finally:
        if not done:
            for f in tmp.values():
                f.close()
                Path(f.name).unlink(missing_ok=True)


def check_out(out: Path, replace: bool) -> None:
    """--out must be a folder to write into: not a file, and not a prepared dataset unless --replace."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out: {out} is a file, not a folder")
    if (out / "meta.json").exists() and not replace:
        raise InputError(
            f"--out: {out} already holds a prepared dataset (meta.json); pass --replace to write "
            "over it, or choose another folder"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("inputs", nargs="+", help=".txt / .jsonl files or directories")
    parser.add_argument(
        "--tokenizer",
        default=str(BUNDLED_TOKENIZER),
        help="ranks file or tiktoken encoding name (default: the bundled 8k BPE, %(default)s)",
    )
    parser.add_argument(
        "--out", required=True, help="output directory (a new or empty one, or a prepared one with --replace)"
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="write over the prepared dataset --out already holds (default: refuse; runs that "
        "trained on it could no longer resume on the same data)",
    )
    parser.add_argument(
        "--split",
        choices=SPLIT_CHOICES,
        default="auto",
        help="document: whole documents go to val by a hash of their text (large corpora); "
        "tail: the last val fraction of every document's tokens goes to val (small corpora); "
        "auto: tail for a single .txt file, document otherwise",
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.05,
        help="share of documents (document split) or of each document's tokens (tail split) for val",
    )
    parser.add_argument("--text-field", default="text", help="JSON field of .jsonl documents")
    parser.add_argument(
        "--format",
        choices=("text", "chat"),
        default="text",
        help="text: documents (above); chat: .jsonl conversations (messages, ShareGPT, prompt/completion), "
        "loss on the assistant turns",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="chat: refuse a conversation longer than this (training.seq_len + 1; 0: no limit)",
    )
    args = parser.parse_args(argv)

    start = time.monotonic()
    try:
        check_out(Path(args.out), args.replace)
    except InputError as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 1
    if args.format == "chat":
        return main_chat(args, start)
    try:
        meta = prepare(
            args.inputs,
            args.tokenizer,
            args.out,
            args.val_fraction,
            args.text_field,
            split=args.split,
        )
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


def main_chat(args, start: float) -> int:
    """--format chat: conversations -> elr/text/chat_data.py's files; errors name the file and line."""
    try:
        if not 0.0 < args.val_fraction < 1.0:
            raise InputError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
        files = [p for _, group in list_input_files(args.inputs) for p in group]
        if any(p.suffix != ".jsonl" for p in files):
            raise InputError(f"--format chat reads .jsonl files, not {next(p for p in files if p.suffix != '.jsonl')}")
        meta = prepare_chat(
            files, build_tokenizer(args.tokenizer), args.tokenizer, args.out, args.val_fraction, args.max_tokens
        )
    except (InputError, DataError, FileNotFoundError) as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 1
    for split, c in meta["splits"].items():
        print(
            f"{split}: {c['conversations']:,} conversations, {c['tokens']:,} tokens ({c['scored_tokens']:,} "
            f"scored), longest {c['longest']} ({c['longest_at']}) -> {Path(args.out) / c['file']}"
        )
    print(f"{meta['dtype']}, vocab {meta['vocab_size']}, {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
