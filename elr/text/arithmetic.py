"""Sums as questions with checkable answers: the RLVR stage's built-in prompts and the chat data that
teaches a model to answer them (scripts/make_chat_data.py --kinds sum).

    question  "What is 7 plus 12 plus 5?"
    answers   worked  "7 plus 12 is 19. 19 plus 5 is 24. The answer is 24."
              direct  "The answer is 24."

A worked answer writes each partial sum out (tokens that do the arithmetic), a direct one does it in
the network: a model taught both can be asked which it prefers at each loop count (the paper's claim
that loops stand in for chain-of-thought tokens, arXiv 2610.12582).
"""

from __future__ import annotations

import random

TERMS, MAX_TERM = 3, 20


def question(terms: list[int]) -> str:
    return "What is " + " plus ".join(map(str, terms)) + "?"


def worked_answer(terms: list[int]) -> str:
    steps, total = [], terms[0]
    for term in terms[1:]:
        steps.append(f"{total} plus {term} is {total + term}.")
        total += term
    return " ".join(steps) + f" The answer is {total}."


def direct_answer(terms: list[int]) -> str:
    return f"The answer is {sum(terms)}."


def all_sums(n_terms: int = TERMS, max_term: int = MAX_TERM) -> list[list[int]]:
    """Every sum of n_terms numbers in 0..max_term, in a fixed order (9261 for 3 terms up to 20)."""
    sums = [[]]
    for _ in range(n_terms):
        sums = [s + [t] for s in sums for t in range(max_term + 1)]
    return sums


def draw_sum(rng: random.Random, n_terms: int = TERMS, max_term: int = MAX_TERM) -> list[int]:
    return [rng.randint(0, max_term) for _ in range(n_terms)]
