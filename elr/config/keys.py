"""Typed keys: TOML tables and `--section.key value` overrides set onto a config of dataclass sections.

Each value is checked against its field's annotated type (CLI strings parsed, lists comma-separated:
`--optimizer.betas 0.9,0.95`), and an unknown section or key is one ConfigError naming it. As in
torchtitan, a boolean key given bare (`--checkpoint.enable`) is true, and a key may be spelled with
dashes (`--checkpoint.keep-latest-k`). A key with a fixed set of values is annotated `Literal[...]`: the
annotation is its one list of choices (`choices` reads it for the checks, `--help`, the configuration page and
the code that dispatches on it). elr/config/job.py holds the sections, their defaults and the checks of their
values; this is the mechanism that fills them, with the rules every key obeys by its type (`check_fields`) and
the one form of a config error (`require`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Literal

from elr.errors import ConfigError

MAX_STRING = 16_384  # characters: a path (Linux allows 4,096 bytes), a name, a description; more is a mistake


def require(ok: bool, key: str, message: str, value) -> None:
    """The one form of a config error: `section.key: message (got value)`, raised unless ok."""
    if not ok:
        raise ConfigError(f"{key}: {message} (got {value!r})")


def choices(section, name: str) -> tuple:
    """The values a choice field (annotated `Literal[...]`) may take, in the annotation's order; () for any other
    field. `section`: a section's dataclass or an instance of it."""
    return _choices_of(typing.get_type_hints(section if isinstance(section, type) else type(section))[name])


def _choices_of(typ) -> tuple:
    return typing.get_args(typ) if typing.get_origin(typ) is Literal else ()


def check_choice(key: str, value, allowed: tuple) -> None:
    """A choice key's value is one of its choices (the empty string spelt `""`)."""
    spelt = ", ".join(choice if choice != "" else '""' for choice in allowed)
    require(value in allowed, key, f"must be one of {spelt}", value)


def check_sha256(key: str, sha: str) -> None:
    require(
        sha == "" or (len(sha) == 64 and all(ch in "0123456789abcdef" for ch in sha)),
        key,
        "must be empty or 64 lowercase hex digits",
        sha,
    )


def check_fields(section, table: str) -> None:
    """The rules every key of a section obeys by its type, whoever set it (a file, the command line or code):
    a choice key holds one of its choices, a number is finite (nan passes every comparison like lr > 0).
    Each section's `check()` runs this first; `table` is its TOML table, the keys' prefix."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        key, value = f"{table}.{f.name}", getattr(section, f.name)
        if allowed := _choices_of(hints[f.name]):
            check_choice(key, value, allowed)
        numbers = value if isinstance(value, list) else [value]
        require(all(math.isfinite(x) for x in numbers if isinstance(x, float)), key, "must be a finite number", value)


def coerce(key: str, value, typ):
    """Check a TOML value (or parse a CLI string) against the field's annotated type."""
    origin = typing.get_origin(typ)
    if origin is Literal:  # typed as its choices' type here; which choice: the section's check (check_fields)
        return coerce(key, value, type(typing.get_args(typ)[0]))
    if origin is list:
        (item_type,) = typing.get_args(typ)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if dataclasses.is_dataclass(item_type):  # a list of tables, [[section.key]]: each named by its place
            return [coerce(f"{key}[{i}]", v, item_type) for i, v in enumerate(value)]
        return [coerce(key, v, item_type) for v in value]
    if dataclasses.is_dataclass(typ):
        return _table(key, value, typ)
    if typ is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ in (int, float):
        if isinstance(value, str):
            try:
                value = typ(value)
            except ValueError:
                pass
        accepted = int if typ is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, accepted):
            raise ConfigError(f"{key}: expected {'an integer' if typ is int else 'a number'}, got {value!r}")
        if not math.isfinite(value) or abs(value) >= 2**63:  # nan passes every `>=` check; no knob wants inf
            raise ConfigError(f"{key}: expected a finite number below 2^63 in size, got {value!r}")
        return typ(value)
    if typ is str:
        if isinstance(value, str) and len(value) > MAX_STRING:  # named by its size: never echoed
            raise ConfigError(
                f"{key}: a string of {len(value):,} characters; a config string is at most {MAX_STRING:,}"
            )
        if isinstance(value, str) and "\x00" not in value:
            return value
        raise ConfigError(f"{key}: expected a string without NUL characters, got {value!r}")
    raise TypeError(f"unsupported config type {typ} for {key}")


def _table(key: str, value, typ):
    """A table of a list of tables (a dataclass), from TOML's dict, a saved config's, or the command line's
    text (the dataclass's `from_text`); each of its keys checked by its annotated type."""
    if isinstance(value, typ):
        return value
    if isinstance(value, str) and hasattr(typ, "from_text"):
        value = typ.from_text(key, value)
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a table, got {value!r}")
    hints = typing.get_type_hints(typ)
    for name in value:
        if name not in hints:
            raise ConfigError(f"{key}: unknown key {name!r}{_did_you_mean(name, list(hints))}")
    return typ(**{name: coerce(f"{key}.{name}", v, hints[name]) for name, v in value.items()})


def key_type(cfg, key: str):
    """The annotated type of "section.name", or None for no such key."""
    section_name, _, name = key.replace("-", "_").partition(".")
    section = getattr(cfg, section_name, None)
    if section is None or not dataclasses.is_dataclass(section):
        return None
    return typing.get_type_hints(type(section)).get(name)


def check_key(cfg, key: str) -> type:
    """The annotated type of "section.name"; an unknown section or key is one ConfigError naming it,
    with the nearest spelling that exists ("did you mean ...?")."""
    key = key.replace("-", "_")
    section_name, _, name = key.partition(".")
    sections = [f.name for f in dataclasses.fields(cfg)]
    if section_name not in sections:
        raise ConfigError(f"{key}: unknown section {section_name!r}{_did_you_mean(section_name, sections)}")
    hints = typing.get_type_hints(type(getattr(cfg, section_name)))
    if not name:
        raise ConfigError(f"{key}: a section, not a key (expected {section_name}.<key>)")
    if name not in hints:
        elsewhere = [f"{s}.{name}" for s in sections if name in typing.get_type_hints(type(getattr(cfg, s)))]
        hint = f", did you mean {elsewhere[0]!r}?" if elsewhere else _did_you_mean(name, list(hints))
        raise ConfigError(f"{key}: unknown key {name!r} in [{section_name}]{hint}")
    return hints[name]


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f", did you mean {close[0]!r}?" if close else ""


def set_key(cfg, key: str, value) -> None:
    """cfg.<section>.<name> = value for key "section.name", checked against the field's type."""
    key = key.replace("-", "_")
    typ = check_key(cfg, key)
    section_name, _, name = key.partition(".")
    setattr(getattr(cfg, section_name), name, coerce(key, value, typ))


def parse_overrides(overrides: list[str], is_flag=lambda key: False, check=lambda key: None) -> list[tuple[str, str]]:
    """["--section.key", "value", "--other.key=value", "--flag", ...] -> [(key, value), ...];
    `is_flag(key)`: a boolean key, true when given without a value; `check(key)` raises for an unknown
    key before its value is looked for (a misspelt flag is "unknown", not "missing value")."""
    pairs, i = [], 0
    while i < len(overrides):
        arg = overrides[i]
        if not arg.startswith("--"):
            raise ConfigError(f"{arg}: expected --section.key value")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        check(key)
        if not eq:
            bare = i + 1 >= len(overrides) or (overrides[i + 1].startswith("--") and not _is_number(overrides[i + 1]))
            if bare and is_flag(key):
                pairs.append((key, "true"))
                i += 1
                continue
            if i + 1 >= len(overrides):
                raise ConfigError(f"{key}: missing value")
            value, i = overrides[i + 1], i + 1
        pairs.append((key, value))
        i += 1
    return pairs


def apply_tables(cfg, raw: dict) -> None:
    """Every {section: {name: value}} of a TOML file (or a saved config) onto cfg."""
    for section_name, section in raw.items():
        if not isinstance(section, dict):
            raise ConfigError(f"{section_name}: expected a [{section_name}] table")
        for name, value in section.items():
            set_key(cfg, f"{section_name}.{name}", value)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
