"""The server's limits: how much one request may ask for, and how much work the server takes on.

Every limit is checked before anything is allocated for a request, so no body, however large or odd,
costs the server more than these numbers allow. Each field is a flag of scripts/serve.py (the field's
name with dashes); docs/serving.md lists them with the error a request past each one gets.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_STOP = 4  # stop strings per request, as OpenAI allows


@dataclass
class Limits:
    max_concurrent: int = 8
    """rows of the budget pool: choices decoding at a fixed k at once (n x prompts of one request at most)"""
    max_auto: int = 4
    """rows of the adaptive pool (loop_budget "auto"); 0 refuses "auto" """
    max_draft: int = 2
    """self-speculative requests at once, each in a cache of its own; 0 refuses draft_loops"""
    max_queued_tokens: int = 65536
    """prompt + max_tokens (per choice) of the waiting requests past which a request gets 429"""
    draft_tokens: int = 4
    """tokens drafted per verifying round of a self-speculative request"""
    max_wait_s: float = 5.0
    """the expected wait for a row (the work ahead of a request in its pool at the measured step time)
    past which a request gets 429 with a Retry-After; 0 turns the check off"""
    max_body_bytes: int = 4 * 2**20
    """bytes of a request body, counted while it is read: past them the server answers 413 at once"""
    max_prompt_tokens: int | None = None
    """tokens of one prompt (a string is refused by its length before it is tokenized); None: the
    model's context less one token"""
    max_stop_chars: int = 256
    """characters of one stop string (up to 4 strings; matching is linear in the text either way)"""
    max_prefill_bytes: int | None = None
    """memory the prompts read in one step may hold beside the pools (their prefill cache and logits,
    elr/infer/memory.py; a drafted request's own cache): a request needing more is refused, and a step
    admits waiting requests only while their sum stays within it; None: one prompt at the full context"""
    drain_timeout_s: float = 30.0
    """after SIGTERM (or Ctrl-C) the server refuses new requests (503) and finishes the running ones for
    up to this long; then they fail with 503 and it exits. A second signal exits at once"""

    def check(self) -> None:
        """A ValueError naming the flag at fault."""
        for name in ("max_concurrent", "draft_tokens", "max_body_bytes", "max_stop_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(self, name)}")
        for name in ("max_auto", "max_draft", "max_queued_tokens", "max_wait_s", "drain_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 0, not {getattr(self, name)}")
        for name in ("max_prompt_tokens", "max_prefill_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(self, name)}")

    @property
    def max_choices(self) -> int:
        """The most choices (n x prompts) any request can get rows for."""
        return max(self.max_concurrent, self.max_auto, 1 if self.max_draft else 0)
