"""The vocab-parallel chunked loss on 2 gloo ranks, launched by tests/test_tensor_parallel.py: the TP
model's chunked cross entropy (elr/train/loss.py, vocab_parallel_chunked_cross_entropy) and every
parameter's gradient equal the single-process model's plain cross entropy, with a vocabulary TP does
not divide (257: shards of 129 and 128 ids), chunks that do not divide the tokens, some labels
ignored (-100) and loop counts 1 and 3 accumulated. Prints one line per failure; exits 1 if any.
"""

import torch
import torch.nn.functional as F
from tp_harness import ARGS, full, run_checks, tokens_for, tp_copy

from elr.models import build_model
from elr.parallel.tensor_parallel import reduce_partial_grads
from elr.train.loss import vocab_parallel_chunked_cross_entropy


def check(args, chunk: int, mesh, failures: list) -> None:
    torch.manual_seed(0)
    ref = build_model(args)
    ref.init_weights()
    model = tp_copy(ref, args, mesh)
    ref_params = dict(ref.named_parameters())
    tokens = tokens_for(mesh)
    labels = tokens.roll(-1, dims=1)
    labels[0, 5], labels[1, -3:] = -100, -100
    for loops in (1, 3):  # the second loop count accumulates onto the first's gradients, as microbatches do
        want = F.cross_entropy(ref(tokens, loops=loops).flatten(0, 1), labels.flatten(), reduction="sum")
        (want + ref.moe_aux_loss()).backward()
        got = vocab_parallel_chunked_cross_entropy(
            model(tokens, loops=loops, head=False), model.output.weight, labels, chunk
        )
        (0.5 * got + 0.5 * got + model.moe_aux_loss()).backward()  # a non-unit upstream gradient on the loss
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            failures.append(f"chunk={chunk} loops={loops}: loss {got.item()} != {want.item()}")
    reduce_partial_grads(model)
    for name, p in model.named_parameters():
        g, r = full(p.grad), ref_params[name].grad
        if (g is None) != (r is None) or (r is not None and not torch.allclose(g, r, rtol=1e-5, atol=1e-6)):
            failures.append(
                f"chunk={chunk}: grad of {name} differs"
                + (f" by {(g - r).abs().max().item():.2e}" if g is not None and r is not None else "")
            )


def checks(mesh, failures: list) -> None:
    for chunk in (5, 1000):  # 68 tokens: 14 chunks, the last of 3 tokens; one chunk of them all
        check(ARGS, chunk, mesh, failures)


if __name__ == "__main__":
    run_checks("tp_loss", checks)
