#!/usr/bin/env python
"""Train a byte-level BPE on local text and write it as a tiktoken ranks file.

Inputs are read as in prepare_data.py (.txt = one document, .jsonl = one document per line,
directories searched recursively). The BPE splits text with the GPT-4 regex
(`elr.text.tokenizer.SPLIT_PATTERN`) and learns `--vocab-size` ranks: 256 single bytes plus
merges. `build_tokenizer` adds `<|endoftext|>` with id = vocab size, so a model needs an
embedding of at least vocab size + 1 rows.

Training uses rustbpe (pip install rustbpe; MIT): it trains with exactly this regex and hands
back raw-byte ranks that tiktoken loads as they are. It is only needed to run this script.

    python scripts/train_tokenizer.py --vocab-size 8192 \\
        --out data/tokenizer/elr8k.tiktoken path/to/texts/ more.jsonl
"""

from __future__ import annotations

import argparse
import base64
import itertools
import os
import sys
import time
from pathlib import Path

from elr.cli import HelpFormatter
from elr.data.prepare import iter_all_documents, list_input_files
from elr.errors import DataError
from elr.text.tokenizer import SPLIT_PATTERN, build_tokenizer

CHECK_DOCS = 64  # documents re-encoded with tiktoken to prove the written file is equivalent


class InputError(Exception):
    """A problem with the user's inputs or setup; reported as one line and exit status 1."""


def write_ranks(ranks: dict[bytes, int], path: Path) -> None:
    """One `base64(token) rank` line per token, ordered by rank (tiktoken's format)."""
    with open(path, "xb") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


def check_equivalent(bpe, path: Path, groups: list, text_field: str) -> None:
    """The ranks file carries no regex: prove that tiktoken, given our pattern, tokenizes the
    first documents exactly as the trainer did, so the BPE is used the way it was learned."""
    tokenizer = build_tokenizer(str(path))
    n_docs = n_bytes = n_tokens = 0
    for text in itertools.islice(iter_all_documents(groups, text_field), CHECK_DOCS):
        ids = tokenizer.encode(text)
        if ids != bpe.encode(text) or tokenizer.decode(ids) != text:
            raise RuntimeError("tiktoken and rustbpe disagree on a document; file not usable")
        n_docs += 1
        n_bytes += len(text.encode("utf-8"))
        n_tokens += len(ids)
    print(
        f"n_vocab {tokenizer.n_vocab} (eot_id {tokenizer.eot_id}), "
        f"{n_bytes / n_tokens:.2f} bytes/token on {n_docs} documents"
    )


def train(inputs: list[str], vocab_size: int, out: Path, text_field: str = "text") -> None:
    try:
        import rustbpe
    except ImportError:
        raise InputError("rustbpe is not installed: pip install rustbpe") from None
    if vocab_size < 257:
        raise InputError(f"--vocab-size must exceed the 256 byte tokens, got {vocab_size}")
    groups = list_input_files(inputs)

    start = time.monotonic()
    bpe = rustbpe.Tokenizer()
    bpe.train_from_iterator(iter_all_documents(groups, text_field), vocab_size=vocab_size, pattern=SPLIT_PATTERN)
    ranks = {bytes(token): rank for token, rank in bpe.get_mergeable_ranks()}
    if len(ranks) != vocab_size:
        raise InputError(f"the corpus yields only {len(ranks)} tokens, fewer than --vocab-size {vocab_size}")
    print(f"trained {len(ranks)} ranks in {time.monotonic() - start:.1f} s")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"  # renamed into place once checked
    try:
        write_ranks(ranks, tmp)
        check_equivalent(bpe, tmp, groups, text_field)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {out} ({out.stat().st_size:,} bytes)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("inputs", nargs="+", help=".txt / .jsonl files or directories")
    parser.add_argument("--out", required=True, help="ranks file to write (.tiktoken)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="ranks, specials excluded")
    parser.add_argument("--text-field", default="text", help="JSON field of .jsonl documents")
    args = parser.parse_args(argv)
    try:
        train(args.inputs, args.vocab_size, Path(args.out), args.text_field)
    except (InputError, DataError) as e:
        print(f"train_tokenizer: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
