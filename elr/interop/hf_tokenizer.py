"""The run's tiktoken BPE as files `transformers.AutoTokenizer` loads: tokenizer.json (a byte-level BPE for
the `tokenizers` library) and tokenizer_config.json (special tokens, optional chat template).

tiktoken merges by rank: the lowest-ranked adjacent pair first. A BPE whose merge list is in rank order
and whose vocabulary maps each token's bytes (in GPT-2's byte-to-character alphabet) to its rank makes
the same choices, so both give the same ids. The split regex is the run's, with one rewrite: the
`tokenizers` regex engine (Oniguruma) reads `{1,3}+` as "{1,3}, repeated", not possessive, so it is
written `{1,3}` (the same matches: nothing follows it in its alternative). `check` encodes a sample with
both and refuses an export on which they differ.
"""

from __future__ import annotations

import json
from pathlib import Path

from elr.errors import TokenizerError
from elr.tokenizer import EOT, Tokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"

# What `check` encodes: words, digits in runs, contractions, whitespace runs, newlines, punctuation, UTF-8.
SAMPLE = ("The king's 12345 men didn't   go.\n\n  Then: \"ok\"?! (x+y)=z\t\ttabs  \r\n"
          "naïve café, Ελληνικά, 日本語のテキスト, emoji 🙂 and spaces at the end   ")


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
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        best, i = min(pairs)
        if best >= rank:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise TokenizerError(f"token {token!r} (rank {rank}) is not a merge of two lower-ranked tokens")
    return parts[0], parts[1]


def _merges(ranks: dict[bytes, int], text) -> list[list[str]]:
    """The merge list in rank order: each multi-byte token as the pair tiktoken would join last."""
    return [[text(a), text(b)] for a, b in (_last_merge(ranks, token) for token, _ in
                                            sorted(ranks.items(), key=lambda item: item[1]) if len(token) > 1)]


def tokenizer_json(tokenizer: Tokenizer) -> dict:
    """tokenizer.json for the `tokenizers` library: byte-level BPE, the run's split regex, EOT special."""
    encoding = tokenizer.encoding
    alphabet = _byte_alphabet()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    ranks = encoding._mergeable_ranks
    vocab = {text(token): rank for token, rank in ranks.items()}
    specials = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                 "special": True} for s, i in sorted(encoding._special_tokens.items(), key=lambda item: item[1])]
    pattern = encoding._pat_str.replace("{1,3}+", "{1,3}")
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": specials, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": _merges(ranks, text)},
    }


def tokenizer_config(chat_template: str | None = None, max_length: int | None = None) -> dict:
    """tokenizer_config.json: the fast tokenizer class, <|endoftext|> as every special token (documents
    start with it in training; nothing is added automatically), and the chat template when given."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT, "pad_token": EOT,
              "unk_token": None, "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": max_length or int(1e30)}
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def write_tokenizer(tokenizer: Tokenizer, folder: Path, chat_template: str | None = None,
                    max_length: int | None = None) -> None:
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
        raise TokenizerError(f"tokenizer {tokenizer.source}: its tokenizer.json conversion encodes differently "
                             "(a split regex the tokenizers library reads otherwise?); not exported")
