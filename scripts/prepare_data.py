#!/usr/bin/env python
"""Tokenize local text into a sharded token folder for training, in parallel on one machine.

Inputs are .txt files (one document per file) and .jsonl files (one document per line, in field
--text-field), named directly or found in directories (recursively, in sorted order). Writes to --out
(elr/data/folders.py's layout, elr/data/prepare.py's work):

    train-00000.bin, val-00000.bin, ...   the shards' tokens (uint16, or uint32 past 65,536 ids): whole
                                          documents (or parts, with --split tail), each followed by <|endoftext|>
    train-00000.starts, ...               int64: where each document starts in its shard
    meta.json                             dtype, vocab size, tokenizer file and sha256, split kind, val fraction,
                                          documents / tokens / UTF-8 text bytes / largest id per split, every
                                          shard's token and document counts, the input files

The inputs are cut into units of about --shard-mb megabytes of text; unit i becomes shard i of each split.
--workers N tokenizes N units at a time, each in its own process; the shards do not depend on N (token for
token the same as --workers 1). A progress line gives tokens/s and the time left.

Resumable: finished shards wait in --out/.partial until every unit is done; an interrupted run (Ctrl-C,
SIGTERM: it stops within a second, prints one line and exits 130 / 143, leaving no temporary file) is
continued by the same command, which keeps every finished shard whose input files have not changed.
--append adds new inputs' shards to a prepared folder without rewriting the old ones; --replace prepares the
folder anew (the old dataset stays readable until the new one is complete).

--split auto (the default): tail for a single .txt file (one document: a document split would leave
one of the splits empty), document otherwise. --split document (right for large corpora): a document goes
to val when a hash of its text falls below --val-fraction, the same on every run and machine whatever the
input order. --split tail (right for a small corpus of few, long documents): the last floor(n *
val_fraction) of every document's n tokens go to val (a cut inside a UTF-8 character moves to the next
boundary), each part followed by <|endoftext|>; each shard's val parts are ordered by a hash of their
document's text, so its first windows mix the sources.

--record-documents FOLDER writes the document starts of an older single-file folder (train.bin / val.bin)
from its <|endoftext|> tokens, so `data.document_masking` can read it. --format chat reads .jsonl
conversations (elr/text/chat_formats.py: messages, ShareGPT, prompt/completion, tool calls) into
elr/text/chat_data.py's files; --max-tokens refuses a conversation longer than the training row.

    python scripts/prepare_data.py --tokenizer data/tokenizer/elr8k.tiktoken \\
        --out data/mycorpus --workers 8 path/to/texts/ more.jsonl
    python scripts/prepare_data.py --out data/mycorpus --append --workers 8 new_texts/
    python scripts/prepare_data.py --out data/mybook --split tail --val-fraction 0.02 book.txt
    python scripts/prepare_data.py --record-documents data/tinyprose
    python scripts/prepare_data.py --format chat --tokenizer data/tokenizer/elr8k.tiktoken \\
        --out data/chat --val-fraction 0.15 --max-tokens 129 data/chat/conversations.jsonl
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from elr.cli import HelpFormatter
from elr.console.progress import duration
from elr.data.folders import META, SHARDED, STARTS, record_document_starts, shard_name
from elr.data.prepare import (
    SPLITS,
    Piece,
    Settings,
    count,
    folder_meta,
    list_input_files,
    plan_units,
    remove_temporary,
    start_worker,
    work,
    write_json,
    write_unit,
)
from elr.data.token_files import read_meta
from elr.errors import DataError
from elr.text.tokenizer import build_tokenizer, file_sha256

BUNDLED_TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "tokenizer" / "elr8k.tiktoken"
SPLIT_KINDS = ("document", "tail")
SPLIT_CHOICES = ("auto", *SPLIT_KINDS)
STAGING = ".partial"  # finished shards wait here until every unit is done
SETTINGS_COMPARED = ("dtype", "vocab_size", "tokenizer_sha256", "split", "val_fraction", "text_field")


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: the one line to print, and the exit status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def display_path(path: Path) -> str:
    """Paths under the working directory are recorded relative to it, so meta.json is portable."""
    resolved = path.resolve()
    try:
        return str(resolved.relative_to(Path.cwd()))
    except ValueError:
        return str(resolved)


# ---- the run ----


class ProgressLine:
    """`prepare_data: 3/12 shards, 1,234,567 tokens (540,000 tokens/s), 41.0 of 120.0 MB | 12s, eta 24s`: redrawn
    in place on a terminal, a line every 5 s into a file. Rates and the time left count this run's work."""

    def __init__(self, shards: int, done: int, total_bytes: int):
        self.shards, self.done, self.total_bytes = shards, done, total_bytes
        self.start = self.last = time.monotonic()
        self.tty, self.ended = sys.stderr.isatty(), False

    def update(self, done: int, text_bytes: int, tokens: int, final: bool = False) -> None:
        """The line for `done` shards in all and this run's input bytes and tokens; `final`: the last line of a
        run that printed one, whatever the time since (and ended, on a terminal)."""
        done += self.done
        now = time.monotonic()
        if now - self.last < (0.5 if self.tty else 5.0) and not (final and self.last > self.start):
            return  # a run shorter than one interval prints nothing
        self.last, elapsed = now, max(now - self.start, 1e-9)
        rate = text_bytes / elapsed
        eta = (self.total_bytes - text_bytes) / rate if rate > 0 else 0.0
        line = (
            f"prepare_data: {done}/{self.shards} shards, {tokens:,} tokens ({tokens / elapsed:,.0f} tokens/s), "
            f"{text_bytes / 1e6:,.1f} of {self.total_bytes / 1e6:,.1f} MB | {duration(elapsed)}, eta {duration(eta)}"
        )
        sys.stderr.write("\r" + line + "\033[K" + ("\n" if final else "") if self.tty else line + "\n")
        sys.stderr.flush()
        self.ended = final

    def end(self) -> None:
        """After an interruption: end a line redrawn in place, so the next message starts its own."""
        if self.tty and self.last > self.start and not self.ended:
            sys.stderr.write("\n")


def run_units(todo: list[tuple[int, list[Piece]]], workers: int, tokenizer_path: str, settings, staging, progress):
    """Write every unit of `todo`, `workers` at a time; Ctrl-C / SIGTERM end them within a second."""
    ctx = multiprocessing.get_context("fork")
    counters = (ctx.Value("q", 0), ctx.Value("q", 0))  # text bytes, tokens done in this run
    finished = 0
    if workers == 1:  # in this process: Ctrl-C interrupts the shard being written, which removes its files
        tokenizer = build_tokenizer(tokenizer_path)

        def report(text_bytes: int, tokens: int) -> None:
            count(counters, text_bytes, tokens)
            progress.update(finished, counters[0].value, counters[1].value)

        for index, pieces in todo:
            write_unit(index, pieces, tokenizer, settings, staging, report)
            finished += 1
        progress.update(finished, counters[0].value, counters[1].value, final=bool(todo))
        return
    with ctx.Pool(workers, start_worker, (tokenizer_path, settings, staging, counters)) as pool:
        try:
            pending = [pool.apply_async(work, unit) for unit in todo]
            while pending:
                time.sleep(0.1)
                for result in [r for r in pending if r.ready()]:
                    result.get()  # a worker's error (a bad input line) stops the run here
                    pending.remove(result)
                    finished += 1
                progress.update(finished, counters[0].value, counters[1].value)
            progress.update(finished, counters[0].value, counters[1].value, final=True)
        except BaseException:
            pool.terminate()  # SIGTERM to every worker: they stop mid-shard
            pool.join()
            raise


def _stop(signum, frame):
    raise KeyboardInterrupt(signum)


def prepare(
    inputs: list[str],
    tokenizer_path: str,
    out_dir: str,
    val_fraction: float = 0.05,
    text_field: str = "text",
    split: str = "auto",
    workers: int = 1,
    shard_mb: float = 256.0,
    replace: bool = False,
    append: bool = False,
) -> dict:
    """Tokenize `inputs` into the sharded folder `out_dir`; returns its meta.json."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    if workers < 1 or shard_mb <= 0:
        raise DataError(f"--workers must be >= 1 and --shard-mb > 0 (got {workers}, {shard_mb})")
    tokenizer = build_tokenizer(tokenizer_path)
    groups = list_input_files(inputs)  # fail on a missing input before any work
    if split == "auto":
        files = [f for _, group in groups for f in group]
        split = "tail" if len(files) == 1 and files[0].suffix == ".txt" else "document"
    tok_file = Path(tokenizer_path)
    settings = Settings(
        tokenizer_path, file_sha256(tok_file) if tok_file.is_file() else "", split, val_fraction, text_field
    )
    out = Path(out_dir)
    previous = read_meta(out) if append else None
    if previous:  # before any work: the new shards must be made as the old ones were
        appended(previous, folder_meta([], tokenizer, settings, [], None))
    first = len(previous["splits"]["train"]["shards"]) if previous else 0
    units = plan_units(groups, max(int(shard_mb * 2**20), 1))
    staging = out / STAGING
    staging.mkdir(parents=True, exist_ok=True)
    remove_temporary(staging)
    records = reusable_records(staging, units, first, settings)
    todo = [(first + k, unit) for k, unit in enumerate(units) if first + k not in records]
    progress = ProgressLine(len(units), len(records), sum(p.end - p.start for _, unit in todo for p in unit))
    handlers = {s: signal.signal(s, _stop) for s in (signal.SIGTERM,)}
    try:
        run_units(todo, workers, tokenizer_path, settings, staging, progress)
    except KeyboardInterrupt as e:
        progress.end()
        remove_temporary(staging)
        done = sum(1 for k in range(len(units)) if (staging / record_name(first + k)).is_file())
        signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
        raise Interrupted(
            f"interrupted: {done} of {len(units)} shards are finished and kept in {staging}; the same command "
            "continues from them",
            128 + int(signum),
        ) from None
    except BaseException:
        progress.end()
        remove_temporary(staging)
        if not any(staging.glob("shard-*.json")):
            shutil.rmtree(staging, ignore_errors=True)  # nothing finished to keep
        raise
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    records = [json.loads((staging / record_name(first + k)).read_text()) for k in range(len(units))]
    try:
        check_content(groups, records, settings)
    except DataError:
        shutil.rmtree(staging, ignore_errors=True)  # these inputs and options cannot make a dataset
        raise
    sources = [display_path(p) for _, files in groups for p in files]
    meta = folder_meta(records, tokenizer, settings, sources, display_path(tok_file) if tok_file.is_file() else None)
    if previous:
        meta = appended(previous, meta)
    commit(out, staging, records, meta, replace)
    return meta


def record_name(index: int) -> str:
    return f"shard-{index:05d}.json"


def reusable_records(staging: Path, units: list[list[Piece]], first: int, settings: Settings) -> dict[int, dict]:
    """The finished shards of an earlier, interrupted run that this plan would make alike (same pieces of
    unchanged files, same options); any other finished shard there is deleted."""
    kept = {}
    planned = {first + k: [asdict(p) for p in unit] for k, unit in enumerate(units)}
    for path in sorted(staging.glob("shard-*.json")):
        record = json.loads(path.read_text())
        index = record.get("index")
        if record.get("settings") == asdict(settings) and planned.get(index) == record.get("pieces"):
            kept[index] = record
            continue
        for split in SPLITS:
            for suffix in (".bin", STARTS):
                (staging / (shard_name(split, index) + suffix)).unlink(missing_ok=True)
        path.unlink()
    return kept


def check_content(groups, records: list[dict], settings: Settings) -> None:
    """Every input gave a document, and both splits got one (else a line saying which option to change)."""
    per_group = [0] * len(groups)
    for record in records:
        for group, n in record["documents_per_input"].items():
            per_group[int(group)] += n
    for (name, _), n in zip(groups, per_group):
        if n == 0:
            raise DataError(f"{name}: no non-empty documents")
    counts = {s: sum(r["splits"][s]["documents"] for r in records) for s in SPLITS}
    for part in SPLITS:
        if counts[part] > 0:
            continue
        if settings.split == "document":
            raise DataError(
                f"no document fell into the {part} split ({sum(counts.values())} documents, val fraction "
                f"{settings.val_fraction}); add documents or change --val-fraction, or use --split tail (the end "
                "of every document goes to val: right for a few long documents)"
            )
        raise DataError(  # tail: train always gets a part, val may not
            f"no document is long enough to give the val split a token with --split tail "
            f"({counts['train']} documents, val fraction {settings.val_fraction}); add text or raise --val-fraction"
        )


def appended(previous: dict, new: dict) -> dict:
    """meta.json of a folder whose shards are the previous ones, then the new ones."""
    for key in SETTINGS_COMPARED:
        if previous.get(key) != new.get(key):
            raise DataError(
                f"--append: the folder was prepared with {key} = {previous.get(key)!r}, this run would use "
                f"{new.get(key)!r}; use the same options, or prepare another folder"
            )
    new = {**new, "splits": {split: dict(entry) for split, entry in new["splits"].items()}}
    for split in SPLITS:
        old, add = previous["splits"][split], new["splits"][split]
        for key in ("documents", "tokens", "text_bytes"):
            add[key] += old[key]
        add["max_token_id"] = max(add["max_token_id"], old["max_token_id"])
        add["shards"] = old["shards"] + add["shards"]
    new["sources"] = previous.get("sources", []) + new["sources"]
    return new


def commit(out: Path, staging: Path, records: list[dict], meta: dict, replace: bool) -> None:
    """Move the finished shards into the folder and write meta.json last. Replacing, the old meta.json goes
    first (a stale one beside half-moved shards must not look valid), then the old token files."""
    if replace:
        (out / META).unlink(missing_ok=True)
        for split in SPLITS:
            for old in [out / f"{split}.bin", out / f"{split}{STARTS}", *out.glob(f"{split}-[0-9]*")]:
                old.unlink(missing_ok=True)
    for record in records:
        for split in SPLITS:
            for suffix in (".bin", STARTS):
                name = shard_name(split, record["index"]) + suffix
                os.replace(staging / name, out / name)
    write_json(out / META, meta)
    shutil.rmtree(staging)


def check_out(out: Path, replace: bool, append: bool) -> None:
    """--out must be a folder to write into: not a file, and not a prepared dataset unless --replace or
    --append (a sharded one)."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out: {out} is a file, not a folder")
    if replace and append:
        raise DataError("--replace and --append: choose one")
    prepared = (out / META).exists()
    if append:
        if not prepared:
            raise DataError(f"--append: {out} holds no prepared dataset (meta.json) to add to")
        if read_meta(out).get("format") != SHARDED:
            raise DataError(
                f"--append: {out} is a single-file folder; prepare its inputs and the new ones anew (--replace)"
            )
    elif prepared and not replace:
        raise DataError(
            f"--out: {out} already holds a prepared dataset (meta.json); pass --replace to write "
            "over it, --append to add shards to it, or choose another folder"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("inputs", nargs="*", help=".txt / .jsonl files or directories")
    parser.add_argument(
        "--tokenizer",
        default=str(BUNDLED_TOKENIZER),
        help="ranks file or tiktoken encoding name (default: the bundled 8k BPE, %(default)s)",
    )
    parser.add_argument("--out", help="output directory (new or empty, or prepared with --replace / --append)")
    parser.add_argument("--workers", type=int, default=1, help="processes tokenizing shards at once")
    parser.add_argument("--shard-mb", type=float, default=256.0, help="megabytes of input text per shard")
    parser.add_argument(
        "--replace",
        action="store_true",
        help="prepare the dataset --out holds anew (default: refuse; runs that trained on it could no longer "
        "resume on the same data)",
    )
    parser.add_argument("--append", action="store_true", help="add the inputs' shards to the folder --out holds")
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
    parser.add_argument(
        "--record-documents",
        metavar="FOLDER",
        help="write an older single-file folder's document starts (from its <|endoftext|> tokens) and exit",
    )
    args = parser.parse_args(argv)

    start = time.monotonic()
    if args.record_documents:
        try:
            found = record_document_starts(Path(args.record_documents))
        except (DataError, FileNotFoundError) as e:
            print(f"prepare_data: error: {e}", file=sys.stderr)
            return 1
        print(", ".join(f"{split}: {n:,} documents" for split, n in found.items()) + f" -> {args.record_documents}")
        return 0
    if not args.inputs or not args.out:
        parser.error("give the inputs and --out (or --record-documents FOLDER)")
    try:
        check_out(Path(args.out), args.replace, args.append)
    except DataError as e:
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
            args.split,
            args.workers,
            args.shard_mb,
            args.replace,
            args.append,
        )
    except Interrupted as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return e.status
    except (DataError, FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 1
    for split, c in meta["splits"].items():
        print(
            f"{split}: {c['documents']:,} documents, {c['tokens']:,} tokens "
            f"({c['text_bytes'] / max(c['tokens'], 1):.2f} bytes/token) in {len(c['shards'])} shards"
        )
    print(f"{meta['dtype']}, vocab {meta['vocab_size']}, {time.monotonic() - start:.1f} s -> {args.out}")
    return 0


def main_chat(args, start: float) -> int:
    """--format chat: conversations -> elr/text/chat_data.py's files; errors name the file and line."""
    from elr.text.chat_data import prepare_chat  # torch: only chat folders need it

    try:
        if not 0.0 < args.val_fraction < 1.0:
            raise DataError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
        files = [p for _, group in list_input_files(args.inputs) for p in group]
        if any(p.suffix != ".jsonl" for p in files):
            raise DataError(f"--format chat reads .jsonl files, not {next(p for p in files if p.suffix != '.jsonl')}")
        meta = prepare_chat(
            files, build_tokenizer(args.tokenizer), args.tokenizer, args.out, args.val_fraction, args.max_tokens
        )
    except (DataError, FileNotFoundError) as e:
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
