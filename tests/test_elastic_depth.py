"""Elastic depth at inference: mixed budgets in one batch, self-speculative decoding, adaptive exit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_infer import ROWS_PROMPTS, small_model
from trainer_utils import model_args

from elr.infer.cache import InferenceCache
from elr.infer.evaluate import decoded_loss, validation_loss
from elr.infer.generate import AdaptiveDepth, generate, left_pad
from elr.infer.speculative import SpeculationStats, speculative_generate
from elr.models import ELRModel, flavors
from elr.models.early_exit import ExitRule

VARIANTS = [
    {},
    {"recurrent_input": "state_plus_input", "update": "residual", "moe_route_replay": True},
    {"conditioning_exit": True},
    {"state_norm": True, "recurrent_input": "state_plus_adapted_input"},
]  # a finished row keeps its un-normed state


@torch.no_grad()
@pytest.mark.parametrize("overrides", VARIANTS)
def test_mixed_budgets_full_forward_equal_each_row_alone(overrides):
    model = small_model(**overrides)
    tokens = torch.tensor([[5, 9, 2, 33, 7, 1], [8, 8, 60, 2, 11, 4], [19, 3, 27, 50, 6, 9]])
    budgets = torch.tensor([1, 3, 2])
    got = model(tokens, budgets)
    for b, k in enumerate(budgets.tolist()):
        torch.testing.assert_close(got[b], model(tokens[b : b + 1], k)[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[0], model(tokens[:1], 3)[0], atol=1e-3)  # the budget matters


@torch.no_grad()
def test_a_loop_budget_is_one_int_or_one_count_per_row():
    """What `loops` may be (elr/models/budget.py): an int (numpy's too) is the plain forward; a list of
    counts is the LongTensor [B] it stands for; anything else is refused in one line."""
    model = small_model()
    tokens = torch.tensor([[5, 9, 2, 33], [8, 8, 60, 2], [19, 3, 27, 50]])
    assert torch.equal(model(tokens, np.int64(2)), model(tokens, 2))
    assert torch.equal(model(tokens, [1, 3, 2]), model(tokens, torch.tensor([1, 3, 2])))
    assert torch.equal(model(tokens, torch.tensor([1, 3, 2], dtype=torch.int32)), model(tokens, [1, 3, 2]))
    with pytest.raises(ValueError, match="2 loop counts for a batch of 3"):
        model(tokens, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"\(3, 1\) loop counts for a batch of 3"):
        model(tokens, torch.tensor([[1], [2], [3]]))
    with pytest.raises(ValueError, match="whole loop counts, not torch.float32"):
        model(tokens, torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(TypeError):
        model(tokens, 2.0)


@torch.no_grad()
def decode_with_budgets(model, rows, prompt_lens, budgets, mode):
    """incremental_logits with one loop count per row."""
    n_decode = len(rows[0]) - prompt_lens[0]
    tokens, pad = left_pad([r[:p] for r, p in zip(rows, prompt_lens)], pad_id=0, device="cpu")
    loops = torch.tensor(budgets)
    cache = InferenceCache(model, len(rows), tokens.shape[1] + n_decode, max(budgets), mode, pad)
    chunks = [model(tokens, loops, cache)]
    for t in range(n_decode):
        chunks.append(model(torch.tensor([[r[p + t]] for r, p in zip(rows, prompt_lens)]), loops, cache))
    logits = torch.cat(chunks, dim=1)
    return [logits[b, int(pad[b]) :] for b in range(len(rows))]


@pytest.mark.parametrize("mode", ["per_loop", "last_loop_kv", "last_loop"])
@pytest.mark.parametrize("overrides", VARIANTS)
def test_mixed_budgets_decoding_equals_each_row_alone(mode, overrides):
    """Budgets 1..K in one batch through the KV cache: each row's logits are those it gets decoded
    alone at its own k (a finished row's shared entries stay its own last loop)."""
    model = small_model(**overrides)
    rows, prompt_lens = ROWS_PROMPTS
    budgets = [3, 1, 2]
    got = decode_with_budgets(model, rows, prompt_lens, budgets, mode)
    for row, p, k, logits in zip(rows, prompt_lens, budgets, got):
        alone = decode_with_budgets(model, [row], [p], [k], mode)[0]
        torch.testing.assert_close(logits, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["per_loop", "last_loop_kv"])
def test_generate_takes_a_budget_per_prompt(mode):
    model = small_model()
    prompts = [[5, 9, 2, 33, 7], [8, 60], [19, 3, 27]]
    budgets = [1, 2, 3]
    batch = generate(model, prompts, budgets, max_new_tokens=8, eot_id=63, kv_mode=mode)
    for prompt, k, out in zip(prompts, budgets, batch):
        assert out == generate(model, [prompt], k, max_new_tokens=8, eot_id=63, kv_mode=mode)[0]
    assert len({tuple(o) for o in generate(model, prompts[:1] * 3, budgets, 8, 63, mode)}) > 1  # k changes the text
    with pytest.raises(ValueError, match="2 loop counts for a batch of 3"):
        generate(model, prompts, [1, 2], max_new_tokens=2, eot_id=63)
    with pytest.raises(ValueError, match="outside 1..3"):
        generate(model, prompts, [1, 2, 4], max_new_tokens=2, eot_id=63)


def study_model(seed: int = 0) -> ELRModel:
    """study_gpt (attention only: the cache rewinds by its length) with conditioning, nudged off init."""
    args = model_args(
        flavors["study_gpt"], max_seq_len=96, max_loops=3, update="adaptive_delta", conditioning=True, cond_dim=16
    )
    torch.manual_seed(seed)
    model = ELRModel(args)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize(
    "build,mode",
    [
        (small_model, "per_loop"),
        (study_model, "per_loop"),
        (lambda: small_model(layer_pattern="GF" + "GEGF" + "AF"), "last_loop_kv"),
    ],
)
def test_self_speculative_greedy_equals_plain_decoding(build, mode):
    """Drafted at k=1 (and k=2), verified at k=3: the plain k=3 greedy text, token for token. The debug
    model has GDP layers (rejections rewind a snapshot and re-feed); study_gpt has none (rewind by
    length); with no attention in the recurrent block last_loop_kv decodes as per_loop does."""
    model = build()
    prompts = [[5, 9, 2, 33, 7], [8, 60], [19, 3, 27, 50, 6, 9, 14]]
    want = [generate(model, [p], 3, max_new_tokens=12, eot_id=-1, kv_mode=mode)[0] for p in prompts]
    total = SpeculationStats()
    for draft_loops, draft_tokens in [(1, 3), (2, 4), (1, 1)]:
        got, stats = speculative_generate(model, prompts, 3, 12, -1, mode, draft_loops, draft_tokens)
        assert got == want, (draft_loops, draft_tokens)
        total.add(stats)
    assert 0 < total.accepted < total.drafted  # both the accepting and the rejecting path ran
    got, stats = speculative_generate(model, prompts, 3, 12, -1, mode, draft_loops=3, draft_tokens=4)
    assert got == want and stats.accepted == stats.drafted and stats.rounds < 3 * 12  # drafting at K: all kept


def reference_speculation(model, prompt, loops, new, mode, draft_loops, draft_tokens) -> SpeculationStats:
    """The rounds speculative decoding must make if its drafts are the model's own greedy tokens at
    `draft_loops` from the accepted text, computed with plain `generate` at both k."""
    target = generate(model, [prompt], loops, max_new_tokens=new, eot_id=-1, kv_mode=mode)[0]
    stats, count = SpeculationStats(), 1
    while count < new:
        n = min(draft_tokens, new - count)
        drafts = generate(model, [prompt + target[:count]], draft_loops, n, eot_id=-1, kv_mode=mode)[0]
        accepted = 0
        while accepted < n and drafts[accepted] == target[count + accepted]:
            accepted += 1
        stats.drafted, stats.accepted, stats.rounds = stats.drafted + n, stats.accepted + accepted, stats.rounds + 1
        count = min(new, count + accepted + 1)
    return stats


@torch.no_grad()
@pytest.mark.parametrize(
    "build,mode",
    [(small_model, "per_loop"), (study_model, "per_loop")],
)
def test_self_speculative_drafts_are_the_model_at_the_draft_k(build, mode):
    """Each round's drafts are what plain greedy decoding at the drafting k proposes from the accepted text,
    so the acceptance is the model's own k = j against k = K. (Drafts that read keys a K-loop forward wrote
    are another model: they fail this.) GDP layers (small_model) rewind the drafting cache by a snapshot. In
    per_loop mode, where speculative text is plain greedy text (the test above)."""
    model = build()
    prompts = [[5, 9, 2, 33, 7], [19, 3, 27, 50, 6, 9, 14]]
    for draft_loops, draft_tokens in [(1, 3), (2, 4)]:
        want = SpeculationStats()
        for prompt in prompts:
            want.add(reference_speculation(model, prompt, 3, 12, mode, draft_loops, draft_tokens))
        got = speculative_generate(model, prompts, 3, 12, -1, mode, draft_loops, draft_tokens)[1]
        assert (got.drafted, got.accepted, got.rounds) == (want.drafted, want.accepted, want.rounds)
        assert 0 < want.accepted < want.drafted


def test_self_speculative_stops_at_end_of_text_and_checks_its_options():
    model = small_model()
    prompt = [5, 9, 2, 33, 7]
    plain = generate(model, [prompt], 3, max_new_tokens=10, eot_id=-1)[0]
    eot = plain[4]  # stop at the fifth token
    want = generate(model, [prompt], 3, max_new_tokens=10, eot_id=eot)[0]
    assert len(want) < 10
    assert speculative_generate(model, [prompt], 3, 10, eot, draft_loops=1, draft_tokens=3)[0] == [want]
    with pytest.raises(ValueError, match="draft loops must lie in 1..3"):
        speculative_generate(model, [prompt], 3, 10, eot, draft_loops=4)
    with pytest.raises(ValueError, match="draft tokens must be at least 1"):
        speculative_generate(model, [prompt], 3, 10, eot, draft_tokens=0)


def prefix_model(**overrides) -> ELRModel:
    """No budget embedding (loop i is the same at every k) and exit heads: an exit at loop j reads the
    state a k = j forward reads, with the exit FiLM of budget j."""
    return small_model(conditioning_budget=False, conditioning_exit=True, **overrides)


def test_exit_rules_and_their_spelling():
    s_prev, s = torch.ones(1, 2, 4), torch.ones(1, 2, 4)
    s[0, 1] *= 1.5  # token 1 moved by half its norm
    assert ExitRule("state", 0.1).exits(s_prev, s, None, None).tolist() == [[True, False]]
    logp = torch.tensor([[[0.0, -9.0], [0.0, -9.0]]]).log_softmax(-1)
    moved = torch.tensor([[[0.0, -9.0], [-9.0, 0.0]]]).log_softmax(-1)
    assert not ExitRule("kl", 0.1).exits(s_prev, s, None, logp).any()  # never after the first loop
    assert ExitRule("kl", 0.1).exits(s_prev, s, logp, moved).tolist() == [[True, False]]
    assert ExitRule.parse("kl:0.01") == ExitRule("kl", 0.01) and str(ExitRule("state", 0.05)) == "state:0.05"
    for bad, message in [
        ("entropy:1", "unknown exit rule 'entropy'"),
        ("state:0", "must be > 0"),
        ("state", "write RULE:THRESHOLD"),
    ]:
        with pytest.raises(ValueError, match=message):
            ExitRule.parse(bad)


@torch.no_grad()
def test_exit_thresholds_at_the_extremes_are_fixed_depths():
    """Nothing exits under a tiny threshold (the cap's forward); everything exits at the first loop
    the rule may (state: 1, kl: 2) under a huge one, which is the fixed-k forward there."""
    model = prefix_model()
    tokens = torch.tensor([[5, 9, 2, 33, 7, 1], [8, 8, 60, 2, 11, 4]])
    for rule, k in [
        (ExitRule("state", 1e-12), 3),
        (ExitRule("kl", 1e-12), 3),
        (ExitRule("state", 1e9), 1),
        (ExitRule("kl", 1e9), 2),
    ]:
        got = model(tokens, 3, exit_rule=rule)
        assert torch.equal(model.loops_used(), torch.full_like(tokens, k)), rule
        torch.testing.assert_close(got, model(tokens, k), atol=1e-5, rtol=1e-5)
    model(tokens, 3)
    assert model.loops_used() is None


def adaptive_decode(model, prompt, steps, mode, rule=None, loops_per_step=None):
    """Prefill at k=3, then feed `steps` tokens one at a time (teacher forced: prompt continues with
    fixed ids) by the exit rule or at the given loop counts; (logits per step, loops per step)."""
    cache = InferenceCache(model, 1, len(prompt) + steps, 3, mode)
    model(torch.tensor([prompt]), 3, cache)
    logits, used = [], []
    for t in range(steps):
        token = torch.tensor([[(7 * t + 3) % 60]])
        if rule is not None:
            logits.append(model(token, 3, cache, exit_rule=rule)[0, -1])
            used.append(int(model.loops_used()[0, 0]))
        else:
            logits.append(model(token, loops_per_step[t], cache)[0, -1])
    return torch.stack(logits), used, cache


@pytest.mark.parametrize("mode", ["per_loop", "last_loop_kv", "last_loop"])
@pytest.mark.parametrize("rule", [ExitRule("state", 0.45), ExitRule("kl", 0.05)])
def test_adaptive_decoding_is_decoding_each_token_at_the_loops_it_ran(mode, rule):
    """A token that exited at loop j is, for itself and for the tokens after it, a token decoded at
    k = j: its shared entries hold its own last loop; per-loop attention entries past j hold copies."""
    model = prefix_model()
    got, used, cache = adaptive_decode(model, [5, 9, 2, 33, 7], 10, mode, rule)
    assert len(set(used)) > 1, used  # the thresholds are picked so that exits differ
    want, _, _ = adaptive_decode(model, [5, 9, 2, 33, 7], 10, mode, loops_per_step=used)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if mode == "per_loop" and min(used) < 3:
        attention = next(layer for layer in model.recurrent.layers if layer.kind == "A")
        column = 5 + used.index(min(used))
        last, top = cache.entry(attention, min(used)), cache.entry(attention, 3)
        assert torch.equal(top.k[:, :, column], last.k[:, :, column])


@torch.no_grad()
def test_adaptive_generation_and_scoring_count_the_loops_they_ran():
    """At the extremes the decoder and the scorers are the fixed-k ones and count k loops a token; in
    between the mean lies between; generation at a middle threshold is greedy decoding whose every
    new token ran the loops it reports."""
    model = prefix_model()
    prompts = [[5, 9, 2, 33, 7], [8, 60]]
    never, always = AdaptiveDepth(ExitRule("state", 1e-12)), AdaptiveDepth(ExitRule("state", 1e9))
    assert generate(model, prompts, 3, 6, eot_id=63, adaptive=never) == generate(model, prompts, 3, 6, eot_id=63)
    assert never.mean_loops == 3 and never.tokens == 2 * 5  # the prompt is read at the cap, not counted
    generate(model, prompts, 3, 6, eot_id=63, adaptive=always)
    assert always.mean_loops == 1
    middle = AdaptiveDepth(ExitRule("state", 0.45))
    generate(model, prompts, 3, 6, eot_id=63, adaptive=middle)
    assert 1 < middle.mean_loops < 3
    with pytest.raises(ValueError, match="give one loop count"):
        generate(model, prompts, [1, 3], 6, eot_id=63, adaptive=middle)

    tokens = np.arange(400) % 61
    fixed = {k: validation_loss(model, tokens, 16, k, batches=2, batch_size=4) for k in (1, 3)}
    for rule, k in [(ExitRule("kl", 1e-12), 3), (ExitRule("state", 1e9), 1)]:
        depth = AdaptiveDepth(rule)
        assert validation_loss(model, tokens, 16, 3, 2, 4, depth) == pytest.approx(fixed[k], rel=1e-5)
        assert depth.mean_loops == k and depth.tokens == 2 * 4 * 16
        depth = AdaptiveDepth(rule)  # decoded: the first half read at the cap, the second at the rule's depth
        got = decoded_loss(model, tokens, 16, 3, "last_loop_kv", 3, depth)
        assert depth.mean_loops == k and depth.tokens == 3 * 8
        at_the_cap = decoded_loss(model, tokens, 16, 3, "last_loop_kv", windows=3)
        assert (got == pytest.approx(at_the_cap, rel=1e-5)) == (k == 3)
