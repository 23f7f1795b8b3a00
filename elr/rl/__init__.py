"""The RLVR stage (reinforcement learning with verifiable rewards), the fourth Koi stage: prompts with
checkable answers (prompts.py), rewards (rewards.py), rollouts through the project's own batched
inference with the sampler's log-prob of every token (rollout.py), the group-relative clipped objective
(objective.py), the importance correction for a cache that is not exact (correction.py), per-token log-probs at
a group's k and the sampling temperature (logprobs.py), the update's minibatches and a microbatch's loss
(update.py), and the trainer that puts them together (trainer.py, a Trainer whose step is a batch of rollouts and
its updates). docs/rl.md.

It imports training (elr.train) and inference (elr.infer) and everything below them; only train.py,
scripts and tools import it.
"""
