"""Property-based fuzzing of what users hand the program: CLI overrides, TOML config files, prepared
token files and chat JSONL. Every input ends in success or in one of the user-error classes that
train.py and the scripts turn into one line and a non-zero exit, never another exception (a traceback),
and nothing is written outside the test's own folder. The default tier runs a short form; the slow
tier the same properties with many more examples."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elr.config import load_config
from elr.config.reference import config_keys
from elr.errors import UserError
from elr.text.chat_data import prepare_chat
from elr.text.tokenizer import build_tokenizer
from elr.train.token_files import load_tokens
from trainer_utils import ROOT

USER_ERRORS = (UserError, FileNotFoundError)  # what train.py prints in one line (exit 2)
KEYS = [f"{section}.{name}" for section, _, keys in config_keys() for name, *_ in keys]
SECTIONS = sorted({k.split(".")[0] for k in KEYS})
TOKENIZER = build_tokenizer(str(ROOT / "data" / "tokenizer" / "elr8k.tiktoken"))

text = st.text(max_size=12)
numbers = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True))
scalars = st.one_of(text, numbers, st.booleans())
values = st.one_of(scalars, st.lists(scalars, max_size=4))


def cli_value(value) -> str:
    if isinstance(value, list):
        return ",".join(cli_value(v) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def toml_value(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    return json.dumps(value)  # a TOML basic string


def ends_cleanly(call) -> None:
    try:
        call()
    except USER_ERRORS:
        pass


def overrides_property(examples: int):
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.one_of(st.sampled_from(KEYS), text), values), min_size=1, max_size=4))
    def prop(pairs):
        argv = [x for key, value in pairs for x in (f"--{key}", cli_value(value))]
        ends_cleanly(lambda: load_config(None, argv))
    prop()


def toml_property(examples: int, folder: Path):
    table = st.dictionaries(st.one_of(st.sampled_from([k.split(".")[1] for k in KEYS]), text), values, max_size=4)

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(st.one_of(st.sampled_from(SECTIONS), text), table, max_size=3), st.binary(max_size=40))
    def prop(doc, noise):
        path = folder / "job.toml"
        lines = []
        for section, keys in doc.items():
            lines.append(f"[{json.dumps(section)}]")
            lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in keys.items()]
        path.write_bytes("\n".join(lines).encode() + (b"\n" + noise if noise else b""))
        ends_cleanly(lambda: load_config(path))
    prop()


def token_file_property(examples: int, folder: Path):
    meta = st.fixed_dictionaries({}, optional={
        "dtype": st.sampled_from(["uint16", "uint32", "int8", "float32", ""]), "vocab_size": st.one_of(st.integers(-5, 2**33), text),
        "splits": st.one_of(st.just({}), st.fixed_dictionaries({"train": st.fixed_dictionaries({}, optional={
            "tokens": st.integers(-1, 100), "max_token_id": st.integers(-1, 2**20)})}), text)})

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=64), st.one_of(meta.map(json.dumps), text))
    def prop(data, meta_text):
        data_dir = folder / "data"
        data_dir.mkdir(exist_ok=True)
        (data_dir / "train.bin").write_bytes(data)
        (data_dir / "meta.json").write_text(meta_text)
        ends_cleanly(lambda: np.asarray(load_tokens(data_dir / "train.bin")).sum())
    prop()


def chat_property(examples: int, folder: Path):
    turn = st.fixed_dictionaries({}, optional={"role": st.one_of(st.sampled_from(["user", "assistant", "system"]), text),
                                               "content": st.one_of(text, st.integers(), st.none())})
    record = st.one_of(st.fixed_dictionaries({"messages": st.lists(turn, max_size=4)}),
                       st.fixed_dictionaries({"prompt": text, "completion": st.one_of(text, st.integers())}),
                       st.dictionaries(text, text, max_size=2))

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.one_of(record.map(json.dumps), text), min_size=1, max_size=6), st.floats(0.0, 1.0))
    def prop(lines, val_fraction):
        src = folder / "c.jsonl"
        src.write_text("\n".join(lines) + "\n")
        ends_cleanly(lambda: prepare_chat([src], TOKENIZER, "elr8k.tiktoken", folder / "out", val_fraction, 64))
        assert {p.name for p in folder.iterdir()} <= {"c.jsonl", "out"}
    prop()


@pytest.mark.parametrize("prop", [overrides_property, toml_property, token_file_property, chat_property],
                         ids=lambda p: p.__name__)
def test_every_input_ends_in_success_or_one_user_error(prop, tmp_path, monkeypatch):
    monkeypatch.setenv("ELR_CACHE", str(tmp_path / "cache"))  # load_tokens' cache, inside the test's folder
    prop(40) if prop is overrides_property else prop(40, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("prop", [overrides_property, toml_property, token_file_property, chat_property],
                         ids=lambda p: p.__name__)
def test_every_input_ends_in_success_or_one_user_error_at_length(prop, tmp_path, monkeypatch):
    monkeypatch.setenv("ELR_CACHE", str(tmp_path / "cache"))
    prop(1500) if prop is overrides_property else prop(1500, tmp_path)
