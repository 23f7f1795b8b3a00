"""Property-based fuzzing of what users hand the program: CLI overrides, TOML config files, prepared
token files, chat JSONL and generate.py's arguments. Every input ends in success or in one of the
user-error classes that train.py and the scripts turn into one line and a non-zero exit, never another
exception (a traceback), and nothing is written outside the test's own folder. The default tier runs a
short form; the slow tier the same properties with many more examples."""

from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
from export_utils import script
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trainer_utils import ROOT, run

from elr.config import load_config
from elr.config.reference import config_keys
from elr.data.token_files import load_tokens
from elr.errors import UserError
from elr.infer.cache import MODES
from elr.text.chat_data import prepare_chat
from elr.text.tokenizer import build_tokenizer

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
    meta = st.fixed_dictionaries(
        {},
        optional={
            "dtype": st.sampled_from(["uint16", "uint32", "int8", "float32", ""]),
            "vocab_size": st.one_of(st.integers(-5, 2**33), text),
            "splits": st.one_of(
                st.just({}),
                st.fixed_dictionaries(
                    {
                        "train": st.fixed_dictionaries(
                            {}, optional={"tokens": st.integers(-1, 100), "max_token_id": st.integers(-1, 2**20)}
                        )
                    }
                ),
                text,
            ),
        },
    )

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
    turn = st.fixed_dictionaries(
        {},
        optional={
            "role": st.one_of(st.sampled_from(["user", "assistant", "system"]), text),
            "content": st.one_of(text, st.integers(), st.none()),
        },
    )
    record = st.one_of(
        st.fixed_dictionaries({"messages": st.lists(turn, max_size=4)}),
        st.fixed_dictionaries({"prompt": text, "completion": st.one_of(text, st.integers())}),
        st.dictionaries(text, text, max_size=2),
    )

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.one_of(record.map(json.dumps), text), min_size=1, max_size=6), st.floats(0.0, 1.0))
    def prop(lines, val_fraction):
        src = folder / "c.jsonl"
        src.write_text("\n".join(lines) + "\n")
        ends_cleanly(lambda: prepare_chat([src], TOKENIZER, "elr8k.tiktoken", folder / "out", val_fraction, 64))
        assert {p.name for p in folder.iterdir()} <= {"c.jsonl", "out"}

    prop()


def files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def generate_property(examples: int, checkpoint: Path):
    """generate.py's flags with plausible values, the edges of their ranges and, one flag in six, junk,
    over a tiny checkpoint; at most 3 new tokens a prompt, so a run that succeeds costs a few forwards."""
    generate = script("generate")
    ints = st.one_of(st.integers(-2, 4), st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30]))
    floats = st.one_of(
        st.sampled_from([0.0, 1e-300, 1e-45, 0.5, 1.0, 2.0]), st.floats(allow_nan=True, allow_infinity=True)
    )
    loop_lists = st.lists(st.integers(-1, 5), min_size=1, max_size=4).map(lambda ks: ",".join(map(str, ks)))
    flags = {
        "--loops": loop_lists,
        "--budgets": loop_lists,
        "--draft-loops": ints.map(str),
        "--draft-tokens": ints.map(str),
        "--max-new-tokens": st.one_of(st.integers(-1, 3), st.sampled_from([10**11, 2**63, 10**30])).map(str),
        "--temperature": floats.map(str),
        "--top-p": floats.map(str),
        "--top-k": ints.map(str),
        "--exit": st.tuples(st.sampled_from(["kl", "state"]), floats).map(lambda r: f"{r[0]}:{r[1]}"),
        "--kv": st.sampled_from(MODES),
        "--seed": ints.map(str),
        "--memory": ints.map(str),
        "--dtype": st.sampled_from(["float32", "bfloat16"]),
        "--prompt": st.text(
            st.characters(codec="utf-8") | st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF), max_size=12
        ),  # what Python makes of bytes that are not UTF-8 on a command line
    }
    names = st.sampled_from(sorted(flags))
    plausible = names.flatmap(lambda f: flags[f].map(lambda v: (f, v)))
    before = files(checkpoint.parent)

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.one_of(*[plausible] * 5, st.tuples(names, text)), max_size=4))
    def prop(pairs):
        argv = ["--checkpoint", str(checkpoint), "--max-new-tokens", "2", *[x for pair in pairs for x in pair]]
        err = io.StringIO()
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            try:
                code = generate.main(argv)
            except SystemExit as e:  # argparse's usage and one error line
                code = e.code
        errors = [line for line in err.getvalue().splitlines() if "error:" in line]
        assert (code, errors) == (0, []) or (code == 2 and len(errors) == 1), (argv, err.getvalue())
        assert files(checkpoint.parent) == before

    prop()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The debug flavor (K = 3) after one step: the model of `python train.py`, as generate.py reads it."""
    dump = tmp_path_factory.mktemp("fuzz") / "run"
    run(dump, 1, "--checkpoint.enable", "true")
    return dump / "checkpoint" / "step-1"


PROPERTIES = [overrides_property, toml_property, token_file_property, chat_property, generate_property]


def check(prop, examples: int, tmp_path: Path, request) -> None:
    if prop is overrides_property:
        prop(examples)
    elif prop is generate_property:
        prop(examples // 4, request.getfixturevalue("checkpoint"))  # a model load each: a quarter as many
    else:
        prop(examples, tmp_path)


@pytest.mark.parametrize("prop", PROPERTIES, ids=lambda p: p.__name__)
def test_every_input_ends_in_success_or_one_user_error(prop, tmp_path, monkeypatch, request):
    monkeypatch.setenv("ELR_CACHE", str(tmp_path / "cache"))  # load_tokens' cache, inside the test's folder
    check(prop, 40, tmp_path, request)


@pytest.mark.slow
@pytest.mark.parametrize("prop", PROPERTIES, ids=lambda p: p.__name__)
def test_every_input_ends_in_success_or_one_user_error_at_length(prop, tmp_path, monkeypatch, request):
    monkeypatch.setenv("ELR_CACHE", str(tmp_path / "cache"))
    check(prop, 1500, tmp_path, request)
