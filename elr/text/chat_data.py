"""Conversation data on disk: JSONL in (the shapes of elr/text/chat_formats.py), token / scored-flag /
offset files out, padded rows back.

A prepared chat folder (scripts/prepare_data.py --format chat) holds, per split (train, val):

    {split}.bin          every conversation's token ids (elr/text/chat.py's template), one after another
    {split}.mask.bin     uint8, 1 where the token is scored (a trained assistant turn and its <|endoftext|>)
    {split}.offsets.bin  int64, the N + 1 starts of the N conversations in {split}.bin
    meta.json            "format": "chat", counts, the longest conversation and where it came from

Packing rule (our choice, the simplest honest one): one conversation per training row. A row is a
conversation's tokens, padded after its end with <|endoftext|> to seq_len + 1; labels of padding are
the ignore index. Causal attention never looks right, so no token sees padding or another
conversation, and GDP's state starts fresh in every row: no document mask is needed. A conversation
longer than seq_len + 1 tokens is refused (named by file and line), never cut.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from elr.errors import DataError
from elr.text.chat import check_messages, encode_conversation
from elr.text.chat_formats import read_record
from elr.text.json_text import parse_json
from elr.text.tokenizer import Tokenizer, file_sha256

if TYPE_CHECKING:
    import torch

FORMAT = "chat"
IGNORE_INDEX = -100  # the loss's ignore index (elr/train/loss.py)
SPLITS = ("train", "val")
FILES = {"tokens": ".bin", "mask": ".mask.bin", "offsets": ".offsets.bin"}


def read_conversations(path: Path) -> Iterator[tuple[list[dict], list[bool], str]]:
    """(messages, per message whether it trains, "file:line") for each non-blank line of a JSONL file, in
    any shape elr/text/chat_formats.py reads; one DataError per bad line."""
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                messages, trained = read_record(parse_json(line, where), where)
                yield check_messages(messages, where), trained, where
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e})") from None


def is_val(messages: list[dict], val_fraction: float) -> bool:
    """A stable coin per conversation: a hash of its JSON below val_fraction (same on every machine)."""
    digest = hashlib.blake2b(json.dumps(messages, sort_keys=True).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


def prepare_chat(
    files: list[Path],
    tokenizer: Tokenizer,
    tokenizer_path: str,
    out_dir: str | Path,
    val_fraction: float,
    max_tokens: int = 0,
) -> dict:
    """Tokenize the conversations of `files` into `out_dir` (atomically: every file is written under
    a temporary name and renamed once all are complete); returns meta.json. max_tokens > 0 refuses a
    conversation longer than that (the training seq_len + 1), naming its file and line."""
    out = Path(out_dir)
    dtype = np.dtype(np.uint16 if tokenizer.n_vocab <= 2**16 else np.uint32)
    parts = {s: {"tokens": [], "mask": [], "lengths": []} for s in SPLITS}
    counts = {s: {"conversations": 0, "tokens": 0, "scored_tokens": 0, "longest": 0, "longest_at": ""} for s in SPLITS}
    for path in files:
        for messages, trained, where in read_conversations(path):
            ids, scored = encode_conversation(messages, tokenizer, trained=trained)
            if max_tokens and len(ids) > max_tokens:
                raise DataError(
                    f"{where}: the conversation is {len(ids)} tokens, more than --max-tokens "
                    f"{max_tokens} (conversations are never cut; shorten it or raise the limit)"
                )
            split = "val" if is_val(messages, val_fraction) else "train"
            p, c = parts[split], counts[split]
            p["tokens"].append(np.asarray(ids, dtype=dtype))
            p["mask"].append(np.asarray(scored, dtype=np.uint8))
            p["lengths"].append(len(ids))
            c["conversations"] += 1
            c["tokens"] += len(ids)
            c["scored_tokens"] += sum(scored)
            if len(ids) > c["longest"]:
                c["longest"], c["longest_at"] = len(ids), where
    for split in SPLITS:
        if not counts[split]["conversations"]:
            total = sum(c["conversations"] for c in counts.values())
            raise DataError(
                f"no conversation fell into the {split} split ({total} conversations, val fraction "
                f"{val_fraction}); add conversations or change --val-fraction"
            )
    tok_file = Path(tokenizer_path)
    meta = {
        "format": FORMAT,
        "dtype": dtype.name,
        "vocab_size": tokenizer.n_vocab,
        "eot_id": tokenizer.eot_id,
        "tokenizer": tok_file.name if tok_file.is_file() else tokenizer_path,
        "tokenizer_sha256": file_sha256(tok_file) if tok_file.is_file() else None,
        "val_fraction": val_fraction,
        "splits": {
            s: {"file": f"{s}.bin", **counts[s], "max_token_id": int(max(t.max() for t in parts[s]["tokens"]))}
            for s in SPLITS
        },
        "sources": [str(p) for p in files],
    }
    arrays = {}
    for s in SPLITS:
        p = parts[s]
        arrays[s + FILES["tokens"]] = np.concatenate(p["tokens"])
        arrays[s + FILES["mask"]] = np.concatenate(p["mask"])
        arrays[s + FILES["offsets"]] = np.concatenate([[0], np.cumsum(p["lengths"])]).astype(np.int64)
    out.mkdir(parents=True, exist_ok=True)
    tmp = {name: out / f".{name}.{os.getpid()}.tmp" for name in [*arrays, "meta.json"]}
    try:
        for name, array in arrays.items():
            array.tofile(tmp[name])
        tmp["meta.json"].write_text(json.dumps(meta, indent=2) + "\n")
        (out / "meta.json").unlink(missing_ok=True)  # no stale meta.json beside half-renamed files
        for name in arrays:
            os.replace(tmp[name], out / name)
        os.replace(tmp["meta.json"], out / "meta.json")
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    return meta


def is_chat_folder(data_dir: str | Path) -> bool:
    """Whether a prepared data folder holds conversations (its meta.json says "format": "chat")."""
    meta = Path(data_dir) / "meta.json"
    try:
        return meta.is_file() and json.loads(meta.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False  # the token loader reports an unreadable meta.json


class ChatSplit:
    """One split of a prepared chat folder: conversation i's ids and scored flags, and padded rows."""

    def __init__(self, data_dir: str | Path, split: str):
        self.dir, self.split = Path(data_dir), split
        meta = json.loads((self.dir / "meta.json").read_text())
        info = meta.get("splits", {}).get(split)
        if meta.get("format") != FORMAT or info is None or meta.get("dtype") not in ("uint16", "uint32"):
            raise DataError(
                f"{self.dir}/meta.json: not a chat folder with a {split} split "
                "(make it with scripts/prepare_data.py --format chat)"
            )
        self.info, self.pad_id = info, int(meta["eot_id"])
        try:
            self.tokens = np.memmap(self.dir / f"{split}{FILES['tokens']}", dtype=meta["dtype"], mode="r")
            self.mask = np.memmap(self.dir / f"{split}{FILES['mask']}", dtype=np.uint8, mode="r")
            self.offsets = np.fromfile(self.dir / f"{split}{FILES['offsets']}", dtype=np.int64)
        except (OSError, ValueError) as e:
            raise DataError(f"{self.dir}: the {split} split's files are missing or empty ({e})") from None
        n = len(self.offsets) - 1
        if (
            n != info["conversations"]
            or len(self.tokens) != info["tokens"]
            or len(self.mask) != len(self.tokens)
            or self.offsets[0] != 0
            or self.offsets[-1] != len(self.tokens)
        ):
            raise DataError(f"{self.dir}: the {split} split's files disagree with meta.json (rewrite the folder)")
        if info["max_token_id"] >= meta["vocab_size"]:
            raise DataError(f"{self.dir}: token id {info['max_token_id']} >= vocab_size {meta['vocab_size']}")
        self.num_conversations = n

    def check_fits(self, seq_len: int) -> None:
        """Every conversation fits one row of seq_len + 1 tokens, or one DataError naming the longest."""
        if self.info["longest"] > seq_len + 1:
            raise DataError(
                f"data.path: {self.dir}'s {self.split} split holds a conversation of "
                f"{self.info['longest']} tokens ({self.info['longest_at']}), longer than training.seq_len "
                f"+ 1 = {seq_len + 1}; raise training.seq_len (conversations are never cut)"
            )

    def rows(self, conversations: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) [len(conversations), seq_len] int64: one conversation per row, padded."""
        import torch  # here, not above: preparing data (and its --help) needs no torch

        inputs = np.full((len(conversations), seq_len + 1), self.pad_id, dtype=np.int64)
        labels = np.full((len(conversations), seq_len + 1), IGNORE_INDEX, dtype=np.int64)
        for row, i in enumerate(conversations):
            start, end = int(self.offsets[i]), int(self.offsets[i + 1])
            ids = self.tokens[start:end].astype(np.int64)
            inputs[row, : end - start] = ids
            labels[row, : end - start] = np.where(self.mask[start:end] == 1, ids, IGNORE_INDEX)
        return torch.from_numpy(inputs[:, :-1].copy()), torch.from_numpy(labels[:, 1:].copy())
