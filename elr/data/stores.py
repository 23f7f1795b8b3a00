"""Opening a token store by what its path holds: a prepared folder (meta.json; sharded or the older single
file), a Megatron indexed dataset (.bin + .idx) or a datatrove tokenized folder (.ds + .ds.index)."""

from __future__ import annotations

from pathlib import Path

from elr.data import datatrove, folders, megatron
from elr.data.sources import Source
from elr.errors import DataError


def open_store(path: str | Path, split: str = "train", name: str | None = None) -> Source:
    """The store at `path` as a Source named `name` (default: the path's last part): a prepared folder's
    `split`, a Megatron prefix or folder of prefixes, or a datatrove folder (those two hold one split each:
    `split` is not read). One FileNotFoundError or DataError naming the path when it is none of these."""
    path = Path(path)
    name = name or path.name
    if (path / folders.META).is_file():
        return folders.open_folder(path, split, name)
    if megatron.is_megatron(path):
        return megatron.open_megatron(path, name)
    if datatrove.is_datatrove(path):
        return datatrove.open_datatrove(path, name)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such data folder or prefix (make one with scripts/prepare_data.py)")
    if path.is_dir() and any(path.glob("*.bin")):
        raise FileNotFoundError(f"{path / folders.META} is missing: it gives the dtype of the .bin files beside it")
    raise DataError(
        f"{path}: not a prepared data folder (meta.json), a Megatron indexed dataset (.bin + .idx) or a "
        "datatrove tokenized folder (.ds + .ds.index)"
    )


def has_split(path: str | Path, split: str) -> bool:
    """Whether the store at `path` holds `split`: a prepared folder its splits; the other formats hold one
    stream, read as the training split."""
    path = Path(path)
    if (path / folders.META).is_file():
        return split in folders.read_meta(path).get("splits", {})
    return split == "train"


def store_and_split(path: str | Path) -> tuple[Path, str]:
    """A store and the split a path names: `folder/train.bin` (an older folder's file, as the loaders took it)
    is the folder's train split, `prefix.bin` beside `prefix.idx` a Megatron prefix; any other path is a
    store, read as its train split."""
    path = Path(path)
    if path.suffix == ".bin":
        if path.with_suffix(".idx").is_file():  # a Megatron .bin named with its suffix: its prefix
            return path.with_suffix(""), "train"
        return path.parent, path.stem
    return path, "train"


def is_foreign(path: str | Path) -> bool:
    """Whether `path` is a store another engine wrote (Megatron, datatrove): no meta.json, no tokenizer record."""
    path = Path(path)
    return not (path / folders.META).is_file() and (megatron.is_megatron(path) or datatrove.is_datatrove(path))
