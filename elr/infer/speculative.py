"""Self-speculative greedy decoding: draft at k = j loops, verify at k = K, one model and one cache.

A round, with `current` the last token chosen and not yet fed:
1. draft: feed `current`, then each drafted token, at j loops, one token at a time: n tokens;
2. rewind the cache to where it was (attention: its length; GDP states: a snapshot);
3. verify: feed `current` and the n drafts at K loops in one forward; its greedy choices accept the
   drafts up to the first disagreement, and its choice there is one more token (so a round always
   gains at least one token, and n + 1 when every draft is accepted);
4. keep the cache entries of the accepted tokens (the verifying pass wrote them) and rewind past the
   rejected ones. Attention forgets them by its length; a GDP state folds every column in, so it is
   rewound to the snapshot and the accepted tokens are fed again at K (one more forward, only in
   rounds that rejected something, only in models with GDP layers).

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
the same forward eagerly, so no round waits for a compile. The same tokens as eager.
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
        cache = StaticCache(model, 1, capacity_for(width + max_new_tokens, model), loops, kv_mode)
        cache.start.fill_(width - len(prompt))
        compiled = compile if isinstance(compile, DecodeStep) else DecodeStep(model)
        eager = DecodeStep(model, compile=False)
        first = compiled(cache, torch.tensor([[0] * (width - len(prompt)) + prompt], device=device), loops)

        def forward(tokens: list[int], k: int) -> torch.Tensor:
            step = compiled if len(tokens) in (1, draft_tokens + 1) else eager
            return step(cache, torch.tensor([tokens], device=device), k)[0]

        def rewind(saved, kept: int) -> None:
            cache.lengths.copy_(saved[0] + kept)

    else:
        cache = InferenceCache(model, 1, len(prompt) + max_new_tokens, loops, kv_mode)
        first = model(torch.tensor([prompt], device=device), loops, cache)

        def forward(tokens: list[int], k: int) -> torch.Tensor:
            return model(torch.tensor([tokens], device=device), k, cache)[0]

        def rewind(saved, kept: int) -> None:
            cache.length = saved[0] + kept

    rewind_by_length = cache.rewind_by_length()
    current = int(first[0, -1].argmax())
    if current == eot_id:
        return
    yield [current]
    count = 1
    while count < max_new_tokens:
        # Columns: every fed token plus the n drafts stays within prompt + max_new_tokens.
        n = min(draft_tokens, max_new_tokens - count)
        saved = cache.snapshot()
        if compile and n == draft_tokens:  # every draft in one compiled call, cut after an end-of-text
            drafts = compiled.draft(cache, torch.tensor([[current]], device=device), draft_loops, n)[0].tolist()
            drafts = drafts[: drafts.index(eot_id) + 1] if eot_id in drafts else drafts
        else:
            drafts, token = [], current
            for _ in range(n):
                token = int(forward([token], draft_loops)[-1].argmax())
                drafts.append(token)
                if token == eot_id:
                    break
        cache.restore(saved)
        fed = [current, *drafts]
        choices = forward(fed, loops).argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
            accepted += 1
        stats.drafted += len(drafts)
        stats.accepted += accepted
        stats.rounds += 1
        if accepted < len(drafts):  # take back the rejected drafts' columns
            if rewind_by_length:
                rewind(saved, accepted + 1)
            else:
                cache.restore(saved)
                forward(fed[: accepted + 1], loops)
        gained = []
        for token in [*drafts[:accepted], choices[accepted]]:  # the verifier's choice is the next `current`
            if token == eot_id or count == max_new_tokens:
                break
            gained.append(token)
            count += 1
        yield gained
        if len(gained) <= accepted:  # an end-of-text (or the limit) came first
            return
        current = gained[-1]
