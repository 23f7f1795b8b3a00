"""Document masking in the model (issue 56): documents packed into one row never see each other.

A packed row of several documents, run with its `document_ids`, gives token for token the logits and
the loss of each document run alone (1e-5), for every layer kind (G, A, F, E, alone and together) at
every k = 1..K, through the training forward, every_loop, per-row budgets, an exit rule, the chunked
loss and activation checkpointing; the parameter gradients of the packed loss are the sum of the documents'.
Documents of one token and shorter than the GDP short convolution are among them. Context and tensor
parallelism: tests/distributed/document_masking.py (slow tier).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from trainer_utils import model_args

from elr.data.loader import Batch
from elr.models import ELRModel, flavors
from elr.models.documents import document_layout
from elr.models.early_exit import ExitRule
from elr.parallel.activation_checkpoint import apply_activation_checkpointing
from elr.train.loss import IGNORE_INDEX, model_loss
from elr.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]

K = 3
TOLERANCE = dict(atol=1e-5, rtol=1e-5)
# Document lengths per row (T = 24): a one-token document, documents shorter than the short
# convolution's reach (3 back), one that spans most of a row.
LENGTHS = [[5, 1, 2, 9, 7], [20, 4]]
# (layer_pattern, partition): each kind on its own (F and E beside a mixer, as they mix no tokens)
# and all four together inside the recurrent block (the debug flavor).
PATTERNS = {
    "G": ("GGGG", (1, 2, 1)),
    "A": ("AAAA", (1, 2, 1)),
    "F": ("GFAF", (1, 2, 1)),
    "E": ("AEGE", (1, 2, 1)),
    "GEAF": (flavors["debug"].layer_pattern, flavors["debug"].partition),
}


def packed_model(pattern: str, seed: int = 0, **options) -> ELRModel:
    """The debug flavor with `pattern`, loops conditioned and every parameter nudged off its identity init."""
    layer_pattern, partition = PATTERNS[pattern]
    settings = dict(max_loops=K, update="adaptive_delta", conditioning=True, cond_dim=16, gdp_impl="chunk")
    args = model_args(
        flavors["debug"],
        layer_pattern=layer_pattern,
        partition=partition,
        vocab_size=64,
        max_seq_len=64,
        **{**settings, **options},
    )
    torch.manual_seed(seed)
    model = ELRModel(args)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def packed_batch(lengths=LENGTHS, seed: int = 1):
    """(tokens, labels, document_ids) [B, T], ids 0, 1, 2... per row; labels drawn independently."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths[0])
    tokens = torch.randint(0, 64, (len(lengths), T), generator=gen)
    labels = torch.randint(0, 64, (len(lengths), T), generator=gen)
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])
    return tokens, labels, ids


def spans(lengths):
    """(row, start, end) of every document."""
    out = []
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            out.append((row, start, start + n))
            start += n
    return out


@torch.no_grad()
@pytest.mark.parametrize("pattern", PATTERNS)
def test_packed_row_gives_each_document_alone(pattern):
    model = packed_model(pattern)
    tokens, labels, ids = packed_batch()
    for k in range(1, K + 1):
        packed = model(tokens, loops=k, document_ids=ids)
        packed_loss = model_loss(model, tokens, labels, k, 0, False, document_ids=ids)
        alone_loss = 0.0
        for row, a, b in spans(LENGTHS):
            alone = model(tokens[row : row + 1, a:b], loops=k)
            torch.testing.assert_close(packed[row : row + 1, a:b], alone, **TOLERANCE)
            alone_loss += model_loss(model, tokens[row : row + 1, a:b], labels[row : row + 1, a:b], k, 0, False)
        torch.testing.assert_close(packed_loss, alone_loss, **TOLERANCE)
        unmasked = model(tokens, loops=k)
        assert (unmasked - packed).abs().max() > 1e-3  # the check can fail: without masking documents mix


def test_gradients_of_the_packed_loss_are_the_documents_summed():
    """Training: the chunked loss at k = K with activation checkpointing (the packed documents pass
    through the checkpoint regions and their recomputation), parameter gradients included."""
    model = packed_model("GEAF").train()
    apply_activation_checkpointing(model, "full")
    tokens, labels, ids = packed_batch()
    model.zero_grad()
    packed = model_loss(model, tokens, labels, K, 16, False, document_ids=ids)
    packed.backward()
    packed_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    alone = sum(
        model_loss(model, tokens[row : row + 1, a:b], labels[row : row + 1, a:b], K, 16, False)
        for row, a, b in spans(LENGTHS)
    )
    alone.backward()
    alone_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    torch.testing.assert_close(packed, alone, **TOLERANCE)
    assert len(packed_grads) == len(alone_grads)
    for got, want in zip(packed_grads, alone_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_every_loop_and_per_row_budgets_keep_documents_apart():
    """every_loop (the exits of loops 1..k stacked) and a budget per row (elastic depth) with packed rows."""
    model = packed_model("GEAF", conditioning_budget=False)
    tokens, labels, ids = packed_batch()
    exits = model(tokens, loops=K, every_loop=True, document_ids=ids)
    budgets = torch.tensor([1, K])
    mixed = model(tokens, loops=budgets, document_ids=ids)
    for row, a, b in spans(LENGTHS):
        alone_exits = model(tokens[row : row + 1, a:b], loops=K, every_loop=True)
        torch.testing.assert_close(exits[:, row : row + 1, a:b], alone_exits, **TOLERANCE)
        alone = model(tokens[row : row + 1, a:b], loops=int(budgets[row]))
        torch.testing.assert_close(mixed[row : row + 1, a:b], alone, **TOLERANCE)
    loss = model_loss(model, tokens, labels, K, 0, False, every_loop=True, document_ids=ids)
    alone_loss = sum(
        model_loss(model, tokens[r : r + 1, a:b], labels[r : r + 1, a:b], K, 0, False, every_loop=True)
        for r, a, b in spans(LENGTHS)
    )
    torch.testing.assert_close(loss, alone_loss, **TOLERANCE)


@torch.no_grad()
def test_an_exit_rule_over_packed_rows_exits_each_token_as_alone():
    """Adaptive depth over whole rows (no cache): the loops each token runs and its logits are those of its
    document alone (the rule's threshold leaves tokens at 1, 2 and 3 loops)."""
    model = packed_model("GEAF")
    tokens, _, ids = packed_batch()
    rule = ExitRule.parse("state:0.5")
    packed = model(tokens, loops=K, exit_rule=rule, document_ids=ids)
    used = model.loops_used().clone()
    assert set(used.flatten().tolist()) == {1, 2, 3}
    for row, a, b in spans(LENGTHS):
        alone = model(tokens[row : row + 1, a:b], loops=K, exit_rule=rule)
        assert torch.equal(model.loops_used(), used[row : row + 1, a:b])
        torch.testing.assert_close(packed[row : row + 1, a:b], alone, **TOLERANCE)


@torch.no_grad()
def test_a_padded_chat_row_scores_the_same_with_masking_on():
    """SFT rows (one conversation per row, padded after its end, padding unscored): with masking on,
    whether the padding is the conversation's document or its own, the loss is the unmasked row's."""
    model = packed_model("GEAF")
    tokens, labels, _ = packed_batch([[17, 7], [24]])
    labels[0, 17:] = IGNORE_INDEX
    unmasked = model_loss(model, tokens, labels, K, 0, False)
    one_document, padding_apart = torch.zeros_like(tokens), torch.zeros_like(tokens)
    padding_apart[0, 17:] = 1
    for ids in (one_document, padding_apart):
        torch.testing.assert_close(model_loss(model, tokens, labels, K, 0, False, document_ids=ids), unmasked)


def test_document_layout_positions_and_mask():
    """Positions restart at each change of id; a query sees its own document up to itself; a context-
    parallel shard (start > 0) gets the whole sequence's positions and keys up to its end."""
    ids = torch.tensor([[7, 7, 7, 3, 3, 9, 9, 9]])
    layout = document_layout(ids, 0, 8, with_mask=True)
    assert layout.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    doc = ids[0]
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    assert torch.equal(layout.mask[0, 0], (doc[:, None] == doc[None, :]) & (j <= i))
    shard = document_layout(ids, 4, 4, with_mask=True)
    assert shard.positions.tolist() == [[1, 0, 1, 2]]
    assert torch.equal(shard.mask, layout.mask[:, :, 4:8, :8])
    assert document_layout(ids, 0, 8, with_mask=False).mask is None


def test_rope_positions_restart_at_each_document():
    """RoPE is read at each token's position in its document. (Attention scores depend on position
    differences only, so the logits alone cannot show this: checked on the table the layers get.)"""
    model = packed_model("A")
    tokens, _, ids = packed_batch()
    documents = model.documents(tokens, ids, None)
    rope = model.positions(tokens, 1, None, documents)
    assert rope.shape == (2, *tokens.shape, model.rope.shape[-1])
    for row, a, b in spans(LENGTHS):
        torch.testing.assert_close(rope[:, row, a:b], model.rope[:, : b - a], rtol=0, atol=0)


def test_the_trainers_slice_carries_document_ids():
    """Trainer._slice gives this CP rank's slice of the ids beside its inputs and labels; None passes through."""
    tokens, labels, ids = packed_batch()
    trainer = SimpleNamespace(dims=SimpleNamespace(cp=2, cp_rank=1), device=torch.device("cpu"))
    inputs, labels_mine, ids_mine = Trainer._slice(trainer, Batch(tokens, labels, ids))
    assert torch.equal(ids_mine, ids[:, 12:]) and torch.equal(inputs, tokens[:, 12:])
    assert torch.equal(labels_mine, labels[:, 12:])
    assert Trainer._slice(trainer, Batch(tokens, labels)).document_ids is None
    trainer.dims.cp = 1
    assert all(
        torch.equal(a, b) for a, b in zip(Trainer._slice(trainer, Batch(tokens, labels, ids)), (tokens, labels, ids))
    )


def test_bad_document_ids_and_caches_are_refused():
    model = packed_model("G")
    tokens, _, ids = packed_batch()
    with pytest.raises(ValueError, match="document_ids has shape"):
        model(tokens, document_ids=ids[:, :-1])
    with pytest.raises(ValueError, match="document_ids must be an integer tensor"):
        model(tokens, document_ids=ids.float())
    from elr.infer.cache import InferenceCache

    cache = InferenceCache(model, 2, 32, K, "per_loop")
    with pytest.raises(ValueError, match="decode without them"):
        model(tokens, K, cache, document_ids=ids)


@pytest.mark.slow  # multi-process: about 50 s (CP 2, TP 2) and 70 s (CP 2 x TP 2, 4 processes) on 2 cores
@pytest.mark.parametrize("layout, nproc", [("cp", 2), ("tp", 2), ("cp_tp", 4)])
def test_packed_rows_under_context_and_tensor_parallelism(layout, nproc):
    """tests/distributed/document_masking.py: documents starting on a CP shard boundary, one token before
    it and inside the previous shard; logits and loss at k = 1..3 equal each document alone in one process,
    gradients equal the single-process packed model's (1e-5)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(ROOT / "tests" / "distributed" / "document_masking.py"),
            layout,
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"document masking {layout}: all checks passed" in result.stdout
