"""Depth-bound synthetic tasks: data on which loops must matter, with answers known by construction.

Each task draws examples of a given difficulty d (hops, or nesting depth) as fixed-length token rows;
the answer is the last token and the only one scored (every other label is the loss's ignore index).
Their vocabularies are tiny and fixed, so no tokenizer is involved.

    pointer_chase  the pairs x -> pi(x) of a random N-cycle in shuffled order, then a query (x, d);
                   the answer is pi^d(x). One hop is one lookup among the pairs, so d hops take about
                   d layers of attention (or log d with pointer doubling), whatever the width.
    var_chain      variable binding: statements "a = b" and "a = 7" in random order, then a query name;
                   the answer is the value its chain of d bindings ends in, among distractor chains.

Streams (elr/data/loader.py's TaskDataset, elr/infer/evaluate.py) take example g of a stream from its
own generator seeded by (seed, stream, g), so a position is the whole state. Train and validation are
split by a hash of the example's tokens (1 in VAL_BUCKETS buckets is validation), so no validation
example is ever trained on, and both follow the same distribution.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100  # the loss's ignore index (elr/train/loss.py): labels that add nothing
VAL_BUCKETS = 64
TRAIN, VAL = 0, 1  # stream ids


class PointerChase:
    """k-hop pointer chasing over a random N-cycle (Sattolo's algorithm: a single cycle, so pi^d(x)
    differs from pi^e(x) for d != e < N and no short cycle lets a model stop early). Hops stop at
    N / 2: on an N-cycle pi^d is pi^-(N-d), so d > N / 2 hops forward are N - d lookups backward.

    Each pair x -> pi(x) is one token (x N + pi(x)), so one hop is one attention lookup: the query
    position holds the current symbol and reads the pair whose source it is. (With a pair as two
    tokens a model must first grow a previous-token head; tiny CPU runs did not, docs/LOG.md.)
    Tokens: pairs 0..N^2-1, symbols N^2 + s, QUERY = N^2 + N, HOP_d = N^2 + N + d for d in 1..H.
    Row (N + 4 tokens): pair_1 ... pair_N QUERY x HOP_d pi^d(x), the pairs in random order.
    """

    name = "pointer_chase"

    def __init__(self, symbols: int = 16, max_difficulty: int = 8):
        if symbols < 2:
            raise ValueError(f"pointer_chase needs at least 2 symbols, got {symbols}")
        if not 1 <= max_difficulty <= symbols // 2:
            raise ValueError(
                f"pointer_chase: hops must lie in 1..{symbols // 2} for {symbols} symbols (more "
                f"would be fewer hops backwards), got {max_difficulty}"
            )
        self.symbols, self.max_difficulty = symbols, max_difficulty
        self.vocab_size = symbols * symbols + symbols + 1 + max_difficulty
        self.row_len = symbols + 4

    def example(self, rng: np.random.Generator, hops: int) -> np.ndarray:
        n = self.symbols
        order = rng.permutation(n)
        successor = np.empty(n, dtype=np.int64)  # Sattolo: following `order` cyclically is one n-cycle
        successor[order] = np.roll(order, -1)
        listed = rng.permutation(n)
        x = int(rng.integers(n))
        answer = x
        for _ in range(hops):
            answer = successor[answer]
        query = n * n + n
        return np.concatenate([listed * n + successor[listed], [query, n * n + x, query + hops, n * n + answer]])


class VarChain:
    """Variable binding: statements "a = b" (a name) or "a = 7" (a value) in random order, then a query
    name; the answer is the value its chain of bindings ends in, d statements away. Unlike
    pointer_chase the depth is not given: the model follows bindings until it reaches a value, among
    distractor chains of random lengths.

    Each statement is one token (as pointer_chase's pairs). M = 2 x statements names, 10 values.
    Tokens: "a = b" a M + b, "a = v" M^2 + a 10 + v, names M^2 + 10 M + a, values M^2 + 11 M + v,
    QUERY last. Row (S + 3 tokens): statement_1 ... statement_S QUERY name answer.
    """

    name = "var_chain"
    VALUES = 10

    def __init__(self, statements: int = 12, max_difficulty: int = 6):
        if not 1 <= max_difficulty <= statements:
            raise ValueError(f"var_chain: depth must lie in 1..{statements} (the statements), got {max_difficulty}")
        self.statements, self.max_difficulty = statements, max_difficulty
        self.names = 2 * statements
        m, v = self.names, self.VALUES
        self.name_base, self.value_base = m * m + m * v, m * m + m * v + m
        self.query = self.value_base + v
        self.vocab_size = self.query + 1
        self.row_len = statements + 3

    def example(self, rng: np.random.Generator, depth: int) -> np.ndarray:
        m, v = self.names, self.VALUES
        names = rng.permutation(m)  # distinct names, consumed chain by chain
        lengths, left = [depth], self.statements - depth
        while left:
            lengths.append(min(left, int(rng.integers(1, self.max_difficulty + 1))))
            left -= lengths[-1]
        statements, used = [], 0
        for length in lengths:
            chain = names[used : used + length]
            used += length
            statements += [a * m + b for a, b in zip(chain[:-1], chain[1:])]  # chain[i] = chain[i + 1]
            value = int(rng.integers(v))
            statements.append(m * m + chain[-1] * v + value)  # the chain's last name = a value
            if length == depth and len(statements) == depth:
                answer = value
        statements = rng.permutation(statements)
        return np.array([*statements, self.query, self.name_base + names[0], self.value_base + answer])


TASKS = {task.name: task for task in (PointerChase, VarChain)}


def build_task(name: str, size: int, max_difficulty: int):
    """`size`: pointer_chase's symbols N, var_chain's statements S."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; use one of {', '.join(TASKS)}")
    return TASKS[name](size, max_difficulty)


def _bucket(row: np.ndarray) -> int:
    """A hash of the row's tokens, in range(VAL_BUCKETS): 0 is validation."""
    h = 0xCBF29CE484222325
    for t in row.tolist():  # FNV-1a over the tokens, 64-bit
        h = ((h ^ (t & 0xFFFF)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return (h ^ (h >> 29)) % VAL_BUCKETS


def draw(task, seed: int, stream: int, g: int, hardest: int | None = None) -> tuple[np.ndarray, int]:
    """Example g of a stream and its difficulty: a function of (seed, stream, g, hardest) only.

    Training (TRAIN) mixes difficulties 1..hardest uniformly (hardest: the curriculum's current top,
    default the task's); validation (VAL) cycles through 1..max, so every difficulty has the same
    number of examples in any whole number of cycles.
    """
    rng = np.random.default_rng([seed, stream, g])
    if stream == VAL:
        difficulty = g % task.max_difficulty + 1
    else:
        difficulty = int(rng.integers(1, (hardest or task.max_difficulty) + 1))
    while True:
        row = task.example(rng, difficulty)
        if (_bucket(row) == 0) == (stream == VAL):
            return row, difficulty


def batch(
    task, seed: int, stream: int, first: int, count: int, hardest: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Examples first .. first + count - 1: rows [count, row_len] and difficulties [count]."""
    rows, difficulties = zip(*(draw(task, seed, stream, g, hardest) for g in range(first, first + count)))
    return np.stack(rows), np.array(difficulties)


def inputs_and_labels(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """inputs = every token but the answer; labels: the answer at the last input position only."""
    inputs = rows[:, :-1]
    labels = np.full_like(inputs, IGNORE_INDEX)
    labels[:, -1] = rows[:, -1]
    return inputs, labels


def score_answers(
    logits: torch.Tensor, labels: torch.Tensor, difficulties: torch.Tensor, max_difficulty: int
) -> torch.Tensor:
    """[2, max_difficulty]: correct answers (greedy, over the whole vocabulary) and examples at each
    difficulty 1..max, from logits [B, T, V] whose last position predicts the answer."""
    correct = (logits[:, -1].argmax(-1) == labels[:, -1]).double()
    index = (difficulties - 1).to(logits.device)
    return torch.stack(
        [
            torch.bincount(index, weights=correct, minlength=max_difficulty),
            torch.bincount(index, minlength=max_difficulty).double(),
        ]
    )
