"""The conversation shapes prepare_data.py --format chat reads (elr/text/chat_formats.py): each one gives the
same messages as its plain `messages` form, trains the turns the README says, and an unknown shape is
one error naming the file and line."""

import importlib.util
import json

import pytest
from trainer_utils import ROOT

from elr.errors import DataError
from elr.text.chat import encode_conversation
from elr.text.chat_data import ChatSplit, prepare_chat
from elr.text.chat_formats import read_record
from elr.text.tokenizer import build_tokenizer

TOKENIZER = str(ROOT / "data" / "tokenizer" / "elr8k.tiktoken")
PLAIN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "5."},
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TOKENIZER)


def trained_text(record, tok) -> str:
    """The scored tokens of a record, decoded (<|endoftext|> included)."""
    messages, trained = read_record(record, "x.jsonl:1")
    ids, scored = encode_conversation(messages, tok, trained=trained)
    return tok.decode([i for i, s in zip(ids, scored) if s])


def test_messages_are_read_as_they_are(tok):
    assert read_record({"messages": PLAIN, "id": 7}, "x:1") == (PLAIN, [True, True, True])  # other keys ignored
    assert read_record({"conversations": PLAIN}, "x:1") == (PLAIN, [True, True, True])  # the other name
    assert trained_text({"messages": PLAIN}, tok) == "5.<|endoftext|>"


def test_sharegpt_maps_its_speakers_to_roles(tok):
    record = {
        "conversations": [{"from": "human", "value": "What is 2 plus 3?"}, {"from": "gpt", "value": "5."}],
        "system": "Be brief.",
    }
    assert read_record(record, "x:1")[0] == PLAIN
    assert trained_text(record, tok) == "5.<|endoftext|>"
    tools = {
        "conversations": [
            {"from": "human", "value": "Weather?"},
            {"from": "function_call", "value": "get()"},
            {"from": "observation", "value": "sunny"},
            {"from": "gpt", "value": "Sunny."},
        ]
    }
    assert [m["role"] for m in read_record(tools, "x:1")[0]] == ["user", "assistant", "tool", "assistant"]
    assert trained_text(tools, tok) == "get()<|endoftext|>Sunny.<|endoftext|>"


def test_prompt_completion_trains_the_completion_only(tok):
    strings = {"prompt": "What is 2 plus 3?", "completion": "5."}
    assert read_record(strings, "x:1") == (PLAIN[1:], [False, True])
    assert trained_text(strings, tok) == "5.<|endoftext|>"
    lists = {
        "prompt": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?"},
        ],
        "completion": [{"role": "assistant", "content": "6."}],
    }
    assert trained_text(lists, tok) == "6.<|endoftext|>"  # the prompt's assistant turn is context
    assert trained_text({"messages": lists["prompt"] + lists["completion"]}, tok) == "4.<|endoftext|>6.<|endoftext|>"


def test_tool_turns_and_calls_are_rendered_and_only_the_assistant_trains(tok):
    record = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "sunny, 21 C"},
            {"role": "assistant", "content": [{"type": "text", "text": "Sunny, "}, {"type": "text", "text": "21 C."}]},
        ]
    }
    messages, _ = read_record(record, "x:1")
    call = '<|tool_call|>{"name": "weather", "arguments": {"city": "Paris"}}'
    assert messages[1] == {"role": "assistant", "content": call}
    assert messages[2] == {"role": "tool", "content": "sunny, 21 C"} and messages[3]["content"] == "Sunny, 21 C."
    assert trained_text(record, tok) == f"{call}<|endoftext|>Sunny, 21 C.<|endoftext|>"
    both = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [{"name": "look", "arguments": {}}]},
        ]
    }
    assert read_record(both, "x:1")[0][1]["content"] == 'Checking.\n<|tool_call|>{"name": "look", "arguments": {}}'


@pytest.mark.parametrize(
    "record, message",
    [
        ({"text": "hi"}, "not a conversation of a known shape (keys: text)"),
        ({"prompt": "only a prompt"}, "not a conversation of a known shape"),
        ({"chosen": [], "rejected": []}, "not a conversation of a known shape (keys: chosen, rejected)"),
        ({"messages": PLAIN, "conversations": PLAIN}, "not a conversation of a known shape"),
        ({"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]}, "both be strings or both be lists"),
        (
            {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "a"}]},
            "the completion has no assistant turn",
        ),
        ({"conversations": [{"from": "robot", "value": "x"}]}, "unknown \"from\" 'robot'"),
        ({"conversations": [{"from": "gpt", "value": "x", "weight": 0}]}, 'turn 0 of "conversations" must be'),
        ({"messages": [{"role": "user", "content": "q", "weight": 1}]}, "unknown key(s) weight"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "not a string or a list of text parts"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"x": 1}]}]},
            "a tool call without a function name",
        ),
        ([1, 2], "expected a JSON object, got list"),
    ],
)
def test_unknown_shapes_are_one_error(record, message):
    with pytest.raises(DataError) as err:
        read_record(record, "c.jsonl:4")
    assert str(err.value).startswith("c.jsonl:4: ") and message in str(err.value), str(err.value)


def test_prepare_data_reads_every_shape_into_one_folder(tmp_path, tok):
    """A file mixing the shapes: the same token files as the plain messages of the same conversations."""

    def talk(i):
        return [{"role": "user", "content": f"What is {i} plus 3?"}, {"role": "assistant", "content": f"{i + 3}."}]

    def shaped(i):
        (user, assistant) = talk(i)
        return [
            {"messages": talk(i)},
            {
                "conversations": [
                    {"from": "human", "value": user["content"]},
                    {"from": "gpt", "value": assistant["content"]},
                ]
            },
            {"prompt": user["content"], "completion": assistant["content"]},
            {"prompt": [user], "completion": [assistant]},
        ][i % 4]

    for name, records in (
        ("mixed", [shaped(i) for i in range(24)]),
        ("plain", [{"messages": talk(i)} for i in range(24)]),
    ):
        src = tmp_path / f"{name}.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in records))
        prepare_chat([src], tok, TOKENIZER, tmp_path / name, val_fraction=0.3)
    for split in ("train", "val"):
        a, b = ChatSplit(tmp_path / "mixed", split), ChatSplit(tmp_path / "plain", split)
        assert a.tokens.tolist() == b.tokens.tolist() and a.mask.tolist() == b.mask.tolist()


def test_prepare_data_names_the_line_of_an_unknown_shape(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "scripts" / "prepare_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"prompt": "q", "completion": "a"}) + "\n\n" + json.dumps({"input": "q", "output": "a"}))
    out = tmp_path / "out"
    assert script.main(["--format", "chat", "--tokenizer", TOKENIZER, "--out", str(out), str(src)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{src}:3: not a conversation of a known shape (keys: input, output)" in err[0], err
    assert not out.exists() or not any(out.iterdir())
