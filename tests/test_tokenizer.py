"""Tokenizer: the bundled BPE round-trips text, and train_tokenizer.py writes a file that
tiktoken loads and that encodes exactly as the trainer did."""

from __future__ import annotations

import base64
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import tiktoken.load

from elr.text.tokenizer import EOT, SPLIT_PATTERN, build_tokenizer

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "data" / "tokenizer" / "elr8k.tiktoken"
CORPUS = REPO / "tests" / "fixtures" / "tiny_corpus"

SAMPLES = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "Tabs\tand\r\nwindows\nnewlines\n\n\n",
    "Numbers 1234567 and 3.14159, contractions: don't, I'LL, we've.",
    "Unicode: café, naïve, Ελληνικά, 日本語, emoji 🙂.",
    f"The text may spell {EOT} without making it special.",
    "",
]


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
    )


def test_bundled_tokenizer_round_trip():
    tok = build_tokenizer(str(BUNDLED))
    assert tok.n_vocab == 8193 and tok.eot_id == 8192
    for text in SAMPLES + [p.read_text() for p in sorted(CORPUS.glob("*.txt"))]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.eot_id for i in ids), "encode must not emit the special token"
        assert tok.decode(ids) == text
    assert tok.decode([tok.eot_id]) == EOT
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]
    # A BPE trained on English prose should compress it well beyond bytes.
    prose = (CORPUS / "washington_1790.txt").read_text()
    assert len(prose.encode()) / len(tok.encode(prose)) > 3.0


def test_split_pattern_is_gpt4s():
    # The cl100k_base (GPT-4) regex, as tiktoken itself defines it.
    import tiktoken_ext.openai_public as openai_public

    assert SPLIT_PATTERN in inspect.getsource(openai_public.cl100k_base)


def test_unknown_name_and_offline_encoding(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="neither an existing ranks file"):
        build_tokenizer(str(tmp_path / "missing.tiktoken"))

    def offline(blobpath: str) -> bytes:
        raise ConnectionError(f"no network for {blobpath}")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    with pytest.raises(FileNotFoundError, match="TIKTOKEN_CACHE_DIR"):
        build_tokenizer("o200k_base")


def test_rebuilt_file_is_not_read_stale(tmp_path, monkeypatch):
    """tiktoken caches by path; a file rewritten in place must still load its new ranks."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tok.tiktoken"
    bytes_only = b"".join(base64.b64encode(bytes([b])) + f" {b}\n".encode() for b in range(256))
    path.write_bytes(bytes_only)
    assert build_tokenizer(str(path)).n_vocab == 257
    path.write_bytes(BUNDLED.read_bytes())
    assert build_tokenizer(str(path)).n_vocab == 8193


def test_train_tokenizer_end_to_end(tmp_path):
    pytest.importorskip("rustbpe")
    out = tmp_path / "tiny.tiktoken"
    result = run_script("train_tokenizer.py", "--vocab-size", "320", "--out", str(out), str(CORPUS))
    assert result.returncode == 0, result.stderr
    tok = build_tokenizer(str(out))
    assert tok.n_vocab == 321 and tok.eot_id == 320
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    assert not list(tmp_path.glob(".*.tmp")), "temporary file left behind"

    again = tmp_path / "again.tiktoken"
    assert run_script("train_tokenizer.py", "--vocab-size", "320", "--out", str(again), str(CORPUS)).returncode == 0
    assert again.read_bytes() == out.read_bytes(), "training must be deterministic"


@pytest.mark.slow
def test_train_tokenizer_errors(tmp_path):
    pytest.importorskip("rustbpe")
    out = tmp_path / "tok.tiktoken"
    missing = run_script("train_tokenizer.py", "--out", str(out), str(tmp_path / "nope.txt"))
    assert missing.returncode == 1 and "nope.txt: no such file" in missing.stderr
    (tmp_path / "empty.txt").write_text("  \n")
    empty = run_script("train_tokenizer.py", "--out", str(out), str(tmp_path / "empty.txt"))
    assert empty.returncode == 1 and "no non-empty documents" in empty.stderr
    too_big = run_script(
        "train_tokenizer.py", "--vocab-size", "100000", "--out", str(out), str(CORPUS / "lincoln_1862.txt")
    )
    assert too_big.returncode == 1 and "fewer than --vocab-size" in too_big.stderr
    assert not out.exists() and not list(tmp_path.glob(".*.tmp"))
