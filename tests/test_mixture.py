"""Weighted mixtures ([[data.sources]], elr/data/mixture.py): exact shares in every block of samples, the one
integer of state (an exact resume, 1 rank -> 2 ranks), each source's own epochs, a changed mixture continuing
every source where it stopped, and the trainer's per-source validation in metrics.jsonl and TensorBoard."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_utils import DEBUG_TOML, ROOT, overrides, records

from elr.config import load_config
from elr.config.data import DataSource
from elr.data.loader import build_mixture_loader
from elr.data.mixture import (
    MAX_BLOCK,
    ORIGIN,
    Mixture,
    block_counts,
    continue_mixture,
    describe_change,
    mixture_origin,
)
from elr.errors import ConfigError
from elr.train.trainer import Trainer

SEQ = 4
BASES = {"a": 0, "b": 10000, "c": 20000}  # a row's first token tells its source and window: base + 4 * window


def source_folder(folder: Path, base: int, windows: int) -> Path:
    """An older single-file folder whose token at position p is base + p: `windows` windows of SEQ + 1."""
    folder.mkdir(parents=True)
    n = windows * SEQ + 1
    (base + np.arange(n)).astype(np.uint16).tofile(folder / "train.bin")
    (folder / "meta.json").write_text(json.dumps({"dtype": "uint16", "splits": {"train": {"tokens": n}}}))
    return folder


def sources(tmp_path: Path, weights=(0.5, 0.3, 0.2), windows=(400, 300, 10)) -> list[DataSource]:
    return [
        DataSource(name, str(source_folder(tmp_path / name, BASES[name], w)), weight)
        for name, weight, w in zip(BASES, weights, windows)
    ]


def served(batches) -> list[tuple[str, int]]:
    """(source, window) of every row, in order."""
    rows = []
    for inputs, _, _ in batches:
        for first in inputs[:, 0].tolist():
            name = max((n for n in BASES if BASES[n] <= first), key=BASES.get)
            rows.append((name, (first - BASES[name]) // SEQ))
    return rows


def take(loader, steps: int, it=None) -> list:
    it = iter(loader) if it is None else it
    return [next(it) for _ in range(steps)]


def test_weights_become_whole_counts_over_the_smallest_block():
    assert block_counts([0.5, 0.3, 0.2]).tolist() == [5, 3, 2]
    assert block_counts([60, 25, 15]).tolist() == [12, 5, 3]  # any scale
    assert block_counts([1, 1, 1]).tolist() == [1, 1, 1]
    counts = block_counts([1.0, 2**0.5])  # no block up to MAX_BLOCK is exact: largest remainder over it
    assert counts.sum() == MAX_BLOCK and abs(counts[0] / MAX_BLOCK - 1 / (1 + 2**0.5)) < 1 / MAX_BLOCK
    with pytest.raises(ConfigError, match="rounds to no samples"):
        block_counts([1.0, 1e-6])


def test_three_sources_hold_their_shares_in_every_1000_consecutive_samples(tmp_path):
    """0.5 / 0.3 / 0.2: exactly 500 / 300 / 200 in every run of 1,000 samples, aligned or not, as the loader
    serves them (2 ranks of 5 rows), and spread evenly inside every block of 10."""
    mixture = Mixture([0.5, 0.3, 0.2])
    picks, _ = mixture.locate(np.arange(6000))
    counts = np.cumsum(np.eye(3, dtype=np.int64)[picks], axis=0)
    windows = counts[1000:] - counts[:-1000]  # samples of each source in [g + 1, g + 1000], every g
    assert (windows == [500, 300, 200]).all()
    assert picks[:10].tolist() == [0, 1, 2, 0, 0, 1, 0, 2, 1, 0]  # the block: each source's k-th at (k + 1/2) / c

    specs = sources(tmp_path)
    loaders = [build_mixture_loader(specs, SEQ, 5, r, 2, seed=1) for r in range(2)]
    streams = [iter(loader) for loader in loaders]
    rows = []
    for _ in range(300):  # 3,000 samples, rank 0's 5 then rank 1's 5 of each global microbatch
        for stream in streams:
            rows += served([next(stream)])
    assert [name for name, _ in rows] == [("a", "b", "c")[s] for s in picks[:3000]]


def test_a_resume_mid_run_serves_the_same_next_batch_and_two_ranks_continue_one(tmp_path):
    specs = sources(tmp_path)
    loader = build_mixture_loader(specs, SEQ, 4, 0, 1, seed=7)
    it = iter(loader)
    take(loader, 37, it)
    state = copy.deepcopy(loader.state_dict())
    expected = take(loader, 20, it)
    assert state["dataset_state"] == {"position": 37 * 4}

    resumed = build_mixture_loader(specs, SEQ, 4, 0, 1, seed=7)
    resumed.load_state_dict(state)
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(expected, take(resumed, 20)))

    two = [build_mixture_loader(specs, SEQ, 2, r, 2, seed=7) for r in range(2)]
    for loader_r in two:
        loader_r.load_state_dict(state)  # the one integer, saved by one rank
    halves = [take(loader_r, 20) for loader_r in two]
    for step, batch in enumerate(expected):
        assert torch.equal(torch.cat([halves[0][step].inputs, halves[1][step].inputs]), batch.inputs)


def test_an_exhausted_source_starts_its_next_epoch_and_reports_its_epochs(tmp_path):
    """Source c has 10 windows at 0.2: every 50 samples it reads all 10 once, in a new order each epoch; its
    epochs are in the loader's progress."""
    loader = build_mixture_loader(sources(tmp_path), SEQ, 10, 0, 1, seed=3)
    rows = served(take(loader, 20))  # 200 samples: 40 of c
    c = [w for name, w in rows if name == "c"]
    epochs = [c[i : i + 10] for i in range(0, 40, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs) and len({tuple(e) for e in epochs}) == 4
    progress = loader.dataset.progress()
    assert progress["data/epochs/c"] == 4.0 and progress["data/epochs/a"] == 100 / 400


def test_a_changed_mixture_continues_every_source_where_it_stopped(tmp_path):
    """0.5 / 0.3 / 0.2 for 200 samples, then 0.2 / 0.2 / 0.6: each source's next sample is the one after its
    last, so nothing is skipped or served twice within an epoch; a second change chains on the first."""
    specs = sources(tmp_path)
    first = build_mixture_loader(specs, SEQ, 10, 0, 1, seed=5)
    before = served(take(first, 20))
    old = [{"name": s.name, "weight": s.weight} for s in specs]
    origin = continue_mixture(old, [], 200)
    assert origin == {"position": 200, "consumed": {"a": 100, "b": 60, "c": 40}}

    changed = [DataSource(s.name, s.path, w) for s, w in zip(specs, (0.2, 0.2, 0.6))]
    second = build_mixture_loader(changed, SEQ, 10, 0, 1, seed=5)
    start, consumed = mixture_origin([{"step": 20, ORIGIN: origin}], ["a", "b", "c"])
    second.dataset.set_origin(start, consumed)
    second.dataset.position = 200
    after = served(take(second, 20))
    whole = build_mixture_loader(specs, SEQ, 10, 0, 1, seed=5)  # the first mixture, read on: each source's order
    long = served(take(whole, 100))
    for name in ("a", "b"):  # sources within their first epoch: the changed run continues each one's order
        ours = [w for n, w in before + after if n == name]
        assert ours == [w for n, w in long if n == name][: len(ours)]
        assert len(set(ours)) == len(ours)
    assert [n for n, _ in after].count("c") == 120  # 0.6 of the 200

    history = [{"step": 20, ORIGIN: origin}]
    again = continue_mixture([{"name": s.name, "weight": s.weight} for s in changed], history, 400)
    assert again["consumed"] == {"a": 100 + 40, "b": 60 + 40, "c": 40 + 120}


def test_a_change_of_sources_is_one_phrase():
    old = [{"name": "web", "path": "/w", "weight": 0.6}, {"name": "books", "path": "/b", "weight": 0.4}]
    new = [{"name": "web", "path": "/w", "weight": 0.5}, {"name": "math", "path": "/m", "weight": 0.5}]
    assert describe_change(old, new) == "web 0.6 -> 0.5, math added (0.5), books removed"


def mixture_overrides(dump: Path, steps: int, weights: str) -> list[str]:
    a, b = weights.split("/")
    return [
        *overrides(dump, steps),
        "--data.sources",
        f"prose:{a}:{ROOT / 'data' / 'tinyprose'},code:{b}:{ROOT / 'data' / 'code'}",
        "--validation.freq",
        "2",
        "--metrics.enable_tensorboard",
        "true",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
    ]


@pytest.mark.slow  # two trainer runs: about 15 s on 2 cores
def test_the_trainer_validates_each_source_and_a_resume_says_what_the_new_mixture_changed(tmp_path, caplog):
    """The bundled mixture: `val/loss_k{k}/{source}` beside the mixture's (their weighted mean) in metrics.jsonl
    and TensorBoard, each source's epochs; resumed at step 2 with other weights, one line says what changed and
    config.json records where the new mixture starts."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dump = tmp_path / "run"
    trainer = Trainer(load_config(DEBUG_TOML, mixture_overrides(dump, 2, "0.7/0.3")))
    try:
        trainer.train()
    finally:
        trainer.close()
    K = trainer.cfg.elr.max_loops
    validation = [r for r in records(dump) if "val/loss_k1" in r]
    assert [r["step"] for r in validation] == [0, 2]
    for r in validation:
        for k in range(1, K + 1):
            mean = 0.7 * r[f"val/loss_k{k}/prose"] + 0.3 * r[f"val/loss_k{k}/code"]
            assert r[f"val/loss_k{k}"] == pytest.approx(mean, rel=1e-12)
    trained = [r for r in records(dump) if "loss/train" in r]
    assert trained[-1]["data/epochs/prose"] > 0 and trained[-1]["data/epochs/code"] > 0
    events = EventAccumulator(str(dump / "tb"))
    events.Reload()
    assert {f"val/loss_k{k}/{s}" for k in range(1, K + 1) for s in ("prose", "code")} <= set(events.Tags()["scalars"])

    with caplog.at_level(logging.INFO, logger="elr"):
        resumed = Trainer(load_config(DEBUG_TOML, mixture_overrides(dump, 3, "0.5/0.5")))
    try:
        position = resumed.train_loader.dataset.position
        assert position == 2 * 4 and resumed.train_loader.dataset.mixture.start == position
        resumed.train()
    finally:
        resumed.close()
    lines = [r.getMessage() for r in caplog.records if "changed on resume" in r.getMessage()]
    assert lines == [
        "changed on resume: training.steps 2 -> 3; data.sources prose 0.7 -> 0.5, code 0.3 -> 0.5 (from step 3)"
    ]
    history = json.loads((dump / "config.json").read_text())["resumes"]
    assert history[-1]["data_origin"] == {"position": 8, "consumed": {"prose": 6, "code": 2}}
