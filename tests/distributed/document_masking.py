"""Document masking under context and tensor parallelism on gloo, launched by tests/test_document_masking.py.

    torchrun --nproc_per_node N document_masking.py LAYOUT     LAYOUT: cp (N=2), tp (N=2), cp_tp (N=4)

Every rank builds the same debug model (every layer kind, conditioning, route replay) and the same packed
rows, whose documents start on a CP shard boundary, one token before it (the next shard's short
convolutions must not read it) and inside the previous shard (the GDP state chain must drop it), and
span the boundary. Checked at k = 1, 2, 3: the parallel model's logits and its loss (summed over the CP
ranks) equal each document run alone in one process; after the three losses' backward (accumulated,
as microbatches do), every parameter gradient (summed over the CP ranks, TP's partial ones reduced)
equals the single-process packed model's. Relative error <= 1e-5 per tensor. Rank 0 prints one line
per failure, or that all passed.
"""

import copy
import dataclasses
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tp_harness import full, tp_copy

from elr.models import build_model, flavors
from elr.parallel.context_parallel import enable_context_parallel, shard_sequence
from elr.parallel.parallelize import SequenceShards
from elr.parallel.tensor_parallel import reduce_partial_grads
from elr.train.loss import model_loss

ARGS = dataclasses.replace(
    flavors["debug"], vocab_size=257, max_seq_len=128, moe_route_replay=True, gdp_impl="chunk", cond_dim=16
).with_recurrence(max_loops=3, update="adaptive_delta", conditioning=True)
LAYOUTS = {"cp": (2, 1), "tp": (1, 2), "cp_tp": (2, 2)}
# T = 36, CP shards of 18 (TP pieces of 9): row 0's documents start at 0, 5, 17, 18 (the shard
# boundary) and 28; row 1's second document starts at 16 and crosses the boundary.
LENGTHS = [[5, 12, 1, 10, 8], [16, 20]]
TOLERANCE = 1e-5
CHUNK_TOKENS = 16


def check(failures: list, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    error = ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).reshape(1)
    dist.all_reduce(error, op=dist.ReduceOp.MAX)  # every rank fails alike
    if error.item() > TOLERANCE:
        failures.append(f"{name}: relative error {error.item():.2e} > {TOLERANCE}")


def packed_batch():
    gen = torch.Generator().manual_seed(1)
    T = sum(LENGTHS[0])
    tokens = torch.randint(0, ARGS.vocab_size, (len(LENGTHS), T), generator=gen)
    labels = torch.randint(0, ARGS.vocab_size, (len(LENGTHS), T), generator=gen)
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in LENGTHS])
    return tokens, labels, ids


def spans():
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            yield row, start, start + n
            start += n


def main():
    dist.init_process_group("gloo")
    layout = sys.argv[1]
    cp, tp = LAYOUTS[layout]
    assert cp * tp == dist.get_world_size(), (layout, dist.get_world_size())
    mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))
    cp_group, cp_rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()

    torch.manual_seed(0)
    ref = build_model(ARGS)
    ref.init_weights()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model = tp_copy(ref, ARGS, mesh["tp"]) if tp > 1 else copy.deepcopy(ref)
    if cp > 1:
        enable_context_parallel(model, mesh["cp"])
    model.set_sequence_shards(SequenceShards(dist.group.WORLD))  # as parallelize() does: each sequence's ranks

    tokens, labels, ids = packed_batch()

    def mine(x):
        return shard_sequence(x, cp_rank, cp)

    failures = []
    for k in (1, 2, 3):
        with torch.no_grad():
            alone = torch.zeros(*tokens.shape, ARGS.vocab_size)
            alone_loss = torch.zeros(())
            for row, a, b in spans():
                alone[row, a:b] = ref(tokens[row : row + 1, a:b], loops=k)[0]
                alone_loss += model_loss(ref, tokens[row : row + 1, a:b], labels[row : row + 1, a:b], k, 0, False)
            got = full(model(mine(tokens), loops=k, document_ids=mine(ids)))
        check(failures, f"{layout} k={k} logits", got, mine(alone))

        loss = model_loss(model, mine(tokens), mine(labels), k, CHUNK_TOKENS, tp > 1, document_ids=mine(ids))
        loss.backward()
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=cp_group)
        check(failures, f"{layout} k={k} loss", whole, alone_loss)
        model_loss(ref, tokens, labels, k, 0, False, document_ids=ids).backward()

    if tp > 1:
        reduce_partial_grads(model)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        if want is None:
            continue
        grad = full(p.grad).clone()
        dist.all_reduce(grad, group=cp_group)
        check(failures, f"{layout} d {name}", grad, want)

    if dist.get_rank() == 0:
        print("\n".join(failures) or f"document masking {layout}: all checks passed", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
