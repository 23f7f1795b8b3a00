"""scripts/prepare_data.py's sharded folders: --workers 2 writes what --workers 1 writes, token for token; an
interrupted run stops in one line, leaves no temporary file and the same command finishes it from the shards
it kept; --append adds shards without rewriting the old ones."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from export_utils import script
from trainer_utils import ROOT

from elr.data.prepare import Settings, list_input_files, plan_units, write_unit
from elr.text.tokenizer import build_tokenizer

TOKENIZER = ROOT / "data" / "tokenizer" / "elr8k.tiktoken"
CORPUS = ROOT / "tests" / "fixtures" / "tiny_corpus"


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def prepare(*args: str) -> int:
    return script("prepare_data").main(["--tokenizer", str(TOKENIZER), "--val-fraction", "0.3", *map(str, args)])


def test_two_workers_write_what_one_writes_token_for_token(tmp_path):
    assert prepare("--out", tmp_path / "one", "--shard-mb", "0.001", CORPUS) == 0
    assert prepare("--out", tmp_path / "two", "--shard-mb", "0.001", "--workers", "2", CORPUS) == 0
    one = contents(tmp_path / "one")
    assert len(json.loads(one["meta.json"])["splits"]["train"]["shards"]) > 2
    assert one == contents(tmp_path / "two")  # every shard, its document starts and meta.json
    assert not (tmp_path / "one" / ".partial").exists()


def test_finished_shards_of_an_interrupted_run_are_kept_unless_their_input_changed(tmp_path, monkeypatch):
    """A unit finished before an interruption (written here as the run writes it) is not written again by the
    same command; once its input file changes it is."""
    module = script("prepare_data")
    written = []
    real = module.write_unit
    monkeypatch.setattr(module, "write_unit", lambda index, *a, **kw: written.append(index) or real(index, *a, **kw))
    out = tmp_path / "out"
    args = ["--tokenizer", str(TOKENIZER), "--val-fraction", "0.3", "--shard-mb", "0.001", "--out", str(out)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for p in CORPUS.iterdir():
        (corpus / p.name).write_bytes(p.read_bytes())
    units = plan_units(list_input_files([str(corpus)]), int(0.001 * 2**20))
    settings = Settings(str(TOKENIZER), module.file_sha256(TOKENIZER), "document", 0.3, "text")
    (out / ".partial").mkdir(parents=True)
    write_unit(0, units[0], build_tokenizer(str(TOKENIZER)), settings, out / ".partial")
    (out / ".partial" / "train-00003.bin.tmp").write_bytes(b"torn")  # a temporary file a killed run left
    assert module.main([*args, str(corpus)]) == 0
    assert written == list(range(1, len(units)))
    assert prepare("--out", tmp_path / "fresh", "--shard-mb", "0.001", corpus) == 0
    assert contents(out) == contents(tmp_path / "fresh")

    (out / ".partial").mkdir()  # the same, with unit 0's input modified since
    write_unit(0, units[0], build_tokenizer(str(TOKENIZER)), settings, out / ".partial")
    first = Path(units[0][0].file)
    os.utime(first, ns=(first.stat().st_atime_ns, first.stat().st_mtime_ns + 10**9))
    written.clear()
    assert module.main([*args, "--replace", str(corpus)]) == 0
    assert written == list(range(len(units)))


def test_append_adds_shards_and_leaves_the_old_ones_alone(tmp_path):
    first_inputs = [CORPUS / "lincoln_1862.txt", CORPUS / "sonnets_1_to_3.txt", CORPUS / "washington_1790.txt"]
    out = tmp_path / "out"
    assert prepare("--out", out, "--shard-mb", "0.001", "--split", "document", *first_inputs) == 0
    before = contents(out)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != "meta.json"}
    assert prepare("--out", out, "--shard-mb", "0.001", "--append", CORPUS / "paragraphs.jsonl") == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name in stamps} == stamps  # not rewritten
    after, old_meta = contents(out), json.loads(before["meta.json"])
    meta = json.loads(after["meta.json"])
    assert prepare("--out", tmp_path / "alone", "--shard-mb", "0.001", CORPUS / "paragraphs.jsonl") == 0
    alone = json.loads((tmp_path / "alone" / "meta.json").read_text())
    for split in ("train", "val"):
        old, new = old_meta["splits"][split], alone["splits"][split]
        assert meta["splits"][split]["shards"] == old["shards"] + new["shards"]
        assert meta["splits"][split]["tokens"] == old["tokens"] + new["tokens"]
        n = len(old["shards"])
        for i, _ in enumerate(new["shards"]):  # the new shards are the inputs' own, renumbered after the old
            assert after[f"{split}-{n + i:05d}.bin"] == (tmp_path / "alone" / f"{split}-{i:05d}.bin").read_bytes()
    assert meta["sources"] == old_meta["sources"] + alone["sources"]
    # another val fraction would mix two kinds of split in one folder: refused before any work
    assert prepare("--out", out, "--append", "--val-fraction", "0.5", CORPUS / "paragraphs.jsonl") == 1
    assert contents(out) == after and not (out / ".partial").exists()


# ---- interruption (processes, signals): the slow tier ----------------------------------------------------


@pytest.fixture(scope="module")
def big_input(tmp_path_factory) -> Path:
    """About 24 MB of JSONL: enough shards of 0.25 MB that an interruption lands mid-run."""
    folder = tmp_path_factory.mktemp("big")
    paragraphs = [json.loads(line)["text"] for line in (CORPUS / "paragraphs.jsonl").open()]
    with open(folder / "docs.jsonl", "w") as f:
        for i in range(60_000):
            f.write(json.dumps({"text": f"{paragraphs[i % len(paragraphs)]} ({i})"}) + "\n")
    return folder


def command(out: Path, source: Path, workers: int) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "scripts" / "prepare_data.py"),
        "--tokenizer",
        str(TOKENIZER),
        "--out",
        str(out),
        "--workers",
        str(workers),
        "--shard-mb",
        "0.25",
        str(source),
    ]


@pytest.fixture(scope="module")
def reference(big_input, tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("reference") / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command(out, big_input, 1), check=True, capture_output=True, env=env, timeout=600)
    return contents(out)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_stops_in_one_line_and_the_same_command_finishes_it(tmp_path, big_input, reference, sig):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command(out, big_input, 2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 300
    while not list((out / ".partial").glob("shard-*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and "shards," not in line]
    assert proc.returncode == 128 + sig, err
    assert len(lines) == 1 and lines[0].startswith("prepare_data: interrupted: ") and "Traceback" not in err, err
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    kept = len(list((out / ".partial").glob("shard-*.json")))
    assert kept >= 1 and not (out / "meta.json").exists()

    again = subprocess.run(command(out, big_input, 2), capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr
    assert contents(out) == reference  # as one uninterrupted --workers 1 run: token for token
