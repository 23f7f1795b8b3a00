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
    """rollout sampling temperature (> 0)"""
    top_p: float = 1.0
    """rollout nucleus sampling (1: off)"""
    rollout_kv: Literal["last_loop_kv", "per_loop", "last_loop"] = "last_loop_kv"
    """the rollouts' inference cache: `last_loop_kv` (the paper's: attention KV at its one-loop size), `per_loop`
    (exact) or `last_loop`; the update recomputes every log-prob with the training forward whatever it is"""
    rollout_compile: bool = False
    """true: rollouts and the held-out evaluation decode through the compiled step over a static cache
    (elr/infer/decode.py; the same tokens as eager decoding), compiled once per loop cap on first use; one
    process only (a sharded model decodes eagerly, so more ranks are refused)"""
    advantage: Literal["grpo", "dr_grpo"] = "grpo"
    """`grpo` (reward minus the group mean, over the group's std; loss averaged over the batch's completion tokens)
    or `dr_grpo` (no std; loss summed over tokens and divided by completions x max_new_tokens: no length bias)"""
    clip_low: float = 0.2
    """the ratio's lower clip, 1 - clip_low"""
    clip_high: float = 0.28
    """the ratio's upper clip, 1 + clip_high (DAPO's clip-higher)"""
    kl_coeff: float = 0.0
    """> 0: a KL penalty to the stage's initial model (a frozen copy; k3 estimator); 0: no reference model"""
    updates_per_batch: int = 1
    """optimizer updates on each batch of rollouts (after the first the ratio departs from 1 and the clip acts)"""
    loop_credit: Literal["last", "every_loop"] = "last"
    """`last` (the policy is the readout after the group's k loops) or `every_loop` (the objective averaged over
    the readouts after each loop 1..k, each its own policy at that budget: credit to every loop, our reading of
    RLTT, arXiv 2602.10520; needs a prefix-consistent recurrence)"""
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
