"""Experts as grouped GEMMs equal the per-expert loop, forward and backward, in eager and compiled form."""

import dataclasses

import pytest
import torch

import elr.models.ffn as ffn
from elr.models import flavors
from elr.models.experts import grouped_experts, grouped_mm, looped_experts, permute_tokens

DEBUG = flavors["debug"]


def forward_backward(moe, x, upstream):
    moe.zero_grad()
    x = x.clone().requires_grad_()
    out = moe(x)
    out.backward(upstream)  # a random upstream gradient: _grouped_mm rejects zero-stride ones
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in moe.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_moe_equals_the_expert_loop(monkeypatch, dtype):
    torch.manual_seed(0)
    moe = ffn.MoE(dataclasses.replace(DEBUG, moe_routed_scale=2.5)).to(dtype)
    moe.init_weights(0.02)
    # steer most tokens away from experts 0-2 so some groups are empty
    moe.expert_bias.copy_(torch.tensor([-9.0, -9.0, -9.0, 0, 0, 0, 0, 0]))
    x, upstream = torch.randn(2, 7, DEBUG.dim, dtype=dtype), torch.randn(2, 7, DEBUG.dim, dtype=dtype)
    grouped = forward_backward(moe, x, upstream)
    monkeypatch.setattr(ffn, "grouped_experts", looped_experts)
    looped = forward_backward(moe, x, upstream)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grouped[0], looped[0], **tol)
    torch.testing.assert_close(grouped[1], looped[1], **tol)
    for name in looped[2]:
        torch.testing.assert_close(grouped[2][name], looped[2][name], **tol, msg=name)
    assert looped[2]["w1"][:3].abs().sum() == 0 and grouped[2]["w1"][:3].abs().sum() == 0


def test_permutation_groups_pairs_by_expert_and_survives_a_zero_stride_gradient():
    indices = torch.tensor([[3, 1], [1, 0], [3, 2]])
    order, token_of, offsets = permute_tokens(indices, 5)
    assert indices.flatten()[order].tolist() == [0, 1, 1, 2, 3, 3]
    assert token_of.tolist() == [1, 0, 1, 2, 0, 2]
    assert offsets.tolist() == [1, 3, 4, 6, 6] and offsets.dtype == torch.int32
    xs = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(5, 16, 8, requires_grad=True)
    grouped_mm(xs, w, offsets).sum().backward()  # expand()ed gradient of sum(): made contiguous
    torch.testing.assert_close(xs.grad[0], w[0].detach().sum(-1))


@pytest.mark.slow
def test_compiled_grouped_experts_match_eager_in_fp32(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    xs, w1, w2 = torch.randn(10, 16), torch.randn(4, 32, 16), torch.randn(4, 16, 32)
    offsets = torch.tensor([3, 3, 8, 10], dtype=torch.int32)
    compiled = torch.compile(grouped_experts, fullgraph=True)
    torch.testing.assert_close(compiled(xs, w1, w2, offsets), looped_experts(xs, w1, w2, offsets))
