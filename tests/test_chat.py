"""Conversation data (elr/text/chat.py, elr/text/chat_data.py, prepare_data.py --format chat): the template, the
assistant-only labels on a hand-built example, one conversation per row, exact resume and resharding
of the conversation stream, and bad input refused in one line with nothing written."""

import copy
import importlib.util
import json
import re

import jinja2
import pytest
from trainer_utils import ROOT

from elr.data.loader import build_train_loader
from elr.data.validation import val_batches
from elr.errors import DataError
from elr.text.chat import CHAT_TEMPLATE, encode_conversation, render
from elr.text.chat_data import IGNORE_INDEX, ChatSplit, prepare_chat
from elr.text.tokenizer import build_tokenizer

TOKENIZER = str(ROOT / "data" / "tokenizer" / "elr8k.tiktoken")
TALK = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "5."},
    {"role": "user", "content": "And 4 plus 4?"},
    {"role": "assistant", "content": "It is 8."},
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TOKENIZER)


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def write_jsonl(path, conversations):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


def conversations(n):
    return [
        [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i} " * (1 + i % 5)}]
        for i in range(n)
    ]


def test_jinja_template_renders_what_render_does():
    """Also with Hugging Face's settings (apply_chat_template compiles with trim_blocks and lstrip_blocks)."""
    for settings in ({}, {"trim_blocks": True, "lstrip_blocks": True}):
        jinja = jinja2.Environment(**settings).from_string(CHAT_TEMPLATE)
        for prompt in (False, True):
            assert jinja.render(messages=TALK, add_generation_prompt=prompt) == render(TALK, prompt)
    assert render(TALK[:2], True).endswith("<|user|>\nWhat is 2 plus 3?\n<|assistant|>\n")


def test_scored_tokens_are_exactly_the_assistant_turns_by_hand(tok):
    """Hand-built: the scored ids are the two answers' tokens, each followed by <|endoftext|>."""
    ids, scored = encode_conversation(TALK, tok)
    eot = tok.eot_id
    expected = tok.encode("5.") + [eot] + tok.encode("It is 8.") + [eot]
    assert [i for i, s in zip(ids, scored) if s] == expected
    assert ids == [eot] + tok.encode(
        "<|system|>\nBe brief.\n<|user|>\nWhat is 2 plus 3?\n<|assistant|>\n"
    ) + tok.encode("5.") + [eot] + tok.encode("\n<|user|>\nAnd 4 plus 4?\n<|assistant|>\n") + tok.encode("It is 8.") + [
        eot
    ] + tok.encode("\n")
    # The text between special tokens is one ordinary encoding: the rendered string's tokens.
    assert tok.decode(ids) == render(TALK)
    # A message spelling the special token gets its characters, never the token.
    spelled, _ = encode_conversation([{"role": "user", "content": "<|endoftext|>"}], tok)
    assert spelled.count(eot) == 1


def test_labels_count_exactly_the_assistant_tokens_and_rows_never_share(tmp_path, tok):
    """The loss's label row of a hand-built conversation: its answers, shifted by one, the rest ignored;
    each row starts at a conversation's first token and holds one conversation only (padding ignored)."""
    other = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    src = write_jsonl(tmp_path / "c.jsonl", [TALK, other] * 20)
    prepare_chat([src], tok, TOKENIZER, tmp_path / "d", val_fraction=0.5)
    split = ChatSplit(tmp_path / "d", "train")
    by_length = {len(encoded[0]): encoded for encoded in (encode_conversation(m, tok) for m in (TALK, other))}
    for i in range(split.num_conversations):
        inputs, labels = split.rows([i], seq_len=64)
        ids, scored = by_length[int(split.offsets[i + 1] - split.offsets[i])]
        n = len(ids)
        assert inputs[0, :n].tolist() == ids
        assert inputs[0, n:].eq(tok.eot_id).all()  # padding after the conversation, nothing of another
        want = [t if s else IGNORE_INDEX for t, s in zip(ids[1:], scored[1:])] + [IGNORE_INDEX] * (64 - n + 1)
        assert labels[0].tolist() == want
        assert (labels != IGNORE_INDEX).sum() == sum(scored)  # <|endoftext|> that opens the row is context
    # A row's first input is the conversation's opening <|endoftext|> in every batch the loader serves.
    loader = build_train_loader(str(tmp_path / "d" / "train.bin"), 64, 4, 0, 1, seed=3)
    inputs, labels, _ = next(iter(loader))
    assert inputs[:, 0].eq(tok.eot_id).all() and inputs[:, 1].ne(tok.eot_id).all()


def test_chat_stream_resumes_and_reshards_exactly(tmp_path, tok):
    src = write_jsonl(tmp_path / "c.jsonl", conversations(60))
    prepare_chat([src], tok, TOKENIZER, tmp_path / "d", val_fraction=0.2)
    path = str(tmp_path / "d" / "train.bin")
    n = ChatSplit(tmp_path / "d", "train").num_conversations

    def stream(world, local_bs, steps, position=0):
        loaders = [build_train_loader(path, 48, local_bs, r, world, seed=5) for r in range(world)]
        for loader in loaders:
            loader.dataset.position = position
        its = [iter(loader) for loader in loaders]
        rows = []
        for _ in range(steps):
            for it in its:
                inputs, labels, _ = next(it)
                rows += [tuple(x.tolist()) + tuple(y.tolist()) for x, y in zip(inputs, labels)]
        return rows

    reference = stream(1, 4, 3 * n // 4)  # three epochs
    assert len(set(reference[:n])) == n  # an epoch reads every conversation once
    assert stream(2, 2, 3 * n // 4) == reference and stream(4, 1, 3 * n // 4) == reference
    loader = build_train_loader(path, 48, 2, 1, 2, seed=5)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = copy.deepcopy(loader.state_dict())
    one = build_train_loader(path, 48, 4, 0, 1, seed=5)
    one.load_state_dict(state)
    resumed = [tuple(x.tolist()) + tuple(y.tolist()) for b in take(one, 4) for x, y in zip(b.inputs, b.labels)]
    assert resumed == reference[20:36] and one.dataset.position == 36
    assert stream(2, 2, 4, position=36) == reference[36:52]
    batches = list(val_batches(str(tmp_path / "d" / "val.bin"), 48, 2, 2, 0, 1))
    assert len(batches) == 2 and all(b[0].shape == (2, 48) for b in batches)


BAD = [
    ("{not json", "not valid JSON"),
    (json.dumps({"text": "hi"}), "not a conversation of a known shape (keys: text)"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "unknown role 'robot'"),
    (json.dumps({"messages": [{"role": "user", "content": "only a question"}]}), "no assistant turn"),
    (json.dumps({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}), "not a string"),
    (
        json.dumps({"messages": [{"role": "user", "content": "a " * 200}, {"role": "assistant", "content": "x"}]}),
        "more than --max-tokens 64",
    ),
    (  # "\ud800" is half of a UTF-16 pair: JSON decodes it, UTF-8 cannot encode it
        json.dumps({"messages": [{"role": "user", "content": "hi \ud800"}, {"role": "assistant", "content": "x"}]}),
        "holds the lone surrogate \\ud800",
    ),
    ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested deeper than the parser reads"),
]


@pytest.fixture(scope="module")
def prepare_data():
    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "scripts" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("line, message", BAD)
def test_bad_conversations_fail_in_one_line_naming_file_and_line(tmp_path, line, message, prepare_data, capsys):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(3)) + line + "\n")
    out = tmp_path / "out"
    argv = ["--format", "chat", "--tokenizer", TOKENIZER, "--out", str(out), "--max-tokens", "64", str(src)]
    assert prepare_data.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{src}:4:" in err[0] and message in err[0], err
    assert not out.exists() or not any(out.iterdir())  # nothing half-written


def test_a_conversation_longer_than_the_row_is_refused_by_the_loader(tmp_path, tok):
    src = write_jsonl(tmp_path / "c.jsonl", conversations(30))
    prepare_chat([src], tok, TOKENIZER, tmp_path / "d", val_fraction=0.3)
    with pytest.raises(DataError, match=r"c\.jsonl:\d+\), longer than training.seq_len \+ 1 = 9"):
        build_train_loader(str(tmp_path / "d" / "train.bin"), 8, 2, 0, 1, seed=0)


def test_bundled_conversations_are_prepared_from_their_jsonl(tmp_path, tok, monkeypatch):
    """data/chat's files are what prepare_data.py --format chat makes of data/chat/conversations.jsonl."""
    bundled = ROOT / "data" / "chat"
    monkeypatch.chdir(ROOT)
    meta = prepare_chat(
        [bundled.relative_to(ROOT) / "conversations.jsonl"], tok, TOKENIZER, tmp_path, val_fraction=0.15, max_tokens=129
    )
    for name in ("train.bin", "train.mask.bin", "train.offsets.bin", "val.bin", "val.mask.bin", "val.offsets.bin"):
        assert (tmp_path / name).read_bytes() == (bundled / name).read_bytes(), name
    assert meta["splits"] == json.loads((bundled / "meta.json").read_text())["splits"]


def test_prepare_data_chat_command_writes_a_folder_the_trainer_reads(tmp_path, prepare_data, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", conversations(40))
    assert (
        prepare_data.main(
            [
                "--format",
                "chat",
                "--tokenizer",
                TOKENIZER,
                "--out",
                str(tmp_path / "d"),
                "--val-fraction",
                "0.25",
                str(src),
            ]
        )
        == 0
    )
    assert "scored" in capsys.readouterr().out
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["format"] == "chat" and sum(s["conversations"] for s in meta["splits"].values()) == 40
    assert not list((tmp_path / "d").glob(".*.tmp"))


@pytest.mark.parametrize(
    "text, message",
    [
        ('[{"role": "user", "content": "hi \\ud800"}]', "holds the lone surrogate \\ud800"),
        ("[" * 100_000 + "]" * 100_000, "JSON nested deeper than the parser reads"),
    ],
)
def test_generate_messages_with_a_lone_surrogate_or_deep_nesting_is_one_error(tmp_path, text, message):
    from elr.infer.chat import read_messages

    path = tmp_path / "chat.json"
    path.write_text(text)
    with pytest.raises(DataError, match=re.escape(f"--messages {path}: {message}")):
        read_messages(path)
