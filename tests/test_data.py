"""Data: prepare_data.py output, windows and labels, the shuffled order, exact resume and
resharding of the single-integer loader state, validation batches, and error messages."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from export_utils import script

from elr.data.loader import build_train_loader
from elr.data.order import WindowPermutation
from elr.data.token_files import load_tokens
from elr.data.validation import val_batches
from elr.text.tokenizer import build_tokenizer, file_sha256

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizer" / "elr8k.tiktoken"
TINYPROSE = REPO / "data" / "tinyprose"
CORPUS = REPO / "tests" / "fixtures" / "tiny_corpus"
VAL_FRACTION = "0.3"  # the 11 fixture documents then fill both splits


def prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--tokenizer", str(TOKENIZER), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
    )


def fixture_documents() -> list[str]:
    docs = [p.read_text() for p in sorted(CORPUS.glob("*.txt"))]
    lines = (CORPUS / "paragraphs.jsonl").read_text().splitlines()
    return docs + [json.loads(line)["text"] for line in lines]


def make_token_file(folder: Path, n_tokens: int, name: str = "train") -> Path:
    """A token file whose token at position p is p (mod 2^16): windows are easy to read off."""
    folder.mkdir(parents=True, exist_ok=True)
    np.arange(n_tokens, dtype=np.uint16).tofile(folder / f"{name}.bin")
    meta = {"dtype": "uint16", "splits": {name: {"file": f"{name}.bin", "tokens": n_tokens}}}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder / f"{name}.bin"


def split_tokens(folder: Path, split: str) -> np.ndarray:
    """A sharded folder's split: its shards' tokens one after another."""
    return np.concatenate([np.fromfile(p, dtype=np.uint16) for p in sorted(folder.glob(f"{split}-*.bin"))])


def shard_names(split: str, n: int) -> list[str]:
    return [f"{split}-{i:05d}{suffix}" for i in range(n) for suffix in (".bin", ".starts")]


def take(loader, n: int, it=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(loader) if it is None else it
    return [next(it) for _ in range(n)]


def first_tokens(batches) -> list[int]:
    """Global sample identities: the first input token of each row (= window start here)."""
    return [int(x) for inputs, *_ in batches for x in inputs[:, 0]]


# --- prepare_data.py -----------------------------------------------------------------------------


def test_prepare_data_end_to_end(tmp_path):
    out = tmp_path / "tiny"
    result = prepare("--out", str(out), "--val-fraction", VAL_FRACTION, str(CORPUS))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["meta.json", *shard_names("train", 1), *shard_names("val", 1)]
    )
    meta = json.loads((out / "meta.json").read_text())
    tok = build_tokenizer(str(TOKENIZER))
    assert meta["format"] == "shards" and meta["dtype"] == "uint16" and meta["vocab_size"] == tok.n_vocab
    assert meta["eot_id"] == tok.eot_id and meta["tokenizer"] == TOKENIZER.name
    assert meta["val_fraction"] == float(VAL_FRACTION) and len(meta["sources"]) == 4
    assert meta["split"] == "document"

    # Every document comes back exactly once, in one split, followed by <|endoftext|>.
    decoded = []
    for split in ("train", "val"):
        tokens = split_tokens(out, split)
        assert len(tokens) == meta["splits"][split]["tokens"] > 0 and tokens[-1] == tok.eot_id
        ends = np.flatnonzero(tokens == tok.eot_id)
        starts = np.concatenate([[0], ends[:-1] + 1])
        assert np.fromfile(out / f"{split}-00000.starts", dtype=np.int64).tolist() == starts.tolist()
        docs = [tok.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends)]
        assert len(docs) == meta["splits"][split]["documents"]
        decoded += docs
    assert sorted(decoded) == sorted(fixture_documents())

    # Same inputs, same bytes; the split does not depend on the input order.
    again = tmp_path / "again"
    files = sorted(str(p) for p in CORPUS.iterdir() if p.suffix in (".txt", ".jsonl"))
    reordered = prepare("--out", str(again), "--val-fraction", VAL_FRACTION, *files[::-1])
    assert reordered.returncode == 0, reordered.stderr
    for split in ("train", "val"):
        assert sorted(split_tokens(out, split).tolist()) == sorted(split_tokens(again, split).tolist())


@pytest.mark.slow
def test_prepare_data_errors_leave_no_partial_output(tmp_path):
    out = tmp_path / "out"
    assert prepare("--out", str(out), "--val-fraction", VAL_FRACTION, str(CORPUS)).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    missing = prepare("--out", str(out), "--replace", str(CORPUS), str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 1 and "nope.jsonl: no such file" in missing.stderr
    (tmp_path / "empty.txt").write_text("\n\n")
    empty = prepare("--out", str(out), "--replace", str(CORPUS), str(tmp_path / "empty.txt"))
    assert empty.returncode == 1 and "empty.txt: no non-empty documents" in empty.stderr
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    bad = prepare("--out", str(out), "--replace", str(tmp_path / "bad.jsonl"))
    assert bad.returncode == 1 and "bad.jsonl:2" in bad.stderr
    # Fails only after writing temporary files: none may be left, the old outputs stay.
    no_val = prepare("--out", str(out), "--replace", "--val-fraction", "1e-9", str(CORPUS))
    assert no_val.returncode == 1 and "no document fell into the val split" in no_val.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_prepare_data_never_replaces_a_prepared_dataset_or_a_file_unasked(tmp_path, capsys):
    """--out naming a file, or a folder that holds a prepared dataset, is one line and exit 1 before any
    reading; --replace writes over the dataset."""
    prepare_data = script("prepare_data")
    src = tmp_path / "a.txt"
    src.write_text("one document.\n\nanother document, a little longer than the first.\n" * 20)
    out = tmp_path / "d"
    argv = ["--tokenizer", str(TOKENIZER), "--out", str(out), "--split", "tail", "--val-fraction", "0.2", str(src)]
    assert prepare_data.main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    src.write_text("different text now.\n" * 50)
    assert prepare_data.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a prepared dataset" in err[0] and "--replace" in err[0], err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert prepare_data.main([*argv, "--replace"]) == 0
    assert (out / "train-00000.bin").read_bytes() != before["train-00000.bin"]

    a_file = tmp_path / "file"
    a_file.write_text("")
    assert prepare_data.main(["--tokenizer", str(TOKENIZER), "--out", str(a_file), str(src)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file, not a folder" in err[0], err


def split_parts(folder: Path, split: str, eot_id: int) -> list[list[int]]:
    """The documents (or document parts) of a folder's split, each without its <|endoftext|>."""
    tokens = split_tokens(folder, split)
    assert len(tokens) > 0 and tokens[-1] == eot_id
    ends = np.flatnonzero(tokens == eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[s:e].tolist() for s, e in zip(starts, ends)]


@pytest.mark.slow
def test_files_that_are_not_utf8_are_one_line_naming_the_file(tmp_path, capsys):
    """A config, a text file and a chat file in another encoding (Latin-1 here): one line naming the file,
    nothing written."""
    from elr.config import load_config
    from elr.errors import ConfigError

    latin1 = "café".encode("latin-1")
    (tmp_path / "job.toml").write_bytes(b'[job]\ndescription = "' + latin1 + b'"\n')
    with pytest.raises(ConfigError, match=r"job\.toml is not valid TOML \(.utf-8. codec can.t decode"):
        load_config(tmp_path / "job.toml")
    prepare_data = script("prepare_data")
    (tmp_path / "notes.txt").write_bytes(latin1 + b"\n")
    (tmp_path / "chat.jsonl").write_bytes(b'{"prompt": "' + latin1 + b'", "completion": "x"}\n')
    for name, fmt in (("notes.txt", "text"), ("chat.jsonl", "chat")):
        out = tmp_path / f"out-{fmt}"
        argv = ["--format", fmt, "--tokenizer", str(TOKENIZER), "--out", str(out), str(tmp_path / name)]
        assert prepare_data.main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{name}: not valid UTF-8" in err[0], err
        assert not out.exists() or not any(out.iterdir())


def test_prepare_data_tail_split(tmp_path):
    out = tmp_path / "tail"
    result = prepare("--out", str(out), "--split", "tail", "--val-fraction", VAL_FRACTION, str(CORPUS))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["meta.json", *shard_names("train", 1), *shard_names("val", 1)]
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["split"] == "tail" and meta["val_fraction"] == float(VAL_FRACTION)
    tok = build_tokenizer(str(TOKENIZER))
    texts = fixture_documents()
    encoded = [tok.encode(text) for text in texts]
    n_val = [int(len(ids) * float(VAL_FRACTION)) for ids in encoded]
    assert min(n_val) > 0  # every fixture document is long enough to give val a part

    # Each document's head is in train and its last floor(n * fraction) tokens are in val, each
    # part followed by <|endoftext|>; together they are exactly the document's tokens.
    train = split_parts(out, "train", tok.eot_id)
    val = split_parts(out, "val", tok.eot_id)
    assert sorted(map(tuple, train)) == sorted(tuple(ids[: len(ids) - k]) for ids, k in zip(encoded, n_val))
    assert sorted(map(tuple, val)) == sorted(tuple(ids[len(ids) - k :]) for ids, k in zip(encoded, n_val))
    for part in val:  # a tail decodes to the end of one of the texts
        assert any(text.endswith(tok.decode(part)) for text in texts)
    for split, parts in (("train", train), ("val", val)):
        c = meta["splits"][split]
        assert c["documents"] == len(parts) == len(texts)
        assert c["tokens"] == sum(len(part) + 1 for part in parts)
    assert sum(meta["splits"][s]["tokens"] for s in ("train", "val")) == sum(len(ids) for ids in encoded) + 2 * len(
        texts
    )
    assert sum(meta["splits"][s]["text_bytes"] for s in ("train", "val")) == sum(
        len(text.encode("utf-8")) for text in texts
    )

    # Deterministic: the same run gives the same bytes, and val.bin is the same whatever the
    # input order (train parts follow the input order; the loader shuffles them anyway).
    files = sorted(str(p) for p in CORPUS.iterdir() if p.suffix in (".txt", ".jsonl"))
    for name, inputs in (("again", [str(CORPUS)]), ("reordered", files[::-1])):
        rerun = prepare("--out", str(tmp_path / name), "--split", "tail", "--val-fraction", VAL_FRACTION, *inputs)
        assert rerun.returncode == 0, rerun.stderr
        assert (tmp_path / name / "val-00000.bin").read_bytes() == (out / "val-00000.bin").read_bytes()
    for name in ("train-00000.bin", "meta.json"):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes()
    reordered = split_parts(tmp_path / "reordered", "train", tok.eot_id)
    assert sorted(map(tuple, reordered)) == sorted(map(tuple, train))


def test_tail_cut_keeps_utf8_characters_whole():
    from elr.data import prepare as module

    # Token i stands for the bytes below: "a", "b", the first and the last two bytes of "—", "c".
    pieces = [b"a", b"b", b"\xe2", b"\x80\x94", b"c"]
    cut = lambda ids, fraction: module.tail_cut(ids, fraction, pieces.__getitem__)  # noqa: E731
    assert cut([0, 1, 4, 0], 0.5) == 2  # the last floor(4 * 0.5) = 2 tokens go to val
    assert cut([0, 2, 3, 1], 0.75) == 1  # a cut before "—" is a character boundary
    assert cut([0, 2, 3, 1], 0.5) == 3  # a cut inside "—" moves past it: "—" stays in train
    assert cut([0, 1, 2, 3], 0.25) == 4  # the tail would start inside "—": val gets nothing
    assert cut([0, 1, 2, 3], 0.2) == 4  # floor(4 * 0.2) = 0 tokens
    assert cut([0], 0.99) == 1  # train always keeps at least one token


@pytest.mark.slow
def test_prepare_data_tail_split_errors_leave_no_partial_output(tmp_path):
    out = tmp_path / "out"
    args = ("--out", str(out), "--split", "tail")
    assert prepare(*args, "--val-fraction", VAL_FRACTION, str(CORPUS)).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # Every fixture document has fewer than 10^4 tokens: none gives val a token.
    too_short = prepare(*args, "--replace", "--val-fraction", "1e-4", str(CORPUS))
    assert too_short.returncode == 1 and "no document is long enough" in too_short.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    bogus = prepare("--out", str(out), "--split", "random", str(CORPUS))
    assert bogus.returncode == 2 and "invalid choice: 'random'" in bogus.stderr


def test_bundled_data_matches_its_tokenizer():
    meta = json.loads((TINYPROSE / "meta.json").read_text())
    assert meta["tokenizer_sha256"] == file_sha256(TOKENIZER)
    tokens = load_tokens(TINYPROSE / "train.bin")
    assert len(tokens) == meta["splits"]["train"]["tokens"] and int(tokens.max()) == meta["eot_id"]
    # The first document decodes to text that the bundled tokenizer encodes to the same ids.
    tok = build_tokenizer(str(TOKENIZER))
    first_doc = tokens[: int(np.argmax(tokens == tok.eot_id))].tolist()
    assert tok.encode(tok.decode(first_doc)) == first_doc and len(first_doc) > 1000
    inputs, labels, _ = next(iter(build_train_loader(str(TINYPROSE / "train.bin"), 64, 4, 0, 1, 0)))
    assert inputs.shape == labels.shape == (4, 64) and inputs.dtype == torch.int64


# --- windows and order ---------------------------------------------------------------------------


def test_windows_and_labels_match_the_memmap():
    path = TINYPROSE / "train.bin"
    raw = np.memmap(path, dtype=np.uint16, mode="r")
    seq_len, bs = 32, 3
    loader = build_train_loader(str(path), seq_len, bs, dp_rank=0, dp_world=1, seed=7)
    dataset = loader.dataset
    assert dataset.num_windows == [(len(raw) - 1) // seq_len]
    for step, (inputs, labels, document_ids) in enumerate(take(loader, 4)):
        assert document_ids is None  # data.document_masking off
        for row in range(bs):
            _, w = dataset.locate(step * bs + row)
            window = torch.from_numpy(raw[w * seq_len : w * seq_len + seq_len + 1].astype(np.int64))
            assert torch.equal(inputs[row], window[:-1]) and torch.equal(labels[row], window[1:])


def test_window_count_and_epochs(tmp_path):
    seq_len = 4
    assert build_train_loader(str(make_token_file(tmp_path / "a", 41)), seq_len, 1, 0, 1, 0).dataset.num_windows == [10]
    path = make_token_file(tmp_path / "b", 40)  # the last window would need token 40
    loader = build_train_loader(str(path), seq_len, 1, 0, 1, seed=3)
    assert loader.dataset.num_windows == [9]
    it = iter(loader)
    epochs = [first_tokens(take(loader, 9, it)) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == [w * seq_len for w in range(9)]  # each window once per epoch
    assert epochs[0] != epochs[1] != epochs[2]

    plain = build_train_loader(str(path), seq_len, 2, 0, 1, seed=3, shuffle=False)
    assert first_tokens(take(plain, 6)) == [w * seq_len for w in [*range(9), 0, 1, 2]]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 17, 255, 1000, 4097])
def test_permutation_is_a_bijection(n):
    orders = {
        (seed, epoch): [WindowPermutation(n, seed, epoch)(i) for i in range(n)]
        for seed in (0, 1, 12345)
        for epoch in (0, 1, 2)
    }
    for order in orders.values():
        assert sorted(order) == list(range(n))
    if n >= 7:  # epochs and seeds give different orders
        assert orders[0, 0] != orders[0, 1] != orders[0, 2] and orders[0, 0] != orders[1, 0]


def test_permutation_scales_without_a_table():
    perm = WindowPermutation(10**9 + 7, seed=0, epoch=5)
    values = [perm(i) for i in range(2000)]
    assert len(set(values)) == 2000 and all(0 <= v < 10**9 + 7 for v in values)
    assert max(values) > 10**8  # spread over the whole range, not local
    with pytest.raises(IndexError):
        perm(10**9 + 7)


# --- state: exact resume and resharding ----------------------------------------------------------


def test_state_dict_round_trip(tmp_path):
    path = str(make_token_file(tmp_path, 4 * 23 + 1))  # 23 windows: the run crosses epochs
    loader = build_train_loader(path, 4, 3, 0, 1, seed=11)
    it = iter(loader)
    take(loader, 5, it)
    state = copy.deepcopy(loader.state_dict())
    expected = take(loader, 7, it)
    assert loader.dataset.position == 12 * 3

    fresh = build_train_loader(path, 4, 3, 0, 1, seed=11)
    fresh.load_state_dict(state)
    resumed = take(fresh, 7)
    assert all(torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels) for a, b in zip(expected, resumed))
    assert fresh.dataset.position == loader.dataset.position


def global_stream(path: str, world: int, local_bs: int, steps: int, position: int = 0) -> list[int]:
    """Samples of `steps` global microbatches read by `world` ranks, concatenated rank by rank."""
    loaders = [build_train_loader(path, 4, local_bs, r, world, seed=5) for r in range(world)]
    for loader in loaders:
        loader.dataset.position = position
    per_rank = [first_tokens(take(loader, steps)) for loader in loaders]
    assert len({loader.dataset.position for loader in loaders}) == 1  # identical on every rank
    return [
        x
        for step in range(steps)
        for rank in range(world)
        for x in per_rank[rank][step * local_bs : (step + 1) * local_bs]
    ]


def test_resharding_continues_the_same_stream(tmp_path):
    path = str(make_token_file(tmp_path, 4 * 50 + 1))
    reference = global_stream(path, world=1, local_bs=4, steps=30)  # crosses two epochs
    assert global_stream(path, world=2, local_bs=2, steps=30) == reference
    assert global_stream(path, world=4, local_bs=1, steps=30) == reference

    # 2 ranks for 7 steps, save the position, continue on 1 rank; and the reverse.
    two = [build_train_loader(path, 4, 2, r, 2, seed=5) for r in range(2)]
    for loader in two:
        take(loader, 7)
    state = two[0].state_dict()
    assert state["dataset_state"] == two[1].state_dict()["dataset_state"] == {"position": 28}
    one = build_train_loader(path, 4, 4, 0, 1, seed=5)
    one.load_state_dict(state)
    assert first_tokens(take(one, 23)) == reference[28:]

    position = one.dataset.position  # the single integer a trainer checkpoints
    back = [build_train_loader(path, 4, 2, r, 2, seed=5) for r in range(2)]
    for loader in back:
        loader.dataset.load_state_dict({"position": position})
    tail = global_stream(path, world=2, local_bs=2, steps=5, position=position)
    longer = global_stream(path, world=1, local_bs=4, steps=35)
    assert tail == longer[position:]


def test_bad_position_is_refused(tmp_path):
    path = str(make_token_file(tmp_path, 101))
    loader = build_train_loader(path, 4, 2, 0, 2, seed=0)  # global microbatch of 4
    with pytest.raises(ValueError, match="not a non-negative multiple"):
        loader.dataset.load_state_dict({"position": 6})
    with pytest.raises(ValueError, match="not a non-negative multiple"):
        loader.dataset.position = -4
    state = loader.state_dict()
    state["dataset_state"] = {"position": 2}
    loader.load_state_dict(state)
    with pytest.raises(ValueError, match="position 2"):
        next(iter(loader))


# --- validation ----------------------------------------------------------------------------------


def test_val_batches(tmp_path):
    path = str(make_token_file(tmp_path, 4 * 20 + 1, name="val"))
    one = list(val_batches(path, 4, 4, 3, 0, 1))
    assert first_tokens(one) == [4 * w for w in range(12)]  # the first windows, in order
    assert all(torch.equal(labels, inputs + 1) for inputs, labels, _ in one)
    assert first_tokens(val_batches(path, 4, 4, 3, 0, 1)) == first_tokens(one)  # same each call
    ranks = [list(val_batches(path, 4, 2, 3, r, 2)) for r in range(2)]
    merged = [torch.cat([ranks[0][b][0], ranks[1][b][0]]) for b in range(3)]
    assert all(torch.equal(m, o[0]) for m, o in zip(merged, one))
    with pytest.raises(ValueError, match="need 24 windows .* the split has 20"):
        val_batches(path, 4, 4, 6, 0, 1)


# --- errors --------------------------------------------------------------------------------------


def test_loader_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.bin"):
        build_train_loader(str(tmp_path / "nothere.bin"), 4, 1, 0, 1, 0)
    (tmp_path / "x").mkdir()
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "x" / "train.bin")
    with pytest.raises(FileNotFoundError, match="meta.json"):
        build_train_loader(str(tmp_path / "x" / "train.bin"), 4, 1, 0, 1, 0)
    (tmp_path / "x" / "meta.json").write_text(json.dumps({"dtype": "float32"}))
    with pytest.raises(ValueError, match="dtype 'float32'"):
        build_train_loader(str(tmp_path / "x" / "train.bin"), 4, 1, 0, 1, 0)
    path = make_token_file(tmp_path / "small", 8)
    with pytest.raises(ValueError, match="small/train.bin: 8 tokens are too few"):
        build_train_loader(str(path), 8, 1, 0, 1, 0)
    (tmp_path / "small" / "train.bin").write_bytes(b"\x00" * 30)  # disagrees with meta.json
    with pytest.raises(ValueError, match="holds 15 tokens but"):
        build_train_loader(str(path), 4, 1, 0, 1, 0)
    with pytest.raises(ValueError, match="dp_rank 2"):
        build_train_loader(str(make_token_file(tmp_path / "ok", 50)), 4, 1, 2, 2, 0)


def test_token_ids_past_the_vocabulary_and_a_wrong_dtype_fail_when_the_data_is_opened(tmp_path, monkeypatch):
    """Caught by a max over the file (cached per file content, outside the data folder), not by an
    IndexError (a device assert on GPU) in the embedding at the first batch that holds one."""
    monkeypatch.setenv("ELR_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "d"
    folder.mkdir()
    np.array([1, 2, 99, 3] * 8, dtype=np.uint16).tofile(folder / "train.bin")
    meta = {"dtype": "uint16", "vocab_size": 64, "splits": {"train": {"file": "train.bin", "tokens": 32}}}
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="train.bin: holds token id 99, but .* gives vocab_size 64"):
        load_tokens(folder / "train.bin")
    assert list(json.loads((tmp_path / "cache" / "token_max.json").read_text()).values()) == [99]  # cached
    before = (folder / "meta.json").read_text()
    with pytest.raises(ValueError, match="holds token id 99"):
        load_tokens(folder / "train.bin")  # from the cache
    assert (folder / "meta.json").read_text() == before  # the data folder is never written

    # the hole a meta.json-held maximum left: the file edited in place at the same size, meta.json saying 3
    good = {**meta, "splits": {"train": {"file": "train.bin", "tokens": 32, "max_token_id": 3}}}
    np.array([1, 2, 3, 3] * 8, dtype=np.uint16).tofile(folder / "train.bin")
    (folder / "meta.json").write_text(json.dumps(good))
    assert int(load_tokens(folder / "train.bin").max()) == 3
    bad = np.array([1, 2, 3, 3] * 8, dtype=np.uint16)
    bad[17] = 4000
    bad.tofile(folder / "train.bin")
    os.utime(folder / "train.bin", ns=(1, 1))  # any other modification time than the one cached
    with pytest.raises(ValueError, match="holds token id 4000"):
        load_tokens(folder / "train.bin")

    np.array([1, 2, 3, 4] * 8, dtype=np.uint16).tofile(folder / "train.bin")  # uint16 data, meta says uint32
    (folder / "meta.json").write_text(json.dumps({**meta, "dtype": "uint32", "splits": {}}))
    with pytest.raises(ValueError, match=r"holds token id \d+, .*not written as uint32"):
        load_tokens(folder / "train.bin")
    (folder / "meta.json").write_text(json.dumps({**meta, "splits": {}}))
    assert int(load_tokens(folder / "train.bin").max()) == 4

    (folder / "meta.json").write_text('{"dtype": "uint16",')  # cut short
    with pytest.raises(ValueError, match="meta.json is not readable JSON"):
        load_tokens(folder / "train.bin")


def test_train_py_ends_a_malformed_meta_json_in_one_line(tmp_path, caplog):
    data = tmp_path / "data"
    shutil.copytree(TINYPROSE, data)
    (data / "meta.json").write_text("{not json")
    spec = importlib.util.spec_from_file_location("train_script", REPO / "train.py")
    train_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_script)
    with caplog.at_level(logging.ERROR):
        assert train_script.main(["--data.path", str(data), "--job.dump_folder", str(tmp_path / "run")]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "meta.json is not readable JSON" in errors[0], errors


def test_own_data_one_text_file_prepares_and_trains_with_the_defaults(tmp_path, monkeypatch):
    """One .txt file: --split auto takes the tail split (a document split would leave val empty);
    the trainer then finds the tokenizer through meta.json, no tokenizer.path needed."""
    from elr.config import load_config
    from elr.train.trainer import Trainer

    spec = importlib.util.spec_from_file_location("prepare_data_script", REPO / "scripts" / "prepare_data.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    spec.loader.exec_module(script)
    text = tmp_path / "book.txt"
    text.write_text((TINYPROSE.parent.parent / "README.md").read_text() * 3)
    out = tmp_path / "mydata"
    monkeypatch.chdir(tmp_path)  # the bundled tokenizer is the default from any directory
    assert script.main(["--out", str(out), str(text)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["split"] == "tail" and meta["splits"]["val"]["tokens"] > 0
    assert Path(meta["tokenizer_path"]) == TOKENIZER
    cfg = load_config(
        REPO / "train_configs" / "debug.toml",
        [
            "--data.path",
            str(out),
            "--training.steps",
            "1",
            "--training.seq_len",
            "16",
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "2",
            "--validation.steps",
            "1",
            "--metrics.enable_tensorboard",
            "false",
            "--job.dump_folder",
            str(tmp_path / "run"),
        ],
    )
    trainer = Trainer(cfg)
    trainer.close()
    assert Path(trainer.cfg.tokenizer.path) == TOKENIZER  # recorded in config.json


def test_a_document_split_that_leaves_val_empty_names_split_tail(tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "a single document"}) + "\n")
    result = prepare("--out", str(tmp_path / "out"), str(one))
    assert result.returncode == 1 and "--split tail" in result.stderr, result.stderr
