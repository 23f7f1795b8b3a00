"""The vocab-parallel chunked loss on 2 gloo ranks, launched by tests/test_tensor_parallel.py: the TP
model's chunked cross entropy (elr/train/loss.py, vocab_parallel_chunked_cross_entropy) and every
parameter's gradient equal the single-process model's plain cross entropy, with a vocabulary TP does
not divide (257: shards of 129 and 128 ids), chunks that do not divide the tokens, some labels
ignored (-100) and loop counts 1 and 3 accumulated. Prints one line per failure; exits 1 if any.
"""

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from elr.models import build_model, flavors  # noqa: E402
from elr.parallel.tensor_parallel import apply_tensor_parallel, reduce_partial_grads  # noqa: E402
from elr.train.loss import vocab_parallel_chunked_cross_entropy  # noqa: E402


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def check(args, chunk: int, mesh, failures: list) -> None:
    torch.manual_seed(0)
    ref = build_model(args)
    ref.init_weights()
    with torch.device("meta"):
        model = build_model(args)
    apply_tensor_parallel(model, mesh)
    model.to_empty(device="cpu")
    model.init_weights()  # rope tables; the weights come from the reference
    with torch.no_grad():
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(ref_params[name], mesh, p.placements))
    tokens = torch.randint(0, args.vocab_size, (2, 17 * mesh.size()), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(-1, dims=1)
    labels[0, 5], labels[1, -3:] = -100, -100
    for loops in (1, 3):  # the second loop count accumulates onto the first's gradients, as microbatches do
        want = F.cross_entropy(ref(tokens, loops=loops).flatten(0, 1), labels.flatten(), reduction="sum")
        (want + ref.moe_aux_loss()).backward()
        got = vocab_parallel_chunked_cross_entropy(model(tokens, loops=loops, head=False), model.output.weight,
                                                   labels, chunk)
        (0.5 * got + 0.5 * got + model.moe_aux_loss()).backward()  # a non-unit upstream gradient on the loss
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            failures.append(f"chunk={chunk} loops={loops}: loss {got.item()} != {want.item()}")
    reduce_partial_grads(model)
    for name, p in model.named_parameters():
        g, r = full(p.grad), ref_params[name].grad
        if (g is None) != (r is None) or (r is not None and not torch.allclose(g, r, rtol=1e-5, atol=1e-6)):
            failures.append(f"chunk={chunk}: grad of {name} differs"
                            + (f" by {(g - r).abs().max().item():.2e}" if g is not None and r is not None else ""))


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    args = dataclasses.replace(flavors["debug"], vocab_size=257, max_seq_len=128, max_loops=3,
                               update="adaptive_delta", conditioning=True, moe_route_replay=True)
    failures = []
    for chunk in (5, 1000):  # 68 tokens: 14 chunks, the last of 3 tokens; one chunk of them all
        check(args, chunk, mesh, failures)
    if dist.get_rank() == 0:
        print("\n".join(failures) or "tp_loss: all checks passed")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
