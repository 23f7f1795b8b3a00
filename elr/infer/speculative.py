"""Self-speculative greedy decoding: draft at k = j loops, verify at k = K, one model and two caches.

Each cache holds what its own k computes: the drafting one is the model at k = j, the verifying one the
model at k = K. (A single cache shared by both would have the drafts read keys that K-loop forwards
wrote, in the output block and, with budget conditioning, in loop 1: a draft that is neither k = j nor
k = K, which agreed with K on 18% of its tokens where the model's own k = 1 agrees on 88%.) Both
hold every accepted token but the last one chosen. A round, with `current` that last token:
1. draft: feed `current`, then each drafted token, at j loops through the drafting cache, one token at a
   time: n tokens;
2. verify: feed `current` and the n drafts at K loops in one forward through the verifying cache; its
   greedy choices accept the drafts up to the first disagreement, and its choice there is one more
   token (so a round always gains at least one token, and n + 1 when every draft is accepted);
3. keep both caches' entries of the accepted tokens and take back the rest. Attention forgets columns
   by its length; a GDP state folds every column in, so it is rewound to a snapshot and the accepted
   tokens are fed again (only in models with GDP layers). When every draft is accepted, the last one,
   which drafting never fed, opens the next round's first drafting forward (a chunk of two).

What it equals: the verify pass is a chunk forward, the exact full-sequence computation over its
tokens. In `per_loop` mode (and in any mode when the recurrent block has no attention layer) plain
token-by-token decoding is that same computation, so the output equals plain greedy decoding at
k = K token for token (up to floating-point ties). In the shared modes (`last_loop_kv`, `last_loop`)
a token decoded alone reads earlier tokens' final-loop keys while a chunk reads them loop by loop, so
speculative output is greedy decoding of the chunked cache: it may differ from plain decoding there.

With `compile`, the prompt is read into a StaticCache through the compiled decode step (left-padded to
a power-of-two width, `prefill_width`) and the forwards are that step (elr/infer/decode.py): a round's n
drafts in one call (`DecodeStep.draft`: the n forwards and their argmaxes in one graph, read back once;
drafts past an end-of-text are dropped, as eager never makes them), the verify of the usual width (n + 1
tokens) in another; the rarer widths (the last round, a draft cut at end-of-text, the GDP re-feed) run
the same forward eagerly, so no round waits for a compile after the first of its shape. The same tokens
as eager.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from elr.infer.cache import InferenceCache
from elr.infer.decode import DecodeStep, capacity_for, prefill_width
from elr.infer.static_cache import StaticCache


@dataclass
class SpeculationStats:
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # of them, accepted by the verifying pass
    rounds: int = 0  # verifying forwards

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def add(self, other: SpeculationStats) -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.rounds += other.rounds


@torch.no_grad()
def speculative_generate(
    model,
    prompts: list[list[int]],
    loops: int,
    max_new_tokens: int,
    eot_id: int,
    kv_mode: str = "per_loop",
    draft_loops: int = 1,
    draft_tokens: int = 4,
    compile: bool | DecodeStep = False,
) -> tuple[list[list[int]], SpeculationStats]:
    """Greedy continuation of each prompt at k = `loops`, drafted at k = `draft_loops`, up to
    `draft_tokens` per round; returns the new tokens per prompt (as `generate` does) and the draft
    statistics. Prompts run one at a time (rows accept different numbers of tokens)."""
    check_draft(loops, draft_loops, draft_tokens)
    stats, outputs = SpeculationStats(), []
    for prompt in prompts:
        outputs.append(
            [
                token
                for gained in speculative_rounds(
                    model, prompt, loops, max_new_tokens, eot_id, kv_mode, draft_loops, draft_tokens, stats, compile
                )
                for token in gained
            ]
        )
    return outputs, stats


def check_draft(loops: int, draft_loops: int, draft_tokens: int) -> None:
    if not 1 <= draft_loops <= loops:
        raise ValueError(f"draft loops must lie in 1..{loops} (the verifying k), not {draft_loops}")
    if draft_tokens < 1:
        raise ValueError(f"draft tokens must be at least 1, not {draft_tokens}")


@torch.no_grad()
def speculative_rounds(
    model,
    prompt: list[int],
    loops: int,
    max_new_tokens: int,
    eot_id: int,
    kv_mode: str,
    draft_loops: int,
    draft_tokens: int,
    stats: SpeculationStats,
    compile: bool | DecodeStep = False,
) -> Iterator[list[int]]:
    """One prompt's greedy continuation, a forward round at a time: yields the prefill's token, then
    after each verifying round the tokens it gained (the accepted drafts and the verifier's own next
    token), never the end-of-text token; `stats` counts the drafts. A server steps it between other
    requests' decoding steps (elr/serve)."""
    if not prompt:
        raise ValueError("every prompt needs at least one token")
    device = model.output.weight.device
    if compile:
        # The prompt through the compiled step, left-padded to a bucketed width (a graph per width).
        width = prefill_width(len(prompt), model.args.max_seq_len - max_new_tokens)
        capacity = capacity_for(width + max_new_tokens, model)
        compiled = compile if isinstance(compile, DecodeStep) else DecodeStep(model)
        eager = DecodeStep(model, compile=False)
        padded = torch.tensor([[0] * (width - len(prompt)) + prompt], device=device)

        def new_cache(k: int) -> StaticCache:
            fresh = StaticCache(model, 1, capacity, k, kv_mode)
            fresh.start.fill_(width - len(prompt))
            return fresh

        def forward(into, tokens: list[int], k: int) -> torch.Tensor:
            step = compiled if len(tokens) == 1 or (len(tokens) == draft_tokens + 1 and k == loops) else eager
            return step(into, torch.tensor([tokens], device=device), k)[0]

        def rewind(into, saved, kept: int) -> None:
            into.lengths.copy_(saved[0] + kept)

        cache, draft_cache = new_cache(loops), new_cache(draft_loops)
        first = compiled(cache, padded, loops, last=True)
        compiled(draft_cache, padded, draft_loops, last=True)
    else:

        def new_cache(k: int) -> InferenceCache:
            return InferenceCache(model, 1, len(prompt) + max_new_tokens, k, kv_mode)

        def forward(into, tokens: list[int], k: int) -> torch.Tensor:
            return model(torch.tensor([tokens], device=device), k, into)[0]

        def rewind(into, saved, kept: int) -> None:
            into.length = saved[0] + kept

        cache, draft_cache = new_cache(loops), new_cache(draft_loops)
        first = forward(cache, prompt, loops)[None]
        forward(draft_cache, prompt, draft_loops)

    rewind_by_length = cache.rewind_by_length()

    def take_back(into, saved, kept: list[int], k: int) -> None:
        """Leave `into` holding what it held at `saved` and then `kept`: by its length where attention is all
        it keeps, else from the snapshot with `kept` fed again (GDP states fold every column in)."""
        if rewind_by_length:
            rewind(into, saved, len(kept))
        else:
            into.restore(saved)
            forward(into, kept, k)

    current = int(first[0, -1].argmax())
    if current == eot_id:
        return
    yield [current]
    count, pending = 1, []
    while count < max_new_tokens:
        # Columns: every fed token plus the n drafts stays within prompt + max_new_tokens. Both caches hold
        # every accepted token but `current`.
        n = min(draft_tokens, max_new_tokens - count)
        draft_saved = draft_cache.snapshot()
        start = [*pending, current]  # what the drafting cache has not been fed yet
        if compile and n == draft_tokens:  # every draft in one compiled call, cut after an end-of-text
            drafts = compiled.draft(draft_cache, torch.tensor([start], device=device), draft_loops, n)[0].tolist()
            drafts = drafts[: drafts.index(eot_id) + 1] if eot_id in drafts else drafts
            draft_fed = n - 1  # drafts fed back (the last one never is)
        else:
            drafts, chunk = [], start
            for _ in range(n):
                token = int(forward(draft_cache, chunk, draft_loops)[-1].argmax())
                drafts.append(token)
                chunk = [token]
                if token == eot_id:
                    break
            draft_fed = len(drafts) - 1
        saved = cache.snapshot()
        fed = [current, *drafts]
        choices = forward(cache, fed, loops).argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
            accepted += 1
        stats.drafted += len(drafts)
        stats.accepted += accepted
        stats.rounds += 1
        kept = accepted + 1  # `current` and the accepted drafts stay in both caches
        if accepted < len(drafts):  # take back the rejected drafts' columns
            take_back(cache, saved, fed[:kept], loops)
        gained = []
        for token in [*drafts[:accepted], choices[accepted]]:  # the verifier's choice is the next `current`
            if token == eot_id or count == max_new_tokens:
                break
            gained.append(token)
            count += 1
        yield gained
        if len(gained) <= accepted or count == max_new_tokens:  # an end-of-text (or the limit) came first
            return
        current = gained[-1]
        # The drafting cache keeps the accepted drafts it was fed; one it was not fed (every draft accepted:
        # the last) waits for the next round's first drafting forward.
        pending = [drafts[-1]] if accepted > draft_fed else []
        if accepted < draft_fed:  # it was fed drafts the verifier rejected: take them back
            take_back(draft_cache, draft_saved, start + drafts[:accepted], draft_loops)
