"""The [rl] section: the keys of the RLVR stage (elr/rl, docs/rl.md) and their check, one error naming the key.

A section of elr/config/job.py's JobConfig, in its own file for its size; plain data like the rest of the
package. What the stage asks of the other sections is among the rules across sections (elr/config/checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elr.config.keys import check_fields, require


@dataclass
class RL:
    """[rl]: each key's meaning is the string under its field. The RLVR stage (elr/rl, docs/rl.md): groups of
    completions sampled from prompts with verifiable answers, a group-relative policy-gradient update. Its batch
    is `training.global_batch_size` completions (prompts x `group_size`), `training.local_batch_size` of them per
    forward and backward; `training.steps` counts batches of rollouts, each at one k per group drawn from
    `elr.loop_weights` (the paper's 4:1:1:1) by `elr.sampling`."""

    enable: bool = False
    """true: train.py runs the RLVR stage (needs `checkpoint.initial_load_path`, the SFT model) instead of
    next-token prediction on `data.path`"""
    prompts: str = ""
    """a JSONL file of `{"prompt": text or chat messages, "answer": text}`; or built in: `arithmetic` (sums, as the
    bundled chat data asks them), `var_chain` or `pointer_chase` (the depth-bound tasks in words, 8192 fixed
    questions each, elr/text/depth_questions.py); 1 prompt in 16 (by a hash of its text) is held out for evaluation"""
    group_size: int = 8
    """completions per prompt (G >= 2: a group's advantages compare its completions)"""
    max_new_tokens: int = 64
    """a completion's length limit; it stops earlier at <|endoftext|>"""
    temperature: float = 1.0
    """rollout sampling temperature (> 0); the update's log-probs (the policy's, the reference's, the entropy's) are
    taken at the same temperature, so it scores the distribution that was sampled"""
    top_p: float = 1.0
    """rollout nucleus sampling (1: off); below 1 the update renormalises each token's distribution over the
    sampler's own nucleus (the same number of most likely tokens, the sampled one always in it)"""
    rollout_kv: Literal["last_loop_kv", "per_loop", "last_loop"] = "per_loop"
    """the rollouts' inference cache: `per_loop` (exact: the sampler's log-probs are the training forward's, so the
    update is on-policy with no correction; docs/rl.md measures its cost), `last_loop_kv` (the paper's decoding
    mode: attention KV at its one-loop size) or `last_loop`; the two shared caches sample from a slightly
    different distribution at k >= 2, which `rollout_correction` weighs back"""
    rollout_compile: bool = False
    """true: rollouts and the held-out evaluation decode through the compiled step over a static cache
    (elr/infer/decode.py; the same tokens as eager decoding), compiled once per loop cap on first use; one
    process only (a sharded model decodes eagerly, so more ranks are refused)"""
    rollout_rows: int = 0
    """completions decoded in one batch (0: all of a rank's at once); rows go in order of k, so a batch's deepest
    row sizes its cache: what bounds the rollout peak of the memory plan"""
    rollout_correction: Literal["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"] = "sequence_mask"
    """with a cache that is not exact: truncated importance sampling from the sampler to the training policy, as
    TRL corrects vLLM rollouts (its names and default): the ratio pi/mu per completion (`sequence_*`, the product
    over its tokens) or per token (`token_*`), above `rollout_correction_cap` set to 0 (`*_mask`) or to the cap
    (`*_truncate`); every token's loss is weighted by it. Biased where it caps, as TRL's"""
    rollout_correction_cap: float = 3.0
    """the importance ratio's cap (>= 1; TRL's 3)"""
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = "dapo"
    """the loss's normalisation, as TRL names it: `dapo` (summed over the tokens of an update's completions, over
    their count: long completions weigh by their tokens, DAPO's token-level loss), `grpo` (each completion's mean
    over its tokens, then the mean over completions: GRPO as published) or `dr_grpo` (summed over tokens, over
    completions x max_new_tokens: a constant, no length bias, Dr. GRPO)"""
    scale_rewards: Literal["group", "none"] = "group"
    """the advantage: a reward minus its group's mean, over the group's std (`group`, GRPO) or not (`none`,
    Dr. GRPO)"""
    clip_low: float = 0.2
    """the ratio's lower clip, 1 - clip_low"""
    clip_high: float = 0.28
    """the ratio's upper clip, 1 + clip_high (DAPO's clip-higher)"""
    kl_coeff: float = 0.0
    """> 0: a KL penalty to the stage's initial model (a frozen copy; k3 estimator); 0: no reference model"""
    minibatches: int = 1
    """optimizer updates per pass over a batch of rollouts, each on its own share of the completions in turn
    (TRL's steps_per_generation, verl's mini-batches): from the second on the policy has moved and the ratio
    against the rollout policy, and so the clip, acts"""
    updates_per_batch: int = 1
    """passes over each batch of rollouts (TRL's num_iterations, PPO's epochs); a step makes minibatches x
    updates_per_batch optimizer updates"""
    dynamic_sampling_rounds: int = 0
    """DAPO's dynamic sampling: up to this many extra rounds refill the place of a group whose rewards were all
    equal (no signal) with a fresh prompt at the same k; 0: off"""
    mask_truncated_completions: bool = False
    """true: completions that hit max_new_tokens without <|endoftext|> are left out of the loss (DAPO's overlong
    filtering, TRL's name)"""
    overlong_buffer: int = 0
    """> 0: DAPO's soft overlong punishment, added to the reward: 0 up to max_new_tokens - overlong_buffer
    completion tokens, then falling linearly to -1 at max_new_tokens"""
    loop_credit: Literal["last", "uniform", "progressive"] = "last"
    """`last`: the policy is the readout after the group's k loops (plain GRPO on a looped model); else RLTT
    (arXiv 2602.10520): the loss of the readout after each loop 1..k, weighted `uniform`
    (1/k each) or `progressive` (t^alpha / sum s^alpha, `loop_credit_alpha`); the samples are drawn at k, so only
    the last loop's term is on-policy (docs/rl.md). Needs a prefix-consistent recurrence"""
    loop_credit_alpha: float = 1.0
    """the exponent of `progressive` loop credit (1: weights proportional to the loop's index)"""
    reward: str = "exact"
    """`exact` (1 if the extracted answer equals the normalised reference, else 0) or `module:function`, a Python
    function (prompt, completion, answer) -> number that this config names and so runs"""
    answer_format: Literal["last_number", "boxed", "text"] = "last_number"
    """how `exact` extracts a completion's answer: `last_number`, `boxed` (the last \\boxed{...}) or `text` (the
    whole completion)"""
    eval_prompts: int = 64
    """held-out prompts answered greedily at every k at each evaluation (`validation.freq`)"""
    samples_every: int = 50
    """steps between the table of sample completions written to samples.jsonl (and TensorBoard); 0: never"""

    def check(self) -> None:
        """The stage's own keys, when it runs; what it asks of the rest of the job (the starting model, the batch,
        data parallelism only): elr/config/checks.py."""
        check_fields(self, "rl")
        if not self.enable:
            return
        require(
            self.prompts != "",
            "rl.prompts",
            'must name a JSONL file of {"prompt", "answer"}, or `arithmetic`, `var_chain`, `pointer_chase`',
            self.prompts,
        )
        require(
            self.group_size >= 2,
            "rl.group_size",
            "must be >= 2 (a group's advantages compare its completions)",
            self.group_size,
        )
        require(self.max_new_tokens >= 1, "rl.max_new_tokens", "must be >= 1", self.max_new_tokens)
        require(self.temperature > 0, "rl.temperature", "must be > 0 (rollouts sample)", self.temperature)
        require(0 < self.top_p <= 1, "rl.top_p", "must lie in (0, 1]", self.top_p)
        require(0 < self.clip_low < 1, "rl.clip_low", "must lie in (0, 1)", self.clip_low)
        require(self.clip_high > 0, "rl.clip_high", "must be > 0", self.clip_high)
        require(self.kl_coeff >= 0, "rl.kl_coeff", "must be >= 0 (0: no reference model)", self.kl_coeff)
        require(self.updates_per_batch >= 1, "rl.updates_per_batch", "must be >= 1", self.updates_per_batch)
        require(self.minibatches >= 1, "rl.minibatches", "must be >= 1", self.minibatches)
        require(self.rollout_rows >= 0, "rl.rollout_rows", "must be >= 0 (0: all at once)", self.rollout_rows)
        require(
            self.rollout_correction_cap >= 1,
            "rl.rollout_correction_cap",
            "must be >= 1 (a ratio of 1 is on-policy)",
            self.rollout_correction_cap,
        )
        require(
            self.dynamic_sampling_rounds >= 0,
            "rl.dynamic_sampling_rounds",
            "must be >= 0 (0: off)",
            self.dynamic_sampling_rounds,
        )
        require(
            0 <= self.overlong_buffer < self.max_new_tokens,
            "rl.overlong_buffer",
            f"must lie in [0, rl.max_new_tokens = {self.max_new_tokens}) (0: off)",
            self.overlong_buffer,
        )
        require(self.loop_credit_alpha >= 0, "rl.loop_credit_alpha", "must be >= 0", self.loop_credit_alpha)
        require(self.eval_prompts >= 1, "rl.eval_prompts", "must be >= 1", self.eval_prompts)
        require(self.samples_every >= 0, "rl.samples_every", "must be >= 0 (0: never)", self.samples_every)
        module, _, function = self.reward.partition(":")
        require(
            self.reward == "exact"
            or (
                module
                and function
                and all(part.isidentifier() for part in module.split("."))
                and function.isidentifier()
            ),
            "rl.reward",
            "must be `exact` or `module:function` (a Python function of prompt, completion, answer)",
            self.reward,
        )
