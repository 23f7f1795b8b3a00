"""The depth-bound tasks of elr/text/tasks.py as questions in words, for the RLVR stage's built-in prompts
(`rl.prompts = "var_chain"` or `"pointer_chase"`): the same structure, checkable answers, any tokenizer.

    var_chain      "k = 7. c = k. t = 3. w = c. p = t. What is w?"          -> "7"
                   d bindings lead from the queried name to its value, beside a distractor chain, the
                   statements shuffled
    pointer_chase  "3 -> 5. 0 -> 3. 5 -> 1. 1 -> 4. 4 -> 2. 2 -> 0. Start at 3 and follow 2 arrows.
                   Where do you end?"                                       -> "1"
                   the arrows of one random cycle (Sattolo's algorithm), shuffled; d hops

Each source is a fixed list: question g is drawn from its own generator seeded by (SEED, g), so the list,
and the held-out split made from it by a hash of each question, is the same on every machine.
"""

from __future__ import annotations

import random
import string

SEED = 20261206
COUNT = 8192  # questions per source
MAX_HOPS = 4
NAMES = string.ascii_lowercase
CYCLE = 8  # symbols 0..CYCLE-1 in a pointer question


def var_chain(rng: random.Random) -> tuple[str, str]:
    """A chain of d in 1..MAX_HOPS bindings ending in a value, and a distractor chain of its own length."""
    hops = rng.randint(1, MAX_HOPS)
    names = rng.sample(NAMES, 2 * (hops + 1))
    value, other = rng.sample(range(10), 2)
    statements = []
    for chain, end in ((names[: hops + 1], value), (names[hops + 1 :], other)):
        statements.append(f"{chain[-1]} = {end}.")
        statements += [f"{chain[i]} = {chain[i + 1]}." for i in range(hops)]
    rng.shuffle(statements)
    return " ".join(statements) + f" What is {names[0]}?", str(value)


def pointer_chase(rng: random.Random) -> tuple[str, str]:
    """The arrows x -> pi(x) of one random CYCLE-cycle, shuffled, and d in 1..MAX_HOPS hops from a start."""
    pi = list(range(CYCLE))
    for i in range(CYCLE - 1, 0, -1):  # Sattolo: a single cycle, so no short loop ends a chase early
        j = rng.randrange(i)
        pi[i], pi[j] = pi[j], pi[i]
    arrows = [f"{x} -> {pi[x]}." for x in range(CYCLE)]
    rng.shuffle(arrows)
    start, hops = rng.randrange(CYCLE), rng.randint(1, MAX_HOPS)
    end = start
    for _ in range(hops):
        end = pi[end]
    arrow_word = "arrow" if hops == 1 else "arrows"
    return " ".join(arrows) + f" Start at {start} and follow {hops} {arrow_word}. Where do you end?", str(end)


SOURCES = {"var_chain": var_chain, "pointer_chase": pointer_chase}


def questions(source: str, count: int = COUNT) -> list[tuple[str, str]]:
    """The source's fixed (question, answer) list."""
    make = SOURCES[source]
    return [make(random.Random(SEED * 1_000_003 + g)) for g in range(count)]
