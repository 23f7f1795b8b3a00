"""Tokenizing text into a sharded folder (scripts/prepare_data.py is the command): the plan, one shard's work,
and the folder's meta.json.

The plan cuts the inputs into units of about `shard_mb` megabytes of text, from the file sizes alone: .txt
files whole (one document each), .jsonl files in byte ranges, a line belonging to the range its first byte
falls in. Unit i becomes shard i of every split (elr/data/folders.py's layout). A unit's shard depends on
nothing but its own text and the options, so any number of workers, in any order, writes the same bytes,
and a shard once written is never written again: a restarted preparation skips it.

Within a unit: --split document sends a document to val when a hash of its text falls below the val
fraction (the same on every machine, whatever the input order); --split tail sends the last floor(n *
fraction) tokens of every document to val (the cut moved past tokens that continue a UTF-8 character), and
the unit's val parts are written in the order of their documents' hashes. Every document or part is
followed by <|endoftext|>; the shard's document starts go to `.starts`.

A unit writes its files under temporary names in the staging folder and renames them once complete, its
record (`shard-NNNNN.json`) last: a unit with a record is done, anything else is a temporary file that the
next run deletes.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from elr.data.folders import SHARDED, STARTS, shard_name
from elr.errors import DataError
from elr.text.tokenizer import Tokenizer, build_tokenizer

SPLITS = ("train", "val")
TEXT_SUFFIXES = (".txt", ".jsonl")
CHUNK_DOCS = 256  # documents tokenized per call (and progress reported per chunk)
TMP = ".tmp"


@dataclass(frozen=True)
class Piece:
    """A byte range of one input file: a whole .txt file, or the .jsonl lines whose first byte falls in
    [start, end). `group`: which command-line input it came from."""

    file: str
    start: int
    end: int
    group: int
    modified: int  # the file's st_mtime_ns when planned: a shard of a file changed since is made again


@dataclass(frozen=True)
class Settings:
    """What decides a shard's bytes besides its text: recorded in the plan, so a restart with other options
    is refused rather than mixed."""

    tokenizer: str
    tokenizer_sha256: str
    split: str
    val_fraction: float
    text_field: str


def list_input_files(inputs: list[str]) -> list[tuple[str, list[Path]]]:
    """Each command-line input with the text files it stands for (a folder: every .txt / .jsonl under it,
    sorted)."""
    groups = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
            if not files:
                raise DataError(f"{name}: directory holds no .txt or .jsonl files")
        elif path.is_file():
            if path.suffix not in TEXT_SUFFIXES:
                raise DataError(f"{name}: expected a .txt or .jsonl file or a directory")
            files = [path]
        else:
            raise DataError(f"{name}: no such file or directory")
        groups.append((name, files))
    return groups


def plan_units(groups: list[tuple[str, list[Path]]], shard_bytes: int) -> list[list[Piece]]:
    """The inputs cut into units of about shard_bytes of text (a .txt file is never cut), in input order."""
    units: list[list[Piece]] = []
    current: list[Piece] = []
    filled = 0
    for group, (_, files) in enumerate(groups):
        for path in files:
            stat = path.stat()
            start = 0
            while True:  # .jsonl cut where the unit fills; .txt (and an empty file) whole
                end = stat.st_size if path.suffix == ".txt" else min(stat.st_size, start + shard_bytes - filled)
                current.append(Piece(str(path), start, end, group, stat.st_mtime_ns))
                filled += end - start
                start = end
                if filled >= shard_bytes:
                    units.append(current)
                    current, filled = [], 0
                if start >= stat.st_size:
                    break
    return [*units, current] if current else units


def read_piece(piece: Piece, text_field: str) -> Iterator[tuple[str, int]]:
    """(document, input bytes read for it) for the non-blank documents of a piece: the whole of a .txt, one per
    .jsonl line starting in the range."""
    path = Path(piece.file)
    try:
        if path.suffix == ".txt":
            text = path.read_text(encoding="utf-8")
            if text.strip():
                yield text, piece.end
            return
        with open(path, "rb") as f:
            f.seek(max(piece.start - 1, 0))
            if piece.start > 0 and f.read(1) != b"\n":  # inside a line: it belongs to the range before
                f.readline()
            read = 0
            while f.tell() < piece.end:
                at = f.tell()
                raw = f.readline()
                if not raw:
                    break
                read += len(raw)
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[text_field]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise DataError(
                        f"{path}:{line_number(path, at)}: not a JSON object with a {text_field!r} field ({e})"
                    ) from None
                if not isinstance(text, str):
                    raise DataError(f"{path}:{line_number(path, at)}: field {text_field!r} is not a string")
                if text.strip():
                    yield text, read
                    read = 0
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e})") from None


def iter_all_documents(groups: list[tuple[str, list[Path]]], text_field: str = "text") -> Iterator[str]:
    """Every document of every input, in order, as prepare_data.py reads them (scripts/train_tokenizer.py's
    corpus); an input with none is one DataError naming it."""
    for name, files in groups:
        count = 0
        for path in files:
            for text, _ in read_piece(Piece(str(path), 0, path.stat().st_size, 0, 0), text_field):
                count += 1
                yield text
        if count == 0:
            raise DataError(f"{name}: no non-empty documents")


def line_number(path: Path, offset: int) -> int:
    """The 1-based number of the line starting at byte `offset` (read only to name a bad line)."""
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


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


class ShardWriter:
    """One split of one shard being written: tokens streamed to a temporary file, document starts kept."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype = path, dtype
        self.file = open(path.with_name(path.name + ".bin" + TMP), "xb")
        self.starts: list[int] = []
        self.counts = {"documents": 0, "tokens": 0, "text_bytes": 0, "max_token_id": 0}

    def add(self, tokens: np.ndarray, text_bytes: int) -> None:
        """A document (or part) with its <|endoftext|>."""
        c = self.counts
        self.starts.append(c["tokens"])
        tokens.tofile(self.file)
        c["documents"] += 1
        c["tokens"] += len(tokens)
        c["text_bytes"] += text_bytes
        c["max_token_id"] = max(c["max_token_id"], int(tokens.max()))

    def finish(self) -> None:
        """Close, write the starts, and move both files to their names."""
        self.file.close()
        starts = self.path.with_name(self.path.name + STARTS + TMP)
        np.asarray(self.starts, dtype="<i8").tofile(starts)
        os.replace(starts, self.path.with_name(self.path.name + STARTS))
        os.replace(self.file.name, self.path.with_name(self.path.name + ".bin"))


def write_unit(
    index: int,
    pieces: list[Piece],
    tokenizer: Tokenizer,
    settings: Settings,
    staging: Path,
    on_progress: Callable[[int, int], None] = lambda input_bytes, tokens: None,
) -> dict:
    """Tokenize one unit into shard `index` of every split in `staging`; returns (and writes last) its record:
    the pieces and, per split, documents, tokens, text bytes and the largest id. on_progress(input bytes,
    tokens) after each chunk of documents; over the unit the input bytes add up to its pieces' sizes."""
    dtype = token_dtype(tokenizer.n_vocab)
    writers = {split: ShardWriter(staging / shard_name(split, index), dtype) for split in SPLITS}
    token_bytes = tokenizer.encoding.decode_single_token_bytes
    tails: list[tuple[int, np.ndarray, int]] = []  # --split tail: (document hash, val part, its text bytes)
    per_group: dict[int, int] = {}

    def tokens_of(ids: list[int]) -> np.ndarray:
        return np.asarray([*ids, tokenizer.eot_id], dtype=dtype)

    reported = 0

    def flush(texts: list[str], input_bytes: int) -> None:
        nonlocal reported
        done_tokens = 0
        for text, ids in zip(texts, tokenizer.encode_batch(texts, num_threads=1)):
            n_bytes = len(text.encode("utf-8"))
            done_tokens += len(ids) + 1
            if settings.split == "document":
                writers["val" if is_val(text, settings.val_fraction) else "train"].add(tokens_of(ids), n_bytes)
                continue
            cut = tail_cut(ids, settings.val_fraction, token_bytes)
            val_bytes = sum(len(token_bytes(t)) for t in ids[cut:])
            writers["train"].add(tokens_of(ids[:cut]), n_bytes - val_bytes)
            if cut < len(ids):
                tails.append((text_hash(text), tokens_of(ids[cut:]), val_bytes))
        on_progress(input_bytes, done_tokens)
        reported += input_bytes
        texts.clear()

    try:
        pending: list[str] = []
        pending_bytes = 0
        for piece in pieces:
            for text, input_bytes in read_piece(piece, settings.text_field):
                per_group[piece.group] = per_group.get(piece.group, 0) + 1
                pending.append(text)
                pending_bytes += input_bytes
                if len(pending) >= CHUNK_DOCS:
                    flush(pending, pending_bytes)
                    pending_bytes = 0
        flush(pending, sum(p.end - p.start for p in pieces) - reported)
        # Sorted by hash alone, a tie is two identical documents with identical tails.
        for _, tokens, text_bytes in sorted(tails, key=lambda t: t[0]):
            writers["val"].add(tokens, text_bytes)
        for writer in writers.values():
            writer.finish()
    finally:
        for writer in writers.values():
            writer.file.close()
            Path(writer.file.name).unlink(missing_ok=True)  # gone already when finished
    record = {
        "index": index,
        "settings": asdict(settings),
        "pieces": [asdict(p) for p in pieces],
        "documents_per_input": {str(g): n for g, n in sorted(per_group.items())},
        "splits": {split: writers[split].counts for split in SPLITS},
    }
    write_json(staging / f"shard-{index:05d}.json", record)
    return record


def write_json(path: Path, value) -> None:
    """A JSON file, atomically."""
    tmp = path.with_name(path.name + TMP)
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


def remove_temporary(folder: Path) -> int:
    """Delete the temporary files an interrupted run left in `folder`; returns how many."""
    stray = [p for p in folder.glob(f"*{TMP}") if p.is_file()] if folder.is_dir() else []
    for p in stray:
        p.unlink(missing_ok=True)
    return len(stray)


def folder_meta(
    records: list[dict], tokenizer: Tokenizer, settings: Settings, sources: list[str], tokenizer_file: str | None
) -> dict:
    """meta.json of a sharded folder whose shards are `records`, in shard order."""
    splits = {}
    for split in SPLITS:
        counts = [r["splits"][split] for r in records]
        splits[split] = {
            "documents": sum(c["documents"] for c in counts),
            "tokens": sum(c["tokens"] for c in counts),
            "text_bytes": sum(c["text_bytes"] for c in counts),
            "max_token_id": max((c["max_token_id"] for c in counts), default=0),
            "shards": [[c["tokens"], c["documents"]] for c in counts],
        }
    return {
        "format": SHARDED,
        "dtype": token_dtype(tokenizer.n_vocab).name,
        "vocab_size": tokenizer.n_vocab,
        "eot_id": tokenizer.eot_id,
        "tokenizer": Path(settings.tokenizer).name if tokenizer_file else settings.tokenizer,
        "tokenizer_path": tokenizer_file,  # the trainer's default tokenizer
        "tokenizer_sha256": settings.tokenizer_sha256 or None,
        "split": settings.split,
        "val_fraction": settings.val_fraction,
        "text_field": settings.text_field,
        "splits": splits,
        "sources": sources,
    }


# ---- a worker process of scripts/prepare_data.py --workers N ----

_worker: dict = {}  # in each worker: its tokenizer, settings, staging folder and the shared counters


def start_worker(tokenizer_path: str, settings: Settings, staging: Path, counters) -> None:
    """A worker ignores Ctrl-C (the main process ends it) and dies at once on SIGTERM (pool.terminate)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker.update(tokenizer=build_tokenizer(tokenizer_path), settings=settings, staging=staging, counters=counters)


def count(counters, input_bytes: int, tokens: int) -> None:
    """Add to the run's shared counters of input bytes and tokens (the progress line reads them)."""
    with counters[0].get_lock():
        counters[0].value += input_bytes
        counters[1].value += tokens


def work(index: int, pieces: list[Piece]) -> dict:
    """Write unit `index` in this worker."""
    w = _worker
    return write_unit(
        index, pieces, w["tokenizer"], w["settings"], w["staging"], lambda b, t: count(w["counters"], b, t)
    )
