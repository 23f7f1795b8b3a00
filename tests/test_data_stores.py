"""Token stores (elr/data): Megatron indexed datasets and datatrove output read directly (files laid out here by
hand, and, with the `formats` extra, written by those packages), the arithmetic of an index of 10^13 tokens,
thousands of shards opened lazily and a few at a time, and document ids from the stores' document starts."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_utils import ROOT

from elr.config.data import DataSource
from elr.data import folders
from elr.data.documents import document_ids
from elr.data.folders import record_document_starts
from elr.data.loader import MixtureDataset, build_mixture_loader, build_train_loader
from elr.data.megatron import HEADER, MAGIC
from elr.data.mixture import Mixture
from elr.data.sources import OPEN_SHARDS, Shard, Source
from elr.data.stores import open_store, store_and_split
from elr.errors import ConfigError, DataError

EOT = 9


# ---- Megatron: the .bin + .idx layout, by hand and by megatron-core --------------------------------------


def write_megatron(prefix: Path, documents: list[list[list[int]]], dtype=np.int32, code: int = 4) -> None:
    """A Megatron indexed dataset as megatron/core/datasets/indexed_dataset.py lays it out: each document a list
    of sequences (sentences), each a list of token ids."""
    sequences = [s for doc in documents for s in doc]
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1]) * np.dtype(dtype).itemsize]).astype(np.int64)
    indices = np.concatenate([[0], np.cumsum([len(doc) for doc in documents])]).astype(np.int64)
    np.concatenate([np.asarray(s, dtype=dtype) for s in sequences]).tofile(prefix.with_name(prefix.name + ".bin"))
    with open(prefix.with_name(prefix.name + ".idx"), "wb") as f:
        f.write(HEADER.pack(MAGIC, 1, code, len(sequences), len(indices)))
        f.write(lengths.tobytes() + pointers.tobytes() + indices.tobytes())


def test_a_megatron_dataset_reads_its_tokens_and_document_starts(tmp_path):
    """Two prefixes in a folder read as one stream: a document of two sentences, an empty one, a shard edge."""
    folder = tmp_path / "mg"
    folder.mkdir()
    write_megatron(folder / "part_a", [[[1, 2, 3]], [[4, 5], [6]], [], [[7, 8]]])
    write_megatron(folder / "part_b", [[[10, 11, 12, 13]], [[14]]], dtype=np.uint16, code=8)
    source = open_store(folder, name="web")
    assert source.num_tokens == 13 and [s.num_tokens for s in source.shards] == [8, 5]
    assert source.tokens(0, 13).tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14]
    assert source.tokens(6, 10).tolist() == [7, 8, 10, 11]  # across the two files
    assert source.document_starts(0, 13).tolist() == [0, 3, 6, 8, 12]
    assert source.document_starts(4, 9).tolist() == [6, 8]
    one = open_store(folder / "part_a")  # a prefix names one dataset
    assert one.num_tokens == 8 and one.document_starts(1, 8).tolist() == [3, 6]
    assert open_store(*store_and_split(folder / "part_b.bin")).num_tokens == 5  # named with its .bin, as in blends
    (folder / "part_b.idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<QB", 2, 4) + bytes(16))
    with pytest.raises(DataError, match="part_b.idx: not a Megatron indexed dataset index"):
        open_store(folder)


@pytest.mark.slow  # importing megatron-core takes about 10 s
def test_megatron_cores_own_builder_writes_what_the_reader_reads(tmp_path):
    """The `formats` extra: megatron-core's IndexedDatasetBuilder writes the files, its IndexedDataset and this
    reader agree token for token and on every document start."""
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    rng = np.random.default_rng(0)
    documents = [
        [rng.integers(0, 50000, n).tolist() for n in rng.integers(1, 40, rng.integers(1, 4))] for _ in range(30)
    ]
    prefix = str(tmp_path / "text_document")
    builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in documents:
        builder.add_document(torch.tensor([t for s in doc for t in s]), [len(s) for s in doc])
    builder.finalize(prefix + ".idx")
    theirs = indexed.IndexedDataset(prefix)
    source = open_store(prefix)
    assert source.tokens(0, source.num_tokens).tolist() == [t for i in range(len(theirs)) for t in theirs[i].tolist()]
    lengths = [sum(len(s) for s in doc) for doc in documents]
    assert source.document_starts(0, source.num_tokens).tolist() == np.cumsum([0, *lengths[:-1]]).tolist()


# ---- datatrove: .ds + .ds.index + .ds.metadata, by hand and by datatrove ---------------------------------


def write_datatrove(path: Path, documents: list[list[int]], width: int = 2) -> None:
    """One datatrove tokenized file: tokens, the documents' ends, the metadata line with the token width."""
    np.concatenate([np.asarray(d, dtype=f"<u{width}") for d in documents]).tofile(path)
    np.cumsum([len(d) for d in documents]).astype("<u8").tofile(path.with_name(path.name + ".index"))
    total = sum(len(d) for d in documents)
    path.with_name(path.name + ".metadata").write_text(f"tokenizer.json|{width}\n{total}\n{total} T")


def test_a_datatrove_folder_reads_its_tokens_and_document_starts(tmp_path):
    folder = tmp_path / "dt"
    folder.mkdir()
    write_datatrove(folder / "00000_unshuffled.ds", [[1, 2, EOT], [3, EOT]])
    write_datatrove(folder / "00001_unshuffled.ds", [[70000, 5, 6, EOT]], width=4)
    source = open_store(folder)
    assert source.tokens(0, source.num_tokens).tolist() == [1, 2, EOT, 3, EOT, 70000, 5, 6, EOT]
    assert source.document_starts(0, 9).tolist() == [0, 3, 5] and source.document_starts(1, 5).tolist() == [3]
    (folder / "00001_unshuffled.ds.metadata").write_text("tokenizer.json|3\n4\n")
    with pytest.raises(DataError, match="3 bytes per token"):
        open_store(folder)


def test_datatroves_own_tokenizer_step_writes_what_the_reader_reads(tmp_path):
    """The `formats` extra: datatrove's DocumentTokenizer, run by its local executor on a JSONL folder with a
    tokenizer.json trained here, writes a folder this reader serves as those documents, each closed by its
    end-of-text token."""
    pytest.importorskip("datatrove")
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("orjson")
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    texts = [json.loads(line)["text"] for line in (ROOT / "tests/fixtures/tiny_corpus/paragraphs.jsonl").open()]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    step = DocumentTokenizer(
        output_folder=str(tmp_path / "out"),
        tokenizer_name_or_path=str(tmp_path / "tokenizer.json"),
        eos_token="<|endoftext|>",
        shuffle_documents=False,
    )
    LocalPipelineExecutor([JsonlReader(str(tmp_path / "in")), step], tasks=1, logging_dir=str(tmp_path / "logs")).run()
    source = open_store(tmp_path / "out")
    eos = tok.token_to_id("<|endoftext|>")
    expected = [tok.encode(t).ids + [eos] for t in texts]
    assert source.tokens(0, source.num_tokens).tolist() == [t for doc in expected for t in doc]
    assert source.document_starts(0, source.num_tokens).tolist() == np.cumsum([0, *map(len, expected[:-1])]).tolist()


# ---- the index arithmetic, lazily opened shards ----------------------------------------------------------


class VirtualShard:
    """A shard whose token at stream position p is p mod 65521 and whose documents start every 1,000 tokens:
    answers for any position without a file."""

    def __init__(self, offset: int, opened: list):
        self.offset = offset
        opened.append(offset)

    def tokens(self, a: int, b: int) -> np.ndarray:
        return ((self.offset + np.arange(a, b, dtype=np.int64)) % 65521).astype(np.uint16)

    def document_starts(self, a: int, b: int) -> np.ndarray:
        first = -(-(self.offset + a) // 1000) * 1000
        return np.arange(first, self.offset + b, 1000, dtype=np.int64) - self.offset


def test_an_index_of_ten_trillion_tokens_is_exact_in_int64():
    """10^4 shards of 10^9 tokens: opening touches none; positions, windows and the mixture's sample numbers near
    the end of 10^13 tokens come out exact (a float anywhere would be off by thousands)."""
    opened: list[int] = []
    n, size = 10_000, 10**9
    shards = [Shard(f"shard-{i}", size, lambda off=i * size: VirtualShard(off, opened)) for i in range(n)]
    source = Source("huge", shards, has_documents=True)
    assert source.num_tokens == 10**13 and opened == []
    assert source.locate(10**13 - 1) == (n - 1, size - 1) and source.locate(5 * size) == (5, 0)
    near_end = 10**13 - 7
    assert source.tokens(near_end, 10**13).tolist() == [p % 65521 for p in range(near_end, 10**13)]
    edge = 7 * size - 3  # a range across a shard boundary
    assert source.tokens(edge, edge + 6).tolist() == [p % 65521 for p in range(edge, edge + 6)]
    assert source.document_starts(edge - 2000, edge + 2000).tolist() == [7 * size + d for d in (-2000, -1000, 0, 1000)]

    seq_len = 8192
    opened.clear()
    dataset = MixtureDataset([source], [1.0], seq_len, 2, 0, 1, [0], shuffle=False, document_masking=True)
    windows = dataset.num_windows[0]
    assert windows == (10**13 - 1) // seq_len
    dataset.position = windows - 2  # the last two windows of the first epoch
    batch = next(iter(dataset))
    for row, w in enumerate((windows - 2, windows - 1)):
        first = w * seq_len
        assert batch.inputs[row].tolist() == [p % 65521 for p in range(first, first + seq_len)]
        starts_after_first = [p // 1000 - first // 1000 for p in range(first, first + seq_len)]
        assert batch.document_ids[row].tolist() == starts_after_first
    assert len(opened) <= 1  # only the last shard, which those windows read (already open from above)

    mixture = Mixture([0.5, 0.3, 0.2])
    g = np.array([10**13 - 1, 10**13 - 10, 5 * 10**12 + 3], dtype=np.int64)
    sources, samples = mixture.locate(g)
    for gi, s, i in zip(g.tolist(), sources.tolist(), samples.tolist()):
        block, slot = divmod(gi, 10)
        assert s == mixture.source_of[slot] and i == block * (5, 3, 2)[s] + int(mixture.rank_of[slot])


def write_many_shards(folder: Path, shards: int, tokens_per_shard: int) -> None:
    """A sharded folder of `shards` tiny shards, each one document of ids 0..n-2 and <|endoftext|>."""
    folder.mkdir()
    tokens = np.concatenate([np.arange(tokens_per_shard - 1), [EOT + 100]]).astype(np.uint16)
    for split in ("train", "val"):
        for i in range(shards):
            tokens.tofile(folder / f"{folders.shard_name(split, i)}.bin")
            np.zeros(1, dtype="<i8").tofile(folder / f"{folders.shard_name(split, i)}.starts")
    entry = {"documents": shards, "tokens": shards * tokens_per_shard, "shards": [[tokens_per_shard, 1]] * shards}
    meta = {"format": "shards", "dtype": "uint16", "vocab_size": 200, "eot_id": EOT + 100}
    (folder / "meta.json").write_text(json.dumps({**meta, "splits": {"train": entry, "val": entry}}))


def test_thousands_of_shards_open_lazily_and_stay_few(tmp_path, monkeypatch):
    """2,000 shards: opening the store opens none; reading windows through every one keeps at most OPEN_SHARDS
    mapped, so the process's open files stay bounded."""
    write_many_shards(tmp_path / "many", 2000, 40)
    opened = []
    real = folders.FolderShard

    class Counted(real):
        def __init__(self, *args):
            opened.append(args[0])
            super().__init__(*args)

    monkeypatch.setattr(folders, "FolderShard", Counted)
    source = open_store(tmp_path / "many")
    assert source.num_tokens == 80_000 and opened == []
    fds = len(os.listdir("/proc/self/fd"))
    dataset = MixtureDataset([source], [1.0], 32, 25, 0, 1, [3], document_masking=True)
    stream = iter(dataset)
    for _ in range(100):  # 2,500 windows: every shard, in shuffled order
        batch = next(stream)
        assert (batch.document_ids[:, 1:] >= batch.document_ids[:, :-1]).all()
    assert len(set(opened)) == 2000 and len(source._open) <= OPEN_SHARDS
    assert len(os.listdir("/proc/self/fd")) <= fds + 2 * OPEN_SHARDS


# ---- document ids ---------------------------------------------------------------------------------------


def test_document_ids_count_the_starts_after_the_first_position():
    rng = np.random.default_rng(1)
    for _ in range(200):
        length, first = int(rng.integers(1, 50)), int(rng.integers(0, 100))
        starts = np.unique(rng.integers(0, 160, rng.integers(0, 12)))
        ids = document_ids(starts, first, length)
        assert ids.dtype == np.int32
        assert ids.tolist() == [int(((starts > first) & (starts <= first + t)).sum()) for t in range(length)]


def prepared(tmp_path: Path, *extra: str) -> Path:
    """The fixture corpus prepared into small shards (in this process)."""
    from export_utils import script

    out = tmp_path / "prepared"
    args = ["--tokenizer", str(ROOT / "data/tokenizer/elr8k.tiktoken"), "--out", str(out), "--val-fraction", "0.3"]
    assert (
        script("prepare_data").main([*args, "--shard-mb", "0.002", *extra, str(ROOT / "tests/fixtures/tiny_corpus")])
        == 0
    )
    return out


def test_every_document_start_of_a_prepared_folder_raises_the_id(tmp_path):
    """In every window of a sharded folder (windows crossing shards too), the id rises by one exactly where the
    token before is <|endoftext|>; validation batches carry the same ids."""
    out = prepared(tmp_path)
    eot = json.loads((out / "meta.json").read_text())["eot_id"]
    assert len(json.loads((out / "meta.json").read_text())["splits"]["train"]["shards"]) > 2
    loader = build_train_loader(out, 16, 8, 0, 1, seed=0, document_masking=True, vocab_size=eot + 1)
    stream = iter(loader)
    for _ in range(20):
        inputs, _, ids = next(stream)
        assert ids[:, 0].eq(0).all()
        assert torch.equal(ids[:, 1:] - ids[:, :-1], (inputs[:, :-1] == eot).int())


def test_an_older_folder_serves_document_ids_once_its_starts_are_recorded(tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    tokens = np.array([1, 2, EOT, 3, 4, 5, EOT, 6, EOT, 7, 8, EOT] * 5, dtype=np.uint16)
    tokens.tofile(folder / "train.bin")
    tokens.tofile(folder / "val.bin")
    split = {"tokens": len(tokens)}
    meta = {"dtype": "uint16", "vocab_size": 16, "eot_id": EOT, "splits": {"train": split, "val": split}}
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="record-documents"):
        build_train_loader(folder, 8, 2, 0, 1, 0, document_masking=True)
    assert record_document_starts(folder) == {"train": 20, "val": 20}
    inputs, _, ids = next(iter(build_train_loader(folder, 8, 4, 0, 1, 0, document_masking=True)))
    assert torch.equal(ids[:, 1:] - ids[:, :-1], (inputs[:, :-1] == EOT).int())


def test_a_token_past_the_vocabulary_names_its_store(tmp_path):
    folder = tmp_path / "dt"
    folder.mkdir()
    write_datatrove(folder / "a.ds", [[1, 500, EOT]] + [[1, 2, 3, EOT]] * 10)
    loader = build_mixture_loader([DataSource("web", str(folder), 1.0)], 4, 11, 0, 1, 0, shuffle=False, vocab_size=16)
    with pytest.raises(DataError, match=r"dt: window 0 holds token id 500, past the tokenizer's vocabulary of 16"):
        next(iter(loader))
