"""What a request costs before it runs: the memory it holds while its prompts are read, and the wait it
would have for rows, so the engine (elr/serve/scheduler.py) can refuse or queue it before anything is
allocated.

Memory comes from the inference memory report (elr/infer/memory.py): a prompt is read in a prefill
cache of its own at K (left-padded to the request's longest prompt), and the prefill returns logits for
every position; a drafted request holds two caches of its own for prompt + max_tokens, one at its k and
one at its draft k (elr/infer/speculative.py). The rows
of the pools are allocated at start and are not counted here.

The wait is an estimate: the tokens still owed in the request's pool (each running choice's max_tokens
less what it has made, and each waiting choice's max_tokens) shared over the pool's rows, at the
measured seconds per step. max_tokens is an upper bound (a choice may end sooner), so the estimate
errs long; a request that would find free rows and nobody waiting waits nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from elr.infer.memory import inference_state_bytes
from elr.serve.sequence import Request

STEP_SMOOTHING = 0.2  # weight of the newest step in the running mean of seconds per step


@dataclass
class MemoryModel:
    """Bytes of a request's prefill (or drafted cache), from the model's shapes."""

    args: object  # ModelArgs
    kv_mode: str
    dtype: object  # torch.dtype of the model
    element_size: int
    vocab: int
    draft_tokens: int

    def bytes(self, request: Request) -> int:
        longest = max(len(p) for p in request.prompts)
        return self.prompt_bytes(
            request.pool, request.loops, len(request.prompts), longest, request.max_tokens, request.draft_loops or 0
        )

    def prompt_bytes(self, pool: str, loops, prompts: int, longest: int, max_tokens: int, draft_loops: int = 0) -> int:
        if pool == "draft":  # its caches at its k and its draft k, for the whole sequence and a round of drafts
            length = longest + max_tokens + self.draft_tokens
            state = inference_state_bytes(self.args, loops, length, self.kv_mode, self.dtype)
            drafting = inference_state_bytes(self.args, draft_loops, length, self.kv_mode, self.dtype)
            state = {kind: n + drafting[kind] for kind, n in state.items()}
        else:  # a prefill cache at K for every prompt, padded to the longest
            state = inference_state_bytes(self.args, self.args.recurrence.max_loops, longest, self.kv_mode, self.dtype)
            state = {kind: prompts * n for kind, n in state.items()}
        return sum(state.values()) + prompts * longest * self.vocab * self.element_size

    def full_context(self, context: int) -> int:
        """One prompt at the full context, the most any request of one prompt needs (the default limit)."""
        K = self.args.recurrence.max_loops
        return max(self.prompt_bytes("budgets", K, 1, context, 0), self.prompt_bytes("draft", K, 1, context, 0, K))


@dataclass
class Backlog:
    """The tokens owed per pool and the seconds per step; read under the engine's lock."""

    rows: dict[str, int]  # pool -> rows ("draft": requests at once)
    waiting: dict[str, int] = field(default_factory=dict)  # pool -> max_tokens x choices of the waiting requests
    running: dict[str, int] = field(default_factory=dict)  # pool -> tokens the running choices may still make
    free: dict[str, int] = field(default_factory=dict)  # pool -> free rows after the last step
    step_s: float | None = None  # running mean of a decoding step's seconds

    def __post_init__(self):
        for pool, rows in self.rows.items():
            self.waiting.setdefault(pool, 0)
            self.running.setdefault(pool, 0)
            self.free.setdefault(pool, rows)

    @staticmethod
    def owed(request: Request) -> int:
        return request.choices * request.max_tokens

    def queue(self, request: Request, sign: int = 1) -> None:
        self.waiting[request.pool] += sign * self.owed(request)

    def timed(self, seconds: float) -> None:
        s = self.step_s
        self.step_s = seconds if s is None else (1 - STEP_SMOOTHING) * s + STEP_SMOOTHING * seconds

    def expected_wait(self, request: Request) -> float:
        """Seconds until the request would take its rows (0 when rows are free and nobody waits)."""
        pool = request.pool
        if not self.waiting[pool] and self.free[pool] >= (1 if pool == "draft" else request.choices):
            return 0.0
        if self.step_s is None or not self.rows[pool]:
            return 0.0
        return (self.running[pool] + self.waiting[pool]) / self.rows[pool] * self.step_s

    @staticmethod
    def retry_after(seconds: float) -> int:
        """A Retry-After in whole seconds, at least 1."""
        return max(1, math.ceil(seconds))
