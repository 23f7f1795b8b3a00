"""The chunked cross entropy (elr/train/loss.py) equals the plain one in value and gradients, the
trainer gives the same losses with it on or off, and it keeps far less for backward."""

import pytest
import torch
import torch.nn.functional as F
from trainer_utils import DEBUG_TOML, records, run

from elr.config import load_config
from elr.errors import ConfigError
from elr.tools.activation_memory import storage_key
from elr.train.loss import chunked_cross_entropy, summed_loss


def plain_and_chunked(hidden, weight, labels, chunk):
    """(loss, d hidden, d weight) of the plain path and of the chunked one."""
    results = []
    for chunked in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = chunked_cross_entropy(h, w, labels, chunk) if chunked else summed_loss(F.linear(h, w), labels)
        (0.5 * loss).backward()  # a non-unit upstream gradient
        results.append((loss.detach(), h.grad, w.grad))
    return results


@pytest.mark.parametrize("chunk", [1, 7, 16, 48, 1000])  # 48 tokens: chunks that do and do not divide them
def test_chunked_loss_and_gradients_equal_plain_cross_entropy(chunk):
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 16, 32), torch.randn(97, 32) / 4
    labels = torch.randint(0, 97, (3, 16))
    labels[1, 3] = -100  # ignored, as F.cross_entropy ignores it
    (plain, dh, dw), (chunked, ch, cw) = plain_and_chunked(hidden, weight, labels, chunk)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ch, dh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cw, dw, rtol=1e-6, atol=1e-6)
    assert ch[1, 3].abs().max() == 0


def test_bf16_parameters_give_fp32_logits_per_chunk():
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 24, 32).bfloat16(), (torch.randn(300, 32) / 4).bfloat16()
    labels = torch.randint(0, 300, (2, 24))
    (plain, dh, dw), (chunked, ch, cw) = plain_and_chunked(hidden, weight, labels, 10)
    assert ch.dtype == cw.dtype == torch.bfloat16
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)  # same fp32 loss from the same bf16 logits
    torch.testing.assert_close(ch, dh, rtol=2e-2, atol=1e-3)  # bf16 rounding of the gradient products
    torch.testing.assert_close(cw, dw, rtol=2e-2, atol=1e-3)


def saved_bytes(fn) -> int:
    """Peak of the bytes autograd saves for backward (unique storages) while fn() runs."""
    seen: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    del loss
    return sum(seen.values())


def test_chunked_path_saves_far_less_for_backward():
    torch.manual_seed(0)
    tokens, dim, vocab = 2048, 64, 8192  # logits: 64 MiB in fp32
    weight = torch.nn.Parameter(torch.randn(vocab, dim) / 8)
    hidden = torch.randn(tokens, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    plain = saved_bytes(lambda: summed_loss(F.linear(hidden, weight)[None], labels[None]))
    chunked = saved_bytes(lambda: chunked_cross_entropy(hidden, weight, labels, 256))
    assert plain >= tokens * vocab * 4  # the fp32 log-softmax
    assert chunked <= tokens * (dim + 1) * 4 + labels.numel() * 8  # hidden, lse, labels: no logits
    assert plain / chunked > 50, (plain, chunked)


def test_trainer_losses_equal_with_and_without_chunks(tmp_path):
    extra = ["--elr.max_loops", "3", "--validation.freq", "2"]
    whole = run(tmp_path / "whole", 3, *extra)
    chunked = run(tmp_path / "chunked", 3, *extra, "--training.loss_chunk_tokens", "24")  # 64 tokens per microbatch
    assert len(whole) == 3
    for step in whole:
        assert chunked[step] == pytest.approx(whole[step], rel=1e-5, abs=1e-5), step
    validation = [[r for r in records(d) if "val/loss_k1" in r] for d in (tmp_path / "whole", tmp_path / "chunked")]
    assert validation[0] and len(validation[0]) == len(validation[1])
    for a, b in zip(*validation):
        for key in a:
            if key.startswith("val/"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), key


def test_negative_chunk_is_a_config_error():
    with pytest.raises(ConfigError, match="training.loss_chunk_tokens"):
        load_config(DEBUG_TOML, ["--training.loss_chunk_tokens", "-1"])
