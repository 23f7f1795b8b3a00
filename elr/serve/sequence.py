"""A request as the scheduler sees it: its choices, the text each has released, the events it emits.

A request asks for `n` choices of each of its prompts; each choice is a `Sequence`, decoded in one row
of a cache (or in its own cache when drafted, elr/infer/speculative.py). Text is released as tokens
arrive, less what may still change: a trailing incomplete UTF-8 character (decoded as U+FFFD) and a
tail that may be the start of a stop string. A stop string ends the choice and is cut from its text,
as OpenAI's `stop` is. The engine (elr/serve/scheduler.py) calls `emit` from its own thread.
"""

from __future__ import annotations

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

    def release(self, decode: Callable[[list[int]], str], stop: tuple[str, ...], final: bool) -> tuple[str, bool]:
        """(the text newly released, whether a stop string ended the choice)."""
        text = decode(self.tokens)
        longest = max((len(s) for s in stop), default=0)
        hits = [i for i in (text.find(s, max(0, len(self.text) - longest)) for s in stop) if i >= 0]
        stopped = bool(hits)
        if stopped:
            text = text[: min(hits)]
        elif not final:
            text = text.rstrip("\ufffd")  # an incomplete character completes with the next token
            held = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
            text = text[: len(text) - held]
        new = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text += new
        return new, stopped


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
    sequences: list[Sequence] = field(init=False)
    draft_stats: object = None  # SpeculationStats of a drafted request

    def __post_init__(self):
        self.sequences = [
            Sequence(i * self.n + j, prompt) for i, prompt in enumerate(self.prompts) for j in range(self.n)
        ]

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
