"""The RLVR stage's prompts: questions with reference answers, encoded with the chat template.

The sources (`rl.prompts`): a JSONL file, one `{"prompt": ..., "answer": ...}` per line, the prompt a
string (one user turn) or a list of chat messages (a system turn, earlier turns); `arithmetic`, every
sum elr/text/arithmetic.py asks; or `var_chain` / `pointer_chase`, the depth-bound tasks in words
(elr/text/depth_questions.py). One prompt in HELD_OUT (by a hash of its text) is held out for
evaluation, so the split does not depend on the file's order. Each step draws its prompts from (seed,
step) alone: every epoch is a fresh permutation, and a resumed or resharded run draws the same ones.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from elr.errors import DataError
from elr.text import arithmetic, depth_questions
from elr.text.chat import check_messages, encode_conversation, render
from elr.text.tokenizer import Tokenizer

HELD_OUT = 16
BUILT_IN = ("arithmetic", *depth_questions.SOURCES)  # the sources `rl.prompts` may name instead of a file


@dataclass(frozen=True)
class Prompt:
    messages: tuple[tuple[str, str], ...]  # (role, content) turns, ending before the assistant's answer
    answer: str

    @property
    def text(self) -> str:
        """What the reward and the sample table see: the rendered turns."""
        return render([{"role": r, "content": c} for r, c in self.messages], add_generation_prompt=True)

    def encode(self, tokenizer: Tokenizer) -> list[int]:
        ids, _ = encode_conversation(
            [{"role": r, "content": c} for r, c in self.messages], tokenizer, add_generation_prompt=True
        )
        return ids


def from_question(question: str, answer: str) -> Prompt:
    return Prompt((("user", question),), answer)


def read_jsonl(path: Path) -> list[Prompt]:
    """Every line a prompt with its answer; one DataError naming the file and line otherwise."""
    if not path.is_file():
        raise DataError(
            f'rl.prompts: {path} is not a file (a JSONL file of {{"prompt", "answer"}}, or one of '
            f"{', '.join(BUILT_IN)})"
        )
    prompts = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"rl.prompts: {path} is not UTF-8 text ({e})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"rl.prompts: {path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not JSON ({e})") from None
        if not isinstance(record, dict) or set(record) - {"prompt", "answer"}:
            raise DataError(f'{where}: expected an object with "prompt" and "answer" only, got {line[:120]!r}')
        if (
            "answer" not in record
            or not isinstance(record["answer"], (str, int, float))
            or isinstance(record["answer"], bool)
        ):
            raise DataError(f'{where}: needs an "answer" (a string or a number)')
        prompt = record.get("prompt")
        if isinstance(prompt, str) and prompt.strip():
            prompts.append(from_question(prompt, str(record["answer"])))
        elif isinstance(prompt, list):
            messages = check_messages(prompt, where, need_assistant=False)
            if messages[-1]["role"] == "assistant":
                raise DataError(f"{where}: the prompt's last turn is the assistant's; the completion is its answer")
            prompts.append(Prompt(tuple((m["role"], m["content"]) for m in messages), str(record["answer"])))
        else:
            raise DataError(f'{where}: "prompt" must be a non-empty string or a list of chat messages')
    if not prompts:
        raise DataError(f"rl.prompts: {path} holds no prompt")
    return prompts


def load_prompts(source: str) -> list[Prompt]:
    if source == "arithmetic":
        return [from_question(arithmetic.question(terms), str(sum(terms))) for terms in arithmetic.all_sums()]
    if source in depth_questions.SOURCES:
        return [from_question(question, answer) for question, answer in depth_questions.questions(source)]
    return read_jsonl(Path(source))


def is_held_out(prompt: Prompt) -> bool:
    """One prompt in HELD_OUT, by a hash of its text: the same verdict for the same prompt anywhere (the
    SFT data of scripts/make_chat_data.py leaves these questions out)."""
    return int.from_bytes(hashlib.sha256(prompt.text.encode()).digest()[:8], "little") % HELD_OUT == 0


def split(prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts): one in HELD_OUT by a hash of the prompt's text."""
    held = [is_held_out(p) for p in prompts]
    train = [p for p, h in zip(prompts, held) if not h]
    val = [p for p, h in zip(prompts, held) if h]
    if not train or not val:
        raise DataError(
            f"rl.prompts: {len(prompts)} prompts leave none for {'training' if not train else 'evaluation'} "
            f"(one in {HELD_OUT} is held out by a hash of its text); give more prompts"
        )
    return train, val


def drawn(n_prompts: int, seed: int, step: int, count: int) -> list[int]:
    """The indices of step `step`'s `count` prompts: positions (step - 1) * count .. of an endless sequence of
    epochs, each a permutation seeded by (seed, epoch)."""
    first = (step - 1) * count
    orders: dict[int, list[int]] = {}
    out = []
    for position in range(first, first + count):
        epoch, index = divmod(position, n_prompts)
        if epoch not in orders:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            orders[epoch] = torch.randperm(n_prompts, generator=gen).tolist()
        out.append(orders[epoch][index])
    return out
