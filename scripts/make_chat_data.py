"""Write the bundled conversation set (data/chat/conversations.jsonl): templated Q&A written for this
repository, so the tiny SFT run (train_configs/sft_debug.toml) has data with a known licence.

    python scripts/make_chat_data.py --out data/chat/conversations.jsonl --count 400 --seed 0

Four kinds, drawn uniformly, each with or without a system line, some two turns long: sums of small
numbers, spelling a word backwards, facts about the bundled prose (Shakespeare's plays, the State of
the Union addresses) and counting letters. Every answer follows from the question by a fixed rule, so
the assistant-token loss on held-out conversations can fall. `--kinds sum` writes the RLVR stage's
arithmetic instead (elr/text/arithmetic.py): three-term sums answered worked or direct, half each,
leaving out the questions the stage holds out for evaluation:

    python scripts/make_chat_data.py --kinds sum --count 8000 --out outputs/arith_chat/conversations.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from elr.cli import HelpFormatter
from elr.text import arithmetic

WORDS = (
    "king",
    "crown",
    "storm",
    "night",
    "sword",
    "honour",
    "letter",
    "garden",
    "nation",
    "union",
    "river",
    "winter",
    "castle",
    "music",
    "ghost",
    "friend",
    "market",
    "harvest",
    "ship",
    "forest",
)
PLAYS = {
    "Hamlet": "Denmark",
    "Macbeth": "Scotland",
    "Othello": "Venice",
    "Romeo and Juliet": "Verona",
    "The Tempest": "an island",
    "Julius Caesar": "Rome",
    "King Lear": "Britain",
    "Twelfth Night": "Illyria",
}
FACTS = [
    ("Who wrote Hamlet?", "William Shakespeare wrote Hamlet."),
    ("Who gives the State of the Union address?", "The President of the United States gives it."),
    ("To whom is the State of the Union address given?", "It is given to the Congress."),
    ("Is Shakespeare's prose in the public domain?", "Yes, his plays are in the public domain."),
]
SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You answer questions in one sentence.")


def arithmetic_question(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."


def reverse(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Spell the word {word} backwards.", f"{word} backwards is {word[::-1]}."


def fact(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.7:
        play = rng.choice(sorted(PLAYS))
        return f"Where is Shakespeare's {play} set?", f"{play} is set in {PLAYS[play]}."
    return rng.choice(FACTS)


def letters(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"How many letters are in the word {word}?", f"The word {word} has {len(word)} letters."


def three_term_sum(rng: random.Random) -> tuple[str, str]:
    """A sum the RLVR stage asks (never one it holds out), answered with its partial sums or directly."""
    from elr.rl.prompts import from_question, is_held_out

    while True:
        terms = arithmetic.draw_sum(rng)
        question = arithmetic.question(terms)
        if not is_held_out(from_question(question, str(sum(terms)))):
            break
    return question, (arithmetic.worked_answer(terms) if rng.random() < 0.5 else arithmetic.direct_answer(terms))


KINDS = {"arithmetic": arithmetic_question, "reverse": reverse, "fact": fact, "letters": letters}


def conversation(rng: random.Random, kinds: list[str]) -> dict:
    if kinds == ["sum"]:  # the RLVR stage's prompts: one user turn, no system line
        question, answer = three_term_sum(rng)
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
    for _ in range(2 if rng.random() < 0.25 else 1):
        question, answer = KINDS[rng.choice(kinds)](rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--out", type=Path, default=Path("data/chat/conversations.jsonl"), help="the JSONL file to write")
    p.add_argument("--count", type=int, default=400, help="conversations")
    p.add_argument("--seed", type=int, default=0, help="seed of the templated questions and answers")
    p.add_argument(
        "--kinds",
        nargs="+",
        choices=[*KINDS, "sum"],
        default=list(KINDS),
        help="the kinds drawn (uniformly); `sum` alone: the RLVR stage's arithmetic",
    )
    args = p.parse_args(argv)
    if "sum" in args.kinds and len(args.kinds) > 1:
        p.error("--kinds sum stands alone (the RLVR stage's arithmetic, one user turn each)")
    rng = random.Random(args.seed)
    lines = [json.dumps(conversation(rng, args.kinds)) for _ in range(args.count)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(args.out)
    print(f"{args.count} conversations -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
