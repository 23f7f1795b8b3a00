"""A request as the scheduler sees it: its choices, the text each has released, the events it emits.

A request asks for `n` choices of each of its prompts; each choice is a `Sequence`, decoded in one row
of a cache (or in its own cache when drafted, elr/infer/speculative.py). Text is released as tokens
arrive, less what may still change: a trailing incomplete UTF-8 character (decoded as U+FFFD) and a
tail that may be the start of a stop string. A stop string ends the choice and is cut from its text,
as OpenAI's `stop` is. The work per token is bounded by the token's own text: only the tokens since the
last complete character are decoded, and the stop strings are found by automata that read each
character once (`StopScanner`), not by searching the whole text again. The engine
(elr/serve/scheduler.py) calls `emit` from its own thread.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from elr.infer.generate import Sampling

AUTO = "auto"  # the loop budget that lets each token pick its depth (an exit rule, capped at K)


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at this step, best first


@dataclass
class Delta:
    """New text of one choice (possibly empty), the log-probs of the tokens it came from, and, on its
    last delta, why the choice ended: "stop" (end of text or a stop string) or "length"."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Done:
    """Every choice has ended; the request's counts are final."""


@dataclass
class Failed:
    """The request was dropped: `status` is the HTTP status a client is given (500: a fault while it
    ran; 503: the server stopped)."""

    message: str
    status: int = 500


class StopScanner:
    """Finds stop strings in a text fed a piece at a time, each character once: one Knuth-Morris-Pratt
    automaton per stop string, so the work is linear in the text (times the stops, at most 4), whatever
    the strings' lengths. `matched[i]` is the longest end of the text fed so far that begins stop i."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.fallback = [self.failure(s) for s in stops]
        self.matched = [0] * len(stops)
        self.fed = 0  # characters fed, over every piece

    @staticmethod
    def failure(s: str) -> list[int]:
        """fallback[j]: the longest proper prefix of s[:j + 1] that is also its suffix."""
        table, k = [0] * len(s), 0
        for j in range(1, len(s)):
            while k and s[j] != s[k]:
                k = table[k - 1]
            if s[j] == s[k]:
                k += 1
            table[j] = k
        return table

    def feed(self, piece: str) -> int | None:
        """Where in `piece` the earliest stop string found begins (negative: in text fed before), or None."""
        self.fed += len(piece)
        first = None
        for i, (stop, table) in enumerate(zip(self.stops, self.fallback)):
            k = self.matched[i]
            for j, char in enumerate(piece):
                while k and char != stop[k]:
                    k = table[k - 1]
                if char == stop[k]:
                    k += 1
                if k == len(stop):
                    start = j + 1 - k
                    first = start if first is None else min(first, start)
                    k = table[k - 1]
                    break
            self.matched[i] = k
        return first

    @property
    def partial(self) -> int:
        """Characters at the end of the text that may begin a stop string."""
        return max(self.matched, default=0)


@dataclass(eq=False)
class Sequence:
    """One choice: the prompt it continues, its tokens so far, what it has released."""

    index: int
    prompt: list[int]
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # released to the client
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of its tokens, when the request asks
    loops_run: int = 0  # loops run by the tokens it fed the model, summed (the mean k per token: / fed)
    fed: int = 0
    row: int | None = None  # its row in a slot pool while it decodes there
    decoded: int = 0  # tokens whose text has been read (those after it end in an incomplete character)
    piece_read: int = 0  # characters of the tokens after `decoded` already read
    held: str = ""  # text read but held back: it may begin a stop string
    scanner: StopScanner | None = None

    def release(self, decode: Callable[[list[int]], str], stop: tuple[str, ...], final: bool) -> tuple[str, bool]:
        """(the text newly released, whether a stop string ended the choice). Only the tokens since the
        last complete character are decoded, and each character is scanned for the stop strings once."""
        if self.scanner is None:
            self.scanner = StopScanner(stop)
        piece = decode(self.tokens[self.decoded :])
        ready = piece if final else piece.rstrip("\ufffd")  # an incomplete character completes with the next token
        new = ready[self.piece_read :]
        if len(ready) == len(piece):
            self.decoded, self.piece_read = len(self.tokens), 0
        else:
            self.piece_read = len(ready)
        pending = self.held + new
        start = self.scanner.feed(new)
        if start is not None:
            released, self.held = pending[: len(self.held) + start], ""
        else:
            keep = 0 if final else self.scanner.partial
            released, self.held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += released
        return released, start is not None


def _ignore(event) -> None:
    pass


@dataclass(eq=False)
class Request:
    """What a client asked for, validated (elr/serve/protocol.py): `loops` is k or AUTO; `logprobs`
    the alternatives to report per token (0: the chosen token's only; None: no log-probs); `seed`
    seeds choice j with seed + j; `draft_loops` decodes it self-speculatively (greedy, n = 1)."""

    prompts: list[list[int]]
    max_tokens: int
    loops: int | str
    sampling: Sampling = field(default_factory=Sampling)
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    draft_loops: int | None = None
    emit: Callable[[Delta | Done | Failed], None] = _ignore
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancelled: bool = False  # set by the client's side (a dropped connection); the engine frees its rows
    finished: bool = False
    draft_stats: object = None  # SpeculationStats of a drafted request

    @functools.cached_property
    def sequences(self) -> list[Sequence]:
        """Its choices, built when first asked for: the engine checks n x prompts against its rows first."""
        return [Sequence(i * self.n + j, prompt) for i, prompt in enumerate(self.prompts) for j in range(self.n)]

    @property
    def choices(self) -> int:
        return self.n * len(self.prompts)

    def seed_generators(self, device: torch.device) -> None:
        """One generator per sampled choice, on the device the logits are on."""
        for seq in self.sequences:
            if self.sampling.temperature > 0:
                seq.generator = torch.Generator(device)
                if self.seed is not None:
                    seq.generator.manual_seed(self.seed + seq.index % self.n)
                else:
                    seq.generator.seed()

    @property
    def pool(self) -> str:
        """Where it decodes: "draft" (its own cache), AUTO (the adaptive pool) or "budgets"."""
        return "draft" if self.draft_loops is not None else AUTO if self.loops == AUTO else "budgets"

    @property
    def cost(self) -> int:
        """Tokens it may hold in the cache: each choice's prompt and new tokens."""
        return sum(len(prompt) + self.max_tokens for prompt in self.prompts) * self.n

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(seq.tokens) for seq in self.sequences)

    @property
    def mean_loops(self) -> float | None:
        """Loops per fed token over every choice (k for a fixed budget; the exit rule's mean for AUTO)."""
        fed = sum(seq.fed for seq in self.sequences)
        return sum(seq.loops_run for seq in self.sequences) / fed if fed else None
