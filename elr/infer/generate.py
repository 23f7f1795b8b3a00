"""Prefill then token-by-token decoding at a per-request loop count k, with sampling.

A batch of prompts of different lengths is left-padded into one tensor; the cache gives each row
its own positions, so a row decodes exactly as it would alone. Rows stop at `<|endoftext|>` or
after `max_new_tokens`; finished rows keep stepping (their tokens are dropped) until all are done.
With `compile=True` the prompts are read into a StaticCache and every new token goes through the
compiled decode step (elr/infer/decode.py); the eager path (InferenceCache) is the reference it is
tested against, token for token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from elr.infer.cache import InferenceCache
from elr.infer.decode import DecodeStep, capacity_for, prefill_width
from elr.infer.static_cache import StaticCache
from elr.models.budget import LoopBudget, as_loop_budget, budget_range
from elr.models.early_exit import ExitRule


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1 = no nucleus cut

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # nan passes `< 0`
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")


GREEDY = Sampling()


def sampling_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits [..., vocab] -> the distribution a sampler at `sampling` (temperature > 0) draws from, as float32
    logits: divided by the temperature, the tokens top-k and top-p drop at -inf. The RLVR update scores its
    samples with the same function (elr/rl/logprobs.py), so sampler and update agree on what was sampled."""
    # Each row's largest logit becomes 0 before the division: a temperature below float32's range (1e-300
    # is 0 there) then leaves the largest at 0 and the others at -inf (greedy in effect), never NaN.
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / max(sampling.temperature, torch.finfo(torch.float32).tiny)
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p; the first always stays.
        drop = probs.cumsum(-1) - probs >= sampling.top_p
        drop[..., 0] = False  # a top_p below float32's range (1e-50 is 0 there) would drop every token
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, vocab] -> next token ids [B]. `uniforms` [B] in [0, 1): each row's draw, by the inverse of
    its distribution's CDF, instead of the generator's (draws that do not depend on how rows are batched)."""
    return sample_with_logprobs(logits, sampling, generator, uniforms)[0]


def sample_with_logprobs(
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `sample`, with what the sampler knows of its choice, all [B]: the token ids, the log-probability of
    each under the distribution it was drawn from (after temperature, top-k and top-p; 0 when greedy), and how
    many tokens that distribution kept (the vocabulary when nothing was cut; 1 when greedy)."""
    if sampling.temperature == 0:
        ids = logits.argmax(-1)
        return ids, torch.zeros(ids.shape, device=ids.device), torch.ones_like(ids)
    logits = sampling_logits(logits, sampling)
    probs = logits.softmax(-1)
    if uniforms is None:
        ids = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    else:
        cdf = probs.double().cumsum(-1)
        picked = torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1])[:, None], right=True).squeeze(-1)
        ids = picked.clamp(max=logits.shape[-1] - 1)
    logp = logits.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    return ids, logp, torch.isfinite(logits).sum(-1)


def left_pad(
    prompts: list[list[int]], pad_id: int, device, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows right-aligned in one [B, L] tensor (L: the longest prompt, or `width`), and each row's
    count of padding columns."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts) if width is None else width
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for row, p in enumerate(prompts):
        tokens[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
    pad = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
    return tokens.to(device), pad.to(device)


@dataclass
class AdaptiveDepth:
    """Adaptive depth for a decoder or a scorer: an exit rule (elr/models/early_exit.py), capped at the
    loop count it is run with, and the loops its forwards let the counted tokens run."""

    rule: ExitRule
    loops: int = 0  # loops run, summed over the counted tokens
    tokens: int = 0

    def count(self, loops_used: torch.Tensor) -> None:
        """Add the loops of some tokens (a selection of `model.loops_used()`)."""
        self.loops += int(loops_used.sum())
        self.tokens += loops_used.numel()

    @property
    def mean_loops(self) -> float:
        return self.loops / self.tokens if self.tokens else float("nan")


class Sampled(NamedTuple):
    """generate(..., with_logprobs=True): the new tokens, and what the sampler knew of each choice, as plain
    tensors [B, max_new_tokens]: `logprobs` of each chosen token under the distribution it was drawn from (after
    temperature, top-k and top-p), with the closing <|endoftext|> of a row that stopped there at index
    len(tokens[row]), 0 past a row's end; `kept`, how many tokens that distribution held (what the RLVR update
    needs to renormalise over the same nucleus)."""

    tokens: list[list[int]]
    logprobs: torch.Tensor
    kept: torch.Tensor


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    loops: LoopBudget | list[int],
    max_new_tokens: int,
    eot_id: int,
    kv_mode: str = "per_loop",
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
    stop: Callable[[list[list[int]]], list[bool]] | None = None,
    adaptive: AdaptiveDepth | None = None,
    uniforms: Callable[[int], torch.Tensor] | None = None,
    all_done: Callable[[bool], bool] | None = None,
    compile: bool | DecodeStep = False,
    with_logprobs: bool = False,
) -> list[list[int]] | Sampled:
    """Continue each prompt (token ids) for up to `max_new_tokens`; returns the new tokens per row
    (without the end-of-text token). `loops`: k for all, or one k per prompt, a list or a LongTensor
    (mixed budgets in one batch, each row decoded as it would be alone). `stop`, given the new tokens so far, says which
    rows are done (e.g. a stop string was generated); their tokens so far are kept. `adaptive`: the
    prompt is read at k = loops, every new token decides its own depth by the exit rule, capped at k
    (it counts the loops of the tokens kept). `uniforms(t)`: the rows' draws for new token t (see `sample`).
    `all_done(mine)`: whether every process's rows are done, given this one's (a collective), so processes
    that share the model's weights (FSDP) run the same number of forwards. `compile`: decode through the
    compiled step (elr/infer/decode.py; or this DecodeStep) over a static cache: the tokens of eager decoding.
    `with_logprobs`: a `Sampled`, the tokens with the sampler's log-prob of each choice."""
    if adaptive is not None and not isinstance(loops, int):
        raise ValueError("adaptive depth caps every row at one k: give one loop count")
    device = model.output.weight.device
    tokens, pad = left_pad(prompts, eot_id, device)
    cap = max(loops) if isinstance(loops, list) else loops if isinstance(loops, int) else None
    loops = as_loop_budget(loops, len(prompts), device)
    cap = budget_range(loops)[1] if cap is None else cap
    rule = adaptive.rule if adaptive is not None else None
    columns = tokens.shape[1] + max_new_tokens
    if compile:
        decode = compile if isinstance(compile, DecodeStep) else DecodeStep(model)
        # The prompts through the compiled step too, left-padded to a bucketed width (a graph per width).
        width = prefill_width(tokens.shape[1], model.args.max_seq_len - max_new_tokens)
        tokens, pad = left_pad(prompts, eot_id, device, width)
        cache = StaticCache(model, len(prompts), capacity_for(width + max_new_tokens, model), cap, kv_mode)
        cache.start.copy_(pad)
        logits = decode(cache, tokens, loops, cap, last=True)[:, -1]
        budgets = (
            loops if torch.is_tensor(loops) or rule is not None else torch.full((len(prompts),), loops, device=device)
        )

        def forward(nxt: torch.Tensor) -> torch.Tensor:
            return decode(cache, nxt[:, None], budgets, cap, rule)[:, -1]

    else:
        cache = InferenceCache(model, len(prompts), columns, cap, kv_mode, pad)
        logits = model(tokens, loops, cache)[:, -1]

        def forward(nxt: torch.Tensor) -> torch.Tensor:
            return model(nxt[:, None], loops, cache, exit_rule=rule)[:, -1]

    out = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    logprobs = torch.zeros(len(prompts), max_new_tokens, device=device)
    kept = torch.zeros(len(prompts), max_new_tokens, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        nxt, logp, held = sample_with_logprobs(
            logits, sampling, generator, uniforms(step) if uniforms is not None else None
        )
        logprobs[:, step] = logp.masked_fill(done, 0.0)  # a row that ended before this step chose nothing here
        kept[:, step] = held.masked_fill(done, 0)
        done |= nxt == eot_id
        for row, (tok, ended) in enumerate(zip(nxt.tolist(), done.tolist())):
            if not ended:
                out[row].append(tok)
        if stop is not None:
            done |= torch.tensor(stop(out), dtype=torch.bool, device=device)
        finished = bool(done.all())
        if all_done is not None:
            finished = all_done(finished)
        if finished or step == max_new_tokens - 1:
            break
        logits = forward(nxt)
        if adaptive is not None:
            adaptive.count(model.loops_used()[~done, 0])
    return Sampled(out, logprobs, kept) if with_logprobs else out
