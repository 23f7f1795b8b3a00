"""The data benchmarks scripts/bench.py runs (`loader`, `prepare`): what one loader process delivers, and what
prepare_data.py's workers buy.

    python scripts/bench.py loader --shards 1000 --seq-len 8192 --batch 8 --steps 200
    python scripts/bench.py prepare --mb 40 --workers 1 2

`loader` writes a synthetic three-source sharded mixture (web: --shards shards, code: 100, math: 10, each shard
50,000 random uint16 tokens in documents of about 1,000) into a temporary folder, then times the loader's
start (opening every source and serving the first batch) and its tokens/s with document masking on and off,
shuffled windows, in one process. `prepare` tokenizes the same --mb megabytes of JSONL text with each worker
count and checks that the folders are identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SHARD_TOKENS = 50_000
VOCAB = 50_000


def write_source(folder: Path, shards: int, rng: np.random.Generator) -> None:
    """A sharded folder (elr/data/folders.py) of random tokens in documents of geometric lengths (mean 1,000)."""
    folder.mkdir(parents=True)
    counts = []
    for i in range(shards):
        tokens = rng.integers(0, VOCAB, SHARD_TOKENS, dtype=np.uint16)
        lengths = rng.geometric(1 / 1000, SHARD_TOKENS // 100)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        starts = starts[starts < SHARD_TOKENS].astype("<i8")
        tokens.tofile(folder / f"train-{i:05d}.bin")
        starts.tofile(folder / f"train-{i:05d}.starts")
        counts.append([SHARD_TOKENS, len(starts)])
    split = {"documents": sum(c[1] for c in counts), "tokens": shards * SHARD_TOKENS, "shards": counts}
    meta = {"format": "shards", "dtype": "uint16", "vocab_size": VOCAB, "splits": {"train": split}}
    (folder / "meta.json").write_text(json.dumps(meta))


def loader_table(args) -> tuple[str, list[str], list[list]]:
    """(title, header, rows): the loader's start and tokens/s with document masking on and off."""
    from elr.config.data import DataSource
    from elr.data.loader import build_mixture_loader

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        layout = {"web": (args.shards, 0.6), "code": (100, 0.3), "math": (10, 0.1)}
        for name, (shards, _) in layout.items():
            write_source(Path(tmp) / name, shards, rng)
        specs = [DataSource(name, str(Path(tmp) / name), weight) for name, (_, weight) in layout.items()]
        total = sum(s for s, _ in layout.values()) * SHARD_TOKENS
        title = (
            f"loader: 3 sources, {sum(s for s, _ in layout.values())} shards, {total / 1e6:.0f}M tokens "
            f"(page cache warm), seq_len {args.seq_len}, batch {args.batch}, {args.steps} batches, one process"
        )
        rows = []
        for masking in (True, False):
            start = time.perf_counter()
            loader = build_mixture_loader(specs, args.seq_len, args.batch, 0, 1, 0, True, masking, VOCAB)
            stream = iter(loader)
            next(stream)
            startup = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(args.steps):
                next(stream)
            seconds = time.perf_counter() - start
            tokens = args.steps * args.batch * args.seq_len
            rows.append(["on" if masking else "off", f"{startup:.3f}", f"{tokens / seconds / 1e6:.2f}M"])
    return title, ["document masking", "startup s", "tokens/s"], rows


def write_text(path: Path, megabytes: float) -> None:
    """JSONL documents from the fixture corpus's paragraphs, each numbered so no two are alike."""
    paragraphs = [json.loads(line)["text"] for line in (ROOT / "tests/fixtures/tiny_corpus/paragraphs.jsonl").open()]
    written, i = 0, 0
    with open(path, "w") as f:
        while written < megabytes * 1e6:
            line = json.dumps({"text": f"{paragraphs[i % len(paragraphs)]} ({i})"}) + "\n"
            written += f.write(line)
            i += 1


def prepare_table(args) -> tuple[str, list[str], list[list]]:
    """(title, header, rows): prepare_data.py's time on one input at each worker count; the last row says
    whether the folders are identical."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "in").mkdir()
        write_text(Path(tmp) / "in" / "docs.jsonl", args.mb)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        rows, outputs, base = [], [], None
        title = f"prepare_data.py on {args.mb:g} MB of JSONL, shards of {args.shard_mb:g} MB, {os.cpu_count()} CPUs"
        for workers in args.workers:
            out = Path(tmp) / f"out-{workers}"
            command = [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--out", str(out)]
            command += ["--workers", str(workers), "--shard-mb", str(args.shard_mb), str(Path(tmp) / "in")]
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True, env=env)
            seconds = time.perf_counter() - start
            tokens = sum(s["tokens"] for s in json.loads((out / "meta.json").read_text())["splits"].values())
            base = base or seconds
            rate = [f"{seconds:.1f}", f"{args.mb / seconds:.1f}", f"{tokens / seconds:,.0f}", f"{base / seconds:.2f}x"]
            rows.append([workers, *rate])
            outputs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    same = "identical" if all(o == outputs[0] for o in outputs) else "DIFFERENT"
    return f"{title}; the folders are {same}", ["workers", "seconds", "MB/s", "tokens/s", "speedup"], rows
