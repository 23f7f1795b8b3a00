"""SFT end to end: a run from another run's checkpoint on conversations scores exactly the assistant
tokens, resumes exactly, and its checkpoint chats through scripts/generate.py at any k."""

from __future__ import annotations

import importlib.util
import io
import json

import pytest
from trainer_utils import ROOT, losses, records, run

from elr.config import load_config
from elr.infer import chat
from elr.infer.evaluate import chat_validation_loss
from elr.infer.load import load_model, load_tokenizer, run_config
from elr.models.early_exit import ExitRule
from elr.text.chat_data import IGNORE_INDEX, ChatSplit
from elr.train.trainer import Trainer

SFT_TOML = ROOT / "train_configs" / "sft_debug.toml"
CHAT_DATA = ROOT / "data" / "chat"


def sft_overrides(dump, pretrained, steps, *extra):
    return [
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        str(steps),
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
        "--validation.steps",
        "1",
        "--validation.freq",
        "0",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--lr_scheduler.warmup_steps",
        "1",
        "--checkpoint.initial_load_path",
        str(pretrained),
        "--data.path",
        str(CHAT_DATA),
        "--tokenizer.path",
        str(ROOT / "data" / "tokenizer" / "elr8k.tiktoken"),
        *extra,
    ]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A one-step quick-start run at the SFT rows' length, saved."""
    dump = tmp_path_factory.mktemp("sft") / "pre"
    run(dump, 1, "--training.seq_len", "128", "--checkpoint.enable", "true")
    return dump / "checkpoint"


def test_an_sft_step_scores_exactly_the_assistant_tokens_and_resumes_exactly(pretrained, tmp_path):
    trainer = Trainer(load_config(SFT_TOML, sft_overrides(tmp_path / "a", pretrained, 3)))
    try:
        split = ChatSplit(CHAT_DATA, "train")
        dataset = trainer.train_loader.dataset
        rows = [split.rows([dataset.conversation(g)], 128)[1] for g in range(4)]  # this update's 2 x 2 rows
        expected = sum(int((labels != IGNORE_INDEX).sum()) for labels in rows)
        stats = trainer.train_step(1)
        per_k = stats.per_k
        assert per_k[1].sum().item() == expected  # the loss's denominator: assistant tokens only
        assert expected == sum(
            int(split.mask[split.offsets[i] + 1 : split.offsets[i + 1]].sum())
            for i in (dataset.conversation(g) for g in range(4))
        )
    finally:
        trainer.close()
    straight = run_sft(tmp_path / "b", pretrained, 3, "--validation.freq", "3")
    run_sft(tmp_path / "c", pretrained, 2)
    resumed = run_sft(tmp_path / "c", pretrained, 3)  # resumes its own step-2, not the initial weights
    assert resumed == straight
    # scripts/evaluate.py's loss on a chat folder is the trainer's validation: the same rows and labels
    val = [r for r in records(tmp_path / "b") if "val/loss_k1" in r][-1]
    model, _ = load_model(tmp_path / "b" / "checkpoint" / "step-3")
    for k in (1, 3):
        assert chat_validation_loss(model, CHAT_DATA, 128, k, 1, 2) == pytest.approx(val[f"val/loss_k{k}"], rel=1e-5)


def run_sft(dump, pretrained, steps, *extra):
    trainer = Trainer(
        load_config(SFT_TOML, sft_overrides(dump, pretrained, steps, "--checkpoint.interval", "1", *extra))
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    return losses(dump)


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chat_reply_repl_and_generate_script(pretrained, tmp_path, capsys, monkeypatch):
    step = next(pretrained.glob("step-*"))
    model, cfg = load_model(step)
    tokenizer = load_tokenizer(cfg)
    talk = [{"role": "user", "content": "What is 2 plus 2?"}]
    answers = {k: chat.reply(model, tokenizer, talk, k, 6) for k in (1, 3)}
    messages = tmp_path / "talk.json"
    messages.write_text(json.dumps(talk))
    generate = script("generate")
    assert (
        generate.main(
            ["--checkpoint", str(step), "--messages", str(messages), "--loops", "1,3", "--max-new-tokens", "6"]
        )
        == 0
    )
    assert capsys.readouterr().out == f"--- k=1\n{answers[1]}\n--- k=3\n{answers[3]}\n"

    out = io.StringIO()
    chat.repl(
        model,
        tokenizer,
        1,
        6,
        io.StringIO(
            "What is 2 plus 2?\n/loops 3\n/loops 9\nWhat is 2 plus 2?\n"
            "/loops x\n/reset\n/loops auto\nWhat is 2 plus 2?\n/quit\n"
            "never read\n"
        ),
        out,
        exit_rule=ExitRule("state", 1e-12),
    )
    lines = out.getvalue().splitlines()
    assert lines[1] == f"assistant (k=1): {answers[1]}" and lines[2] == "(k=3)"
    assert lines[3] == "(k=9)" and lines[4].startswith("error: loops=9 is outside 1..3")  # the conversation is kept
    assert lines[5] == "/loops takes a loop count >= 1 or auto, not 'x'" and lines[6] == "(conversation cleared)"
    # auto under a rule nothing passes: every token runs the cap, K = 3
    assert lines[7] == "(k=auto: exit rule state:1e-12, at most 3 loops)"
    assert lines[8] == f"assistant (k=auto, 3.00 loops per token): {answers[3]}"
    assert len(lines) == 9

    monkeypatch.setattr("sys.stdin", io.StringIO("What is 2 plus 2?\n"))
    assert generate.main(["--checkpoint", str(step), "--chat", "--loops", "3", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == f"assistant (k=3): {answers[3]}"

    for bad, message in (
        (talk + [{"role": "assistant", "content": "4"}], "the last message is the assistant's"),
        ([{"role": "robot", "content": "hi"}], "unknown role 'robot'"),
    ):
        messages.write_text(json.dumps(bad))
        assert generate.main(["--checkpoint", str(step), "--messages", str(messages)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and str(messages) in err[0]
    assert run_config(step)["training"]["seq_len"] == 128
