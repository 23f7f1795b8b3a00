"""Write the bundled conversation set (data/chat/conversations.jsonl): templated Q&A written for this
repository, so the tiny SFT run (train_configs/sft_debug.toml) has data with a known licence.

    python scripts/make_chat_data.py --out data/chat/conversations.jsonl --count 400 --seed 0

Four kinds, drawn uniformly, each with or without a system line, some two turns long: sums of small
numbers, spelling a word backwards, facts about the bundled prose (Shakespeare's plays, the State of
the Union addresses) and counting letters. Every answer follows from the question by a fixed rule, so
the assistant-token loss on held-out conversations can fall. `--kinds sum` writes the RLVR stage's
arithmetic instead (elr/text/arithmetic.py): three-term sums answered worked or direct, half each,
leaving out the questions the stage holds out for evaluation; `--kinds var_chain` its variable chains
(elr/text/depth_questions.py) the same way, a worked answer following the bindings from the queried name:

    python scripts/make_chat_data.py --kinds sum --count 8000 --out outputs/arith_chat/conversations.jsonl
    python scripts/make_chat_data.py --kinds var_chain --count 8000 --out outputs/var_chat/conversations.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from elr.cli import HelpFormatter
from elr.text import arithmetic, depth_questions

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


def chain_steps(question: str) -> list[str]:
    """A variable-chain question's bindings from the queried name to its value: ["w = c.", "c = 7."]."""
    *statements, query = question.split(". ")
    binding = dict(statement.rstrip(".").split(" = ") for statement in statements)
    name, steps = query.removeprefix("What is ").removesuffix("?"), []
    while not name.isdigit():
        steps.append(f"{name} = {binding[name]}.")
        name = binding[name]
    return steps


def variable_chain(rng: random.Random, pool: list[tuple[str, str]]) -> tuple[str, str]:
    """A chain the RLVR stage asks (never one it holds out), answered by following it or directly."""
    question, answer = rng.choice(pool)
    if rng.random() < 0.5:
        return question, " ".join(chain_steps(question)) + f" The answer is {answer}."
    return question, f"The answer is {answer}."


# The RLVR stage's own prompts, one user turn each: the kinds that stand alone.
RLVR_KINDS = ("sum", "var_chain")

KINDS = {"arithmetic": arithmetic_question, "reverse": reverse, "fact": fact, "letters": letters}


def conversation(rng: random.Random, kinds: list[str], pool: list[tuple[str, str]]) -> dict:
    if kinds[0] in RLVR_KINDS:  # the RLVR stage's prompts: one user turn, no system line
        question, answer = three_term_sum(rng) if kinds == ["sum"] else variable_chain(rng, pool)
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
        choices=[*KINDS, *RLVR_KINDS],
        default=list(KINDS),
        help="the kinds drawn (uniformly); `sum` or `var_chain` alone: the RLVR stage's prompts",
    )
    args = p.parse_args(argv)
    alone = [k for k in args.kinds if k in RLVR_KINDS]
    if alone and len(args.kinds) > 1:
        p.error(f"--kinds {alone[0]} stands alone (the RLVR stage's prompts, one user turn each)")
    pool = []
    if args.kinds == ["var_chain"]:
        from elr.rl.prompts import from_question, is_held_out  # imports torch: after --help

        pool = [(q, a) for q, a in depth_questions.questions("var_chain") if not is_held_out(from_question(q, a))]
    rng = random.Random(args.seed)
    lines = [json.dumps(conversation(rng, args.kinds, pool)) for _ in range(args.count)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(args.out)
    print(f"{args.count} conversations -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
