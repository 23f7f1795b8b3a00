"""The RLVR stage's rollouts: one step's completions, the sampler's log-prob of each of their tokens, and rewards.

`Rollouts` is what the update reads: `group_size` consecutive rows a group, one k per group, each row's new tokens
and what the sampler knew of each (elr/infer/generate.py's `Sampled`). `sample_groups` decodes a list of groups:
its rows in order of k (a decoding batch costs its deepest row), `rl.rollout_rows` at a time, each row's draw for
token t from (seed, step, round, row, t) over the whole batch, so a completion is the same whichever rank, and
however many, sample it. `refill_rounds` is DAPO's dynamic sampling: a group whose rewards were all equal gives
its place to a fresh prompt at the same k, up to `rl.dynamic_sampling_rounds` times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elr.infer.generate import Sampling, generate
from elr.rl.objective import overlong_penalty
from elr.rl.prompts import Prompt
from elr.rl.rewards import score
from elr.train.loop_sampler import mix_seed


@dataclass
class Rollouts:
    """This rank's completions of one step: one row per completion, `group_size` consecutive rows a group."""

    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    completions: list[list[int]]  # the new tokens, without the <|endoftext|> that ended a row
    loops: list[int]
    logprobs: list[torch.Tensor]  # the sampler's log-prob of each scored token (the closing <|endoftext|> too)
    kept: list[torch.Tensor]  # the size of the distribution each was drawn from (its nucleus)
    rewards: list[float]

    def sequences(self, eot_id: int, max_new_tokens: int) -> tuple[list[list[int]], list[int], list[int]]:
        """Prompt + completion token rows (with the <|endoftext|> the policy chose, where it stopped there),
        and each row's scored span [start, end)."""
        rows, starts, ends = [], [], []
        for ids, new in zip(self.prompt_ids, self.completions):
            ended = len(new) < max_new_tokens  # generation stops early only at <|endoftext|>
            row = ids + new + ([eot_id] if ended else [])
            rows.append(row)
            starts.append(len(ids))
            ends.append(len(row))
        return rows, starts, ends

    def truncated(self, max_new_tokens: int) -> list[bool]:
        """The rows that hit the length limit without choosing <|endoftext|>."""
        return [len(new) >= max_new_tokens for new in self.completions]

    def replace_group(self, group: int, other: Rollouts, other_group: int, size: int) -> None:
        """Put `other`'s group `other_group` in the place of this batch's group `group` (groups of `size` rows)."""
        mine, theirs = slice(group * size, (group + 1) * size), slice(other_group * size, (other_group + 1) * size)
        for name in ("prompts", "prompt_ids", "completions", "loops", "logprobs", "kept", "rewards"):
            getattr(self, name)[mine] = getattr(other, name)[theirs]


def round_uniforms(seed: int, step: int, round_: int, rows: torch.Tensor, batch: int, device):
    """Sampling draws for new token t of the rows `rows` (indices into the step's whole batch of `batch` rows):
    from (seed, step, round, t) alone."""
    base = seed + 0x5EED if round_ == 0 else mix_seed(seed + 0x5EED, 1_000_000 + round_)

    def draw(t: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(mix_seed(base, step * 65_536 + t))
        return torch.rand(batch, generator=gen, dtype=torch.float64)[rows].to(device)

    return draw


def sample_groups(
    trainer, step: int, round_: int, groups: list[int], prompts: list[Prompt], ids: list[list[int]], ks: list[int]
) -> Rollouts:
    """`rl.group_size` completions of each group (global index `groups[i]`, prompt `prompts[i]` with token ids
    `ids[i]`, loop count `ks[i]`), decoded `rl.rollout_rows` at a time in order of k, scored."""
    r, G, t = trainer.cfg.rl, trainer.cfg.rl.group_size, trainer
    rows = [(g * G + j, i) for i, g in enumerate(groups) for j in range(G)]  # (row in the whole batch, group)
    order = sorted(range(len(rows)), key=lambda n: ks[rows[n][1]])
    chunk = r.rollout_rows or len(order)
    new: list[list[int]] = [[] for _ in rows]
    logprobs: list[torch.Tensor] = [torch.zeros(0)] * len(rows)
    kept: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)] * len(rows)
    sampling = Sampling(r.temperature, 0, r.top_p)
    t.model.eval()
    t.model.record_loop_statistics(False)
    for first in range(0, len(order), chunk):
        part = order[first : first + chunk]
        batch_rows = torch.tensor([rows[n][0] for n in part])
        out = generate(
            t.model,
            [ids[rows[n][1]] for n in part],
            [ks[rows[n][1]] for n in part],
            r.max_new_tokens,
            t.tokenizer.eot_id,
            kv_mode=r.rollout_kv,
            sampling=sampling,
            uniforms=round_uniforms(t.cfg.training.seed, step, round_, batch_rows, t.global_batch, t.device),
            all_done=t.all_done(),
            with_logprobs=True,
            compile=r.rollout_compile,
        )
        for m, n in enumerate(part):
            scored = len(out.tokens[m]) + (len(out.tokens[m]) < r.max_new_tokens)  # the closing <|endoftext|>
            new[n], logprobs[n], kept[n] = out.tokens[m], out.logprobs[m, :scored].cpu(), out.kept[m, :scored].cpu()
    t.model.train()
    row_prompts = [prompts[i] for _, i in rows]
    rewards = [
        score(t.reward, p.text, t.tokenizer.decode(c), p.answer)
        + overlong_penalty(len(c) + (len(c) < r.max_new_tokens), r.max_new_tokens, r.overlong_buffer)
        for p, c in zip(row_prompts, new)
    ]
    return Rollouts(row_prompts, [ids[i] for _, i in rows], new, [ks[i] for _, i in rows], logprobs, kept, rewards)


def without_signal(rewards: list[float], group_size: int) -> list[int]:
    """The groups (indices) whose completions all scored alike."""
    return [
        g for g in range(len(rewards) // group_size) if len(set(rewards[g * group_size : (g + 1) * group_size])) == 1
    ]
