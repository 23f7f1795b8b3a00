"""The run's tiktoken BPE as files `transformers.AutoTokenizer` loads: tokenizer.json (a byte-level BPE for
the `tokenizers` library) and tokenizer_config.json (special tokens, optional chat template).

tiktoken merges by rank: the lowest-ranked adjacent pair first. A BPE whose merge list is in rank order
and whose vocabulary maps each token's bytes (in GPT-2's byte-to-character alphabet) to its rank makes
the same choices, so both give the same ids. The split regex is the run's, with one rewrite: the
`tokenizers` regex engine (Oniguruma) reads `{1,3}+` as "{1,3}, repeated", not possessive, so it is
written `{1,3}` (the same matches: nothing follows it in its alternative). `check` encodes a sample with
both and refuses an export on which they differ.

A prompt begins with `<|endoftext|>`, as every training document does: the tokenizer adds it (a
post-processor, `add_bos_token`) unless called with `add_special_tokens=False`; generate.py and both
lm-eval paths add it too (docs/interop.md). `tokenizer_from_json` reads the vocabulary back
into tiktoken ranks, for a folder re-saved by transformers, which keeps tokenizer.json but not the
ranks file.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import tiktoken

from elr.errors import TokenizerError
from elr.text.tokenizer import EOT, SPLIT_PATTERN, Tokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
MAX_TOKENIZER_JSON_BYTES = 256 << 20

# What `check` encodes: words, digits in runs, contractions, whitespace runs, newlines, punctuation, UTF-8.
SAMPLE = (
    "The king's 12345 men didn't   go.\n\n  Then: \"ok\"?! (x+y)=z\t\ttabs  \r\n"
    "naïve café, Ελληνικά, 日本語のテキスト, emoji 🙂 and spaces at the end   "
)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what byte-level BPE vocabularies use)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def _last_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two parts tiktoken joins last when it encodes `token` alone: its rank-ordered merging run
    with only the merges ranked below the token's own."""
    rank = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        best, i = min(pairs)
        if best >= rank:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise TokenizerError(f"token {token!r} (rank {rank}) is not a merge of two lower-ranked tokens")
    return parts[0], parts[1]


def _merges(ranks: dict[bytes, int], text) -> list[list[str]]:
    """The merge list in rank order: each multi-byte token as the pair tiktoken would join last."""
    return [
        [text(a), text(b)]
        for a, b in (
            _last_merge(ranks, token) for token, _ in sorted(ranks.items(), key=lambda item: item[1]) if len(token) > 1
        )
    ]


def tokenizer_json(tokenizer: Tokenizer) -> dict:
    """tokenizer.json for the `tokenizers` library: byte-level BPE, the run's split regex, EOT special."""
    encoding = tokenizer.encoding
    alphabet = _byte_alphabet()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    ranks = encoding._mergeable_ranks
    vocab = {text(token): rank for token, rank in ranks.items()}
    specials = [
        {
            "id": i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for s, i in sorted(encoding._special_tokens.items(), key=lambda item: item[1])
    ]
    pattern = encoding._pat_str.replace("{1,3}+", "{1,3}")
    eot = {"id": EOT, "type_id": 0}
    begin = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": eot}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": eot},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": eot},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {EOT: {"id": EOT, "ids": [tokenizer.eot_id], "tokens": [EOT]}},
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": begin,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": _merges(ranks, text),
        },
    }


def tokenizer_config(chat_template: str | None = None, max_length: int | None = None) -> dict:
    """tokenizer_config.json: the fast tokenizer class, <|endoftext|> as every special token and added
    at the start of every text (as it begins every training document), and the chat template when given."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length or int(1e30),
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def write_tokenizer(
    tokenizer: Tokenizer, folder: Path, chat_template: str | None = None, max_length: int | None = None
) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `folder`, after
    checking that the converted tokenizer encodes like the run's (when `tokenizers` is installed)."""
    data = tokenizer_json(tokenizer)
    check(tokenizer, data)
    (folder / TOKENIZER_JSON).write_text(json.dumps(data, ensure_ascii=False))
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config(chat_template, max_length), indent=2))
    (folder / SPECIAL_TOKENS_MAP).write_text(json.dumps({k: EOT for k in ("bos_token", "eos_token", "pad_token")}))


def check(tokenizer: Tokenizer, data: dict, text: str = SAMPLE) -> None:
    """Refuse a conversion that encodes `text` differently from the run's tokenizer."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:  # the export is still right by construction; transformers brings tokenizers
        return
    converted = HFTokenizer.from_str(json.dumps(data)).encode(text, add_special_tokens=False).ids
    if converted != tokenizer.encode(text):
        raise TokenizerError(
            f"tokenizer {tokenizer.source}: its tokenizer.json conversion encodes differently "
            "(a split regex the tokenizers library reads otherwise?); not exported"
        )


def tokenizer_from_json(path: str | Path) -> Tokenizer:
    """The run's tokenizer from an export's tokenizer.json: its vocabulary (GPT-2's byte alphabet) back
    to tiktoken ranks, with the run's split regex. Its `sha256` is that of the ranks file it came from
    (one `base64(token) rank` line per rank, in rank order, as the project's ranks files are written),
    so a caller can compare it with the hash the run recorded."""
    path = Path(path)
    if path.stat().st_size > MAX_TOKENIZER_JSON_BYTES:
        raise TokenizerError(f"{path} is larger than {MAX_TOKENIZER_JSON_BYTES} bytes: not a tokenizer.json")
    inverse = {char: byte for byte, char in _byte_alphabet().items()}
    try:
        data = json.loads(path.read_bytes())
        vocab = data["model"]["vocab"]
        ranks = {bytes(inverse[c] for c in token): rank for token, rank in vocab.items()}
        pattern = data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
        specials = {t["content"]: t["id"] for t in data["added_tokens"]}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise TokenizerError(f"{path}: not a tokenizer.json written by the ELR export ({type(e).__name__})") from None
    if (
        pattern != SPLIT_PATTERN.replace("{1,3}+", "{1,3}")
        or specials.get(EOT) != len(ranks)
        or not all(type(r) is int for r in ranks.values())
        or sorted(ranks.values()) != list(range(len(ranks)))
    ):
        raise TokenizerError(
            f"{path}: not a tokenizer.json written by the ELR export (its split regex, ranks or {EOT} id differ)"
        )
    lines = b"".join(
        base64.b64encode(token) + b" %d\n" % rank for token, rank in sorted(ranks.items(), key=lambda item: item[1])
    )
    encoding = tiktoken.Encoding(
        name=path.stem, pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: len(ranks)}
    )
    return Tokenizer(encoding, str(path), hashlib.sha256(lines).hexdigest())
