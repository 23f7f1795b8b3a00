"""The RLVR update scores what the rollouts sampled: the sampler's log-prob of each chosen token (after temperature
and top-p) against the update's, for every cache mode, k, temperature and top-p; equal where the cache is exact,
weighed back by the importance correction (its statistics per k) where it is not. And the rows the update reads:
<|endoftext|> scored only where a row stopped there."""

import pytest
import torch
from trainer_utils import DEBUG_TOML, model_args

from elr.config import load_config
from elr.infer.cache import MODES
from elr.infer.generate import Sampling, generate, sample_with_logprobs, sampling_logits
from elr.models import build_model, flavors
from elr.rl.correction import importance_weights
from elr.rl.logprobs import token_logprobs
from elr.rl.rollout import Rollouts
from elr.rl.update import EXACT_CACHES, RatioStats, plan, ratio_and_weights

K, NEW, EOT, VOCAB = 3, 10, 124, 128  # 124: a token this model samples often, so some rows stop
PROMPTS = [[1, 7, 9, 2], [3, 4], [8, 8, 1, 2, 3], [6, 2, 9], [4, 4, 4, 1], [2, 11], [9, 3, 3], [7, 1, 5, 8]]


@pytest.fixture(scope="module")
def model():
    """task_gpt (attention in the loops) at K = 3, away from the identity init so every k differs."""
    torch.manual_seed(0)
    m = build_model(model_args(flavors["task_gpt"], max_seq_len=32, max_loops=K, update="adaptive_delta"))
    m.init_weights()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim > 1:
                torch.nn.init.normal_(p, std=0.1)
    return m.eval()


def rollouts(model, mode: str, k: int, sampling: Sampling) -> Rollouts:
    out = generate(
        model,
        PROMPTS,
        k,
        NEW,
        EOT,
        kv_mode=mode,
        sampling=sampling,
        generator=torch.Generator().manual_seed(k),
        with_logprobs=True,
    )
    scored = [len(t) + (len(t) < NEW) for t in out.tokens]
    return Rollouts(
        [None] * len(PROMPTS),
        PROMPTS,
        out.tokens,
        [k] * len(PROMPTS),
        [out.logprobs[i, :n] for i, n in enumerate(scored)],
        [out.kept[i, :n] for i, n in enumerate(scored)],
        [0.0] * len(PROMPTS),
    )


def rl_config(temperature: float, top_p: float, *extra: str):
    return load_config(
        DEBUG_TOML,
        [
            "--rl.temperature",
            str(temperature),
            "--rl.top_p",
            str(top_p),
            "--rl.max_new_tokens",
            str(NEW),
            "--training.local_batch_size",
            str(len(PROMPTS)),
            *extra,
        ],
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.7, 0.9)])
def test_the_update_scores_the_samplers_distribution(model, mode, temperature, top_p):
    """Per k: the update's log-prob of every scored token (the training forward at the sampling temperature,
    over the sampler's nucleus) against the sampler's own. The exact cache agrees to 1e-5 at every k; a shared
    cache agrees at k = 1 (one loop: nothing to share) and differs after, and there the update weighs each
    completion by pi_old / mu (TRL's sequence mask, cap 3) and logs the ratio per k. At T = 1, top_p = 1 with
    the update's log-probs at T = 1 (as the stage took them before issue 59) the exact mode still agrees; at
    T = 0.7 or top_p = 0.9 such an update would not: the last assertion shows by how much."""
    cfg = rl_config(temperature, top_p, "--rl.rollout_kv", mode)
    stats = RatioStats(K, "cpu")
    stopped = truncated = 0
    for k in range(1, K + 1):
        batch = rollouts(model, mode, k, Sampling(temperature, 0, top_p))
        stopped += sum(len(t) < NEW for t in batch.completions)
        truncated += sum(batch.truncated(NEW))
        ((m,),) = plan(batch, torch.zeros(len(PROMPTS)), cfg, EOT, VOCAB, "cpu")
        with torch.no_grad():
            logp, _ = token_logprobs(model, m.tokens, k, 0, False, temperature, m.kept)
            plain, _ = token_logprobs(model, m.tokens, k)  # T = 1, the whole vocabulary
        gap = (logp - m.behaviour)[m.mask].abs().max().item()
        if mode in EXACT_CACHES or k == 1:
            assert gap < 1e-5, (mode, k, gap)
        else:
            assert gap > 1e-4, (mode, k, gap)  # the sampler is not the training forward: the correction's job
        weight, ratio, capped = ratio_and_weights(cfg, m, logp, apply=mode not in EXACT_CACHES)
        stats.add(m.ks, m.mask, ratio, capped)
        want = torch.exp(((logp - m.behaviour) * m.mask).sum(-1))
        torch.testing.assert_close(ratio, want)
        if mode in EXACT_CACHES:
            assert weight is None  # on-policy: no weight
        else:
            expected = torch.where(want > 3.0, 0.0, want)[:, None] * m.mask
            torch.testing.assert_close(weight, expected)
        if (temperature, top_p) != (1.0, 1.0):
            assert (plain - m.behaviour)[m.mask].abs().max() > 1e-2  # the temperature or the nucleus matters
    assert stopped and truncated  # rows that chose <|endoftext|> (scored) and rows cut at the limit
    logged = stats.scalars()
    for k in range(1, K + 1):
        for name in ("mean", "min", "max"):
            assert f"rl/is_ratio_{name}_k{k}" in logged
        assert 0.0 <= logged[f"rl/is_capped_k{k}"] <= 1.0
        assert logged[f"rl/is_ratio_min_k{k}"] <= logged[f"rl/is_ratio_mean_k{k}"] <= logged[f"rl/is_ratio_max_k{k}"]
    if mode in EXACT_CACHES:
        assert all(abs(logged[f"rl/is_ratio_{n}_k{k}"] - 1) < 1e-4 for n in ("min", "max") for k in range(1, K + 1))


def test_the_samplers_log_prob_is_of_the_distribution_it_drew_from():
    """sample_with_logprobs: the chosen token's log-prob under softmax(logits / T) cut to the nucleus, the
    nucleus size, and greedy decoding as a point mass."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    u = torch.tensor([0.999], dtype=torch.float64)  # the last token of whatever support the distribution has
    ids, logp, kept = sample_with_logprobs(logits, Sampling(0.7, 0, 0.9), uniforms=u)
    full = (logits / 0.7).softmax(-1)[0]
    support = int((full.cumsum(0) - full < 0.9).sum())  # tokens ranked before the mass reaches 0.9, and one more
    assert kept.item() == support and ids.item() == support - 1
    torch.testing.assert_close(logp, (full[ids] / full[:support].sum()).log())
    torch.testing.assert_close(sampling_logits(logits, Sampling(0.7, 0, 0.9)).log_softmax(-1)[0, ids], logp)
    ids, logp, kept = sample_with_logprobs(logits, Sampling(0.0))
    assert ids.item() == 0 and logp.item() == 0.0 and kept.item() == 1


def test_eos_is_scored_only_where_a_row_stopped():
    """A row that chose <|endoftext|> is scored through it (the policy chose to stop: that choice is trained);
    a row cut at max_new_tokens has no end token and nothing after its last token is scored; the sampler's
    log-probs line up with the positions that predict each scored token."""
    batch = Rollouts(
        [None] * 3,
        [[1, 2, 3], [4, 5], [6]],
        [[7, 8], [9, 9, 9, 9], []],
        [1, 1, 1],
        [torch.tensor([-0.1, -0.2, -0.3]), torch.tensor([-0.4, -0.5, -0.6, -0.7]), torch.tensor([-0.8])],
        [torch.tensor([VOCAB] * 3), torch.tensor([VOCAB] * 4), torch.tensor([VOCAB])],
        [0.0, 0.0, 0.0],
    )
    rows, starts, ends = batch.sequences(EOT, 4)
    assert rows == [[1, 2, 3, 7, 8, EOT], [4, 5, 9, 9, 9, 9], [6, EOT]]  # the full row has no end token
    assert (starts, ends) == ([3, 2, 1], [6, 6, 2]) and batch.truncated(4) == [False, True, False]
    ((m,),) = plan(batch, torch.zeros(3), rl_config(1.0, 1.0, "--rl.max_new_tokens", "4"), EOT, VOCAB, "cpu")
    by_row = {tuple(r): i for i, r in enumerate(m.tokens.tolist())}
    first = by_row[(1, 2, 3, 7, 8, EOT)]
    assert m.mask[first].tolist() == [False, False, True, True, True]  # predicting 7, 8 and the end token
    assert m.behaviour[first, 2:].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    dropped = plan(
        batch,
        torch.zeros(3),
        rl_config(1.0, 1.0, "--rl.max_new_tokens", "4", "--rl.mask_truncated_completions", "true"),
        EOT,
        VOCAB,
        "cpu",
    )[0][0]
    assert dropped.mask.sum(-1).tolist() == [3, 0, 1]  # the cut row leaves the loss


def test_token_level_correction_truncates_and_masks_per_token():
    old = torch.log(torch.tensor([[1.0, 4.0, 0.5], [2.0, 2.0, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    behaviour = torch.zeros(2, 3)
    weight, ratio, capped = importance_weights(old, behaviour, mask, "token_truncate", 3.0)
    torch.testing.assert_close(weight, torch.tensor([[1.0, 3.0, 0.5], [2.0, 2.0, 0.0]]))
    weight, _, _ = importance_weights(old, behaviour, mask, "token_mask", 3.0)
    torch.testing.assert_close(weight, torch.tensor([[1.0, 0.0, 0.5], [2.0, 2.0, 0.0]]))
    weight, ratio, capped = importance_weights(old, behaviour, mask, "sequence_truncate", 3.0)
    torch.testing.assert_close(ratio, torch.tensor([2.0, 4.0]))  # the products over each completion's tokens
    torch.testing.assert_close(weight, torch.tensor([[2.0, 2.0, 2.0], [3.0, 3.0, 0.0]]))
    assert capped.tolist() == [False, True]
