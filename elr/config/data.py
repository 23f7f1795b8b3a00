"""The [data] section: one token store (`path`), or a weighted mixture of them (`[[data.sources]]`), or a
generated task; whether windows carry document ids. Its keys' meanings are the strings under the fields, as in
job.py; the stores themselves are read by elr/data (docs/data.md)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from elr.config.keys import check_fields, check_sha256, require
from elr.errors import ConfigError

SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass
class DataSource:
    """One `[[data.sources]]` table: a named token store and its share of the training samples. On the command
    line a comma-separated list of `name:weight:path` (or `name:weight:path:val_path`) items."""

    name: str = ""
    """names the source in the metrics (`val/loss_k{k}/{name}`, `data/epochs/{name}`) and across a stage's change
    of mixture: letters, digits, `.`, `_`, `-`"""
    path: str = ""
    """a prepared folder (its train split), a Megatron indexed dataset (prefix or folder of prefixes) or a
    datatrove tokenized folder"""
    weight: float = 1.0
    """its share of the samples: weight / the sum of the weights, exact over every block of samples"""
    val_path: str = ""
    """its validation data (any kind of store); empty: the val split of `path` when that is a prepared folder,
    else the source is not validated"""

    @staticmethod
    def from_text(key: str, text: str) -> dict:
        """`name:weight:path[:val_path]`, the command line's spelling, as a table."""
        parts = text.strip().split(":")
        if len(parts) not in (3, 4):
            raise ConfigError(f"{key}: expected name:weight:path or name:weight:path:val_path, got {text!r}")
        try:
            weight = float(parts[1])
        except ValueError:
            raise ConfigError(f"{key}: the weight of {parts[0]!r} is not a number ({parts[1]!r})") from None
        return dict(zip(("name", "weight", "path", "val_path"), (parts[0], weight, *parts[2:])))


@dataclass
class Data:
    """[data]: each key's meaning is the string under its field."""

    path: str = "data/tinyprose"
    """the token store: a folder from scripts/prepare_data.py (sharded, or the older train.bin / val.bin), a
    Megatron indexed dataset (prefix or folder of prefixes) or a datatrove tokenized folder (those two: no
    validation split); a chat folder (`--format chat`, elr/text/chat_data.py) serves one conversation per row,
    its assistant tokens scored. Not read when `sources` is set"""
    sources: list[DataSource] = field(default_factory=list)
    """a weighted mixture instead of `path`: `[[data.sources]]` tables of name, path, weight and val_path
    (docs/data.md); sample g of the stream maps to a source and a sample within it, the shares exact in every
    block of samples; validation reports each source's loss beside the mixture's; a resume may change them (each
    source continues where it stopped)"""
    shuffle: bool = True
    """permute windows each epoch (O(1)-memory bijection seeded by seed and epoch)"""
    document_masking: bool = False
    """each batch carries per-row document ids from the stores' document starts, so attention, the GDP state and
    RoPE positions restart at every document start inside a window (documents never see each other); needs
    stores that record their starts (prepared folders, Megatron, datatrove; an older single-file folder after
    `prepare_data.py --record-documents`)"""
    task: Literal["", "pointer_chase", "var_chain"] = ""
    """a depth-bound task generated on the fly instead of token files: `pointer_chase` or `var_chain` (its own
    vocabulary, loss on the answer only, validation accuracy per difficulty at every k; data parallelism only)"""
    task_items: int = 8
    """pairs (pointer_chase) or statements (var_chain) in each example's context"""
    task_max_difficulty: int = 6
    """hops (pointer_chase) or binding depth (var_chain) drawn from 1..this"""
    task_curriculum_steps: int = 0
    """updates over which the hardest difficulty drawn grows from 1 to the maximum in equal stages; 0: all from
    the start"""
    meta_sha256: str = ""
    """the SHA-256 of `path`'s meta.json (with `sources`: of their prepared folders' meta.json files, in order;
    64 hex digits), checked when set; empty: the trainer records it here in config.json, so a resume refuses data
    that was prepared again since the run began"""

    def check(self) -> None:
        check_fields(self, "data")
        check_sha256("data.meta_sha256", self.meta_sha256)
        names = [s.name for s in self.sources]
        for i, s in enumerate(self.sources):
            key = f"data.sources[{i}]"
            require(
                bool(SOURCE_NAME.fullmatch(s.name)), f"{key}.name", "must be letters, digits, '.', '_', '-'", s.name
            )
            require(names.count(s.name) == 1, f"{key}.name", "names another source too", s.name)
            require(s.path != "", f"{key}.path", "must name the source's store", s.path)
            require(math.isfinite(s.weight) and s.weight > 0, f"{key}.weight", "must be > 0", s.weight)
        if self.task:
            require(not self.sources, "data.sources", "and data.task are two kinds of data: set one", len(names))
            require(not self.document_masking, "data.document_masking", "a task's row is one example", True)
            require(self.task_items >= 2, "data.task_items", "must be >= 2", self.task_items)
            require(1 <= self.task_max_difficulty, "data.task_max_difficulty", "must be >= 1", self.task_max_difficulty)
            require(
                self.task_curriculum_steps >= 0,
                "data.task_curriculum_steps",
                "must be >= 0 (0 = off)",
                self.task_curriculum_steps,
            )
