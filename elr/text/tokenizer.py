"""Tokenizer: a thin wrapper over `tiktoken.Encoding`, shared by training and inference.

Two sources are accepted, so that the same trainer runs offline with the bundled BPE and at
scale with a production vocabulary:

- a local ranks file (the format `tiktoken.load.load_tiktoken_bpe` reads, one
  ``base64(token) rank`` per line), e.g. ``data/tokenizer/elr8k.tiktoken`` made by
  ``scripts/train_tokenizer.py``. It gets the GPT-4 split regex below and one special token,
  ``<|endoftext|>``, whose id is the number of ranks;
- a tiktoken encoding name such as ``o200k_base``; tiktoken downloads its file once, so offline
  machines need it in ``TIKTOKEN_CACHE_DIR`` beforehand.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import tiktoken
import tiktoken.load

from elr.errors import ConfigError, TokenizerError

# The GPT-4 (cl100k_base) pre-tokenization regex, character for character, written out because a
# ranks file does not carry it: the BPE is trained on the pieces this regex cuts, so encoding must
# cut the same way. Alternatives, in order: contractions; letters with at most one leading
# non-letter (" the", "(word"); numbers in groups of up to three digits; punctuation runs with an
# optional leading space; whitespace at the end of the text; newlines; whitespace not followed by
# text (so a trailing space starts the next word); any other whitespace character.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
EOT = "<|endoftext|>"


class Tokenizer:
    """Text <-> token ids. `encode` never emits special tokens, even if the text spells one:
    document boundaries are added by the data preparation, not by the text itself."""

    def __init__(self, encoding: tiktoken.Encoding, source: str, sha256: str | None = None):
        if EOT not in encoding.special_tokens_set:
            raise TokenizerError(f"tokenizer {source!r} has no {EOT} special token")
        self.encoding = encoding
        self.source = source
        self.sha256 = sha256  # of the ranks file (None for a tiktoken encoding name): what meta.json records
        self.eot_id: int = encoding.encode_single_token(EOT)
        # One past the largest id (specials included): the smallest usable embedding size.
        self.n_vocab: int = encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 4) -> list[list[int]]:
        """Like `encode` on each text, but tiktoken spreads the work over threads."""
        return self.encoding.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, n_vocab={self.n_vocab}, eot_id={self.eot_id})"


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file, read 16 MiB at a time (checkpoint shards use it too)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def load_ranks(path: str | Path, sha256: str | None = None) -> dict[bytes, int]:
    """Read a tiktoken ranks file and check that its ranks are exactly 0..n-1."""
    # tiktoken caches every file it reads under a key made from the path alone, so a file that
    # was rebuilt in place would come back stale; passing the current hash makes it re-read.
    try:
        ranks = tiktoken.load.load_tiktoken_bpe(str(path), expected_hash=sha256 or file_sha256(path))
    except ValueError:  # tiktoken's message quotes the line: say what is wrong, never what the file holds
        raise TokenizerError(f"{path}: not a tiktoken ranks file (one `base64(token) rank` per line)") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks are not the contiguous range 0..{len(ranks) - 1}")
    return ranks


def build_tokenizer(path_or_name: str) -> Tokenizer:
    """A local ranks file if `path_or_name` is an existing file, else a tiktoken encoding name."""
    path = Path(path_or_name)
    if path.is_file():
        sha256 = file_sha256(path)
        ranks = load_ranks(path, sha256)
        encoding = tiktoken.Encoding(
            name=path.stem,
            pat_str=SPLIT_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={EOT: len(ranks)},
        )
        return Tokenizer(encoding, str(path), sha256)

    if path_or_name not in tiktoken.list_encoding_names():
        raise FileNotFoundError(
            f"tokenizer {path_or_name!r} is neither an existing ranks file nor a tiktoken "
            f"encoding name (known: {', '.join(tiktoken.list_encoding_names())})"
        )
    try:
        encoding = tiktoken.get_encoding(path_or_name)
    except Exception as e:  # network errors come in many types; all mean "not available"
        raise FileNotFoundError(
            f"tiktoken encoding {path_or_name!r} is not available offline ({type(e).__name__}: "
            f"{e}). Download it once on a machine with internet access and point "
            "TIKTOKEN_CACHE_DIR at the cache, or pass a local ranks file instead."
        ) from e
    return Tokenizer(encoding, path_or_name)


# n_vocab (ranks + special tokens) of the tiktoken encodings, as tiktoken 0.14 builds them: estimates
# sized by a config's vocabulary must not depend on whether the encoding's file is cached or can be
# downloaded.
ENCODING_VOCAB = {"o200k_base": 200019, "cl100k_base": 100277}


def vocab_size(path_or_name: str) -> int:
    """The vocabulary of a ranks file (read), or of a tiktoken encoding (known by name, never loaded):
    the same on every machine. For the estimates; training builds the tokenizer itself."""
    if Path(path_or_name).is_file():
        return build_tokenizer(path_or_name).n_vocab
    if path_or_name in ENCODING_VOCAB:
        return ENCODING_VOCAB[path_or_name]
    raise ConfigError(
        f"tokenizer.path: {path_or_name!r} is neither a file nor one of {', '.join(ENCODING_VOCAB)}; pass --vocab-size"
    )
