"""The job's data as its config names it: the sources (`data.sources`, or the one `data.path`), the tokenizer
their prepared folders record, and the checks before any work that the data is what the job and its
tokenizer expect (the vocabulary, the tokenizer's hash, the folders' meta.json hash across a resume)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from elr.config import JobConfig
from elr.config.data import Data, DataSource
from elr.data.stores import is_foreign, store_and_split
from elr.data.token_files import check_tokenizer, read_meta
from elr.errors import ConfigError
from elr.text.tokenizer import Tokenizer

REPOSITORY = Path(__file__).resolve().parents[2]


def job_sources(data: Data) -> list[DataSource]:
    """The job's sources: `data.sources`, or the one store `data.path` names (weight 1, named by its folder)."""
    return data.sources or [DataSource(name=Path(data.path).name or "data", path=data.path, weight=1.0)]


def prepared_folders(data: Data) -> list[Path]:
    """The folders with a meta.json among the job's training stores (and their val_paths), in order, once
    each: the ones that record a tokenizer. With `data.path` alone, that folder unless another engine wrote
    it (a folder that does not exist is kept: reading its meta.json says so)."""
    if not data.sources:
        store = store_and_split(data.path)[0]
        return [] if is_foreign(store) else [store]
    folders = []
    for spec in data.sources:
        for path in (spec.path, spec.val_path):
            store = store_and_split(path)[0] if path else None
            if store is not None and (store / "meta.json").is_file() and store not in folders:
                folders.append(store)
    return folders


def job_tokenizer_path(cfg: JobConfig) -> str:
    """tokenizer.path, or when empty the tokenizer the data's (first) meta.json records: its `tokenizer_path`
    if that file exists, else its file name beside the data, in a `tokenizer/` folder next to the
    data folder, or in the repository's data/tokenizer/; else the recorded name (a tiktoken encoding)."""
    if cfg.tokenizer.path:
        return cfg.tokenizer.path
    folders = prepared_folders(cfg.data)
    if not folders:
        raise ConfigError(
            "tokenizer.path: empty, and no source is a prepared folder (Megatron and datatrove stores record no "
            "tokenizer this trainer reads); set tokenizer.path to the tokenizer the data was made with"
        )
    data_dir = folders[0]
    meta = read_meta(data_dir)
    name = meta.get("tokenizer")
    if not name:
        raise ConfigError(
            f"tokenizer.path: empty, and {data_dir / 'meta.json'} records no tokenizer; set tokenizer.path"
        )
    for candidate in (
        meta.get("tokenizer_path"),
        data_dir / name,
        data_dir.parent / "tokenizer" / name,
        REPOSITORY / "data" / "tokenizer" / name,
    ):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return name


def check_job_data(cfg: JobConfig, tokenizer: Tokenizer) -> None:
    """Every prepared folder of the job was tokenized by this tokenizer (elr/data/token_files.py), and their
    meta.json files are the ones the job names (`check_data_unchanged`)."""
    for folder in prepared_folders(cfg.data):
        check_tokenizer(folder, tokenizer, cfg)
    check_data_unchanged(cfg)


def data_sha256(data: Data) -> str:
    """The SHA-256 of the job's prepared folders' meta.json files, one after another ("" with none): with
    `data.path`, that folder's meta.json's own hash."""
    folders = prepared_folders(data)
    if not folders:
        return ""
    digest = hashlib.sha256()
    for folder in folders:
        digest.update((folder / "meta.json").read_bytes())
    return digest.hexdigest()


def check_data_unchanged(cfg: JobConfig) -> None:
    """The data is what the job names: its meta.json files (which prepare_data.py rewrites with the sources,
    counts and sizes of every preparation) have the SHA-256 `data.meta_sha256` gives; an empty key is filled
    in, so config.json and every checkpoint carry it and a resume compares (elr/train/resume.py)."""
    have = data_sha256(cfg.data)
    want = cfg.data.meta_sha256
    if want and want != have:
        where = cfg.data.path if not cfg.data.sources else "the sources"
        raise ConfigError(
            f"data.meta_sha256: {where}'s meta.json has SHA-256 {have}, not the {want} this job "
            "names: another preparation of the data"
        )
    cfg.data.meta_sha256 = have
