"""Elastic depth at inference: mixed budgets in one batch, self-speculative decoding, adaptive exit."""

from __future__ import annotations

import pytest
import torch

from elr.infer.cache import InferenceCache
from elr.infer.generate import generate, left_pad
from test_infer import ROWS_PROMPTS, small_model

VARIANTS = [{}, {"recurrent_input": "state_plus_input", "update": "residual", "moe_route_replay": True},
            {"conditioning_exit": True}]


@torch.no_grad()
@pytest.mark.parametrize("overrides", VARIANTS)
def test_mixed_budgets_full_forward_equal_each_row_alone(overrides):
    model = small_model(**overrides)
    tokens = torch.tensor([[5, 9, 2, 33, 7, 1], [8, 8, 60, 2, 11, 4], [19, 3, 27, 50, 6, 9]])
    budgets = torch.tensor([1, 3, 2])
    got = model(tokens, budgets)
    for b, k in enumerate(budgets.tolist()):
        torch.testing.assert_close(got[b], model(tokens[b:b + 1], k)[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[0], model(tokens[:1], 3)[0], atol=1e-3)  # the budget matters


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
    return [logits[b, int(pad[b]):] for b in range(len(rows))]


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
    with pytest.raises(ValueError, match="2 loop counts for 3 prompts"):
        generate(model, prompts, [1, 2], max_new_tokens=2, eot_id=63)
    with pytest.raises(ValueError, match="outside 1..3"):
        generate(model, prompts, [1, 2, 4], max_new_tokens=2, eot_id=63)
