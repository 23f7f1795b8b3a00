"""Tensor parallelism on 2 gloo ranks, launched by tests/test_tensor_parallel.py: every parameter's
gradient under TP equals the single-process model's, for the debug model (G, A, F, E layers) at
loop counts 1 and 3 accumulated, with GQA kv heads split (2 kv heads) and replicated (1 kv head), with
each activation-checkpointing mode, with the output block's FiLM heads, and with the input adapter,
state norm and truncated backprop; `--compile`: with compiled
layers (dynamo + AOTAutograd, the aot_eager backend, static shapes as parallelize() sets them under TP)
instead. Also: every non-MoE
mixer weight is split in memory, and the memory plan's traced activations match a real TP forward.
"""

import dataclasses
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import loss_parallel
from tp_harness import ARGS, ROOT, full, plain_name, run_checks, tokens_for, tp_copy

from elr.config import load_config
from elr.models import build_model
from elr.models.from_config import model_args_from_config
from elr.parallel.activation_checkpoint import apply_activation_checkpointing
from elr.parallel.parallelize import SequenceShards
from elr.parallel.tensor_parallel import apply_tensor_parallel, reduce_partial_grads
from elr.tools.activation_memory import live_activation_bytes
from elr.tools.memory_plan import activation_bytes
from elr.train.loss import summed_loss


def check(args, ac: str, mesh, failures: list, compile: bool = False) -> None:
    torch.manual_seed(0)
    ref = build_model(args)
    ref.init_weights()

    def split_check_ac_compile(model):
        for layer in model.layers():
            if layer.kind == "E":  # MoE: replicated over TP by design
                continue
            for name, p in layer.sublayer.named_parameters():  # the rest is split in memory
                kv_replicated = args.n_kv_heads < mesh.size() and name in ("wk.weight", "wv.weight")
                if name != "o_norm.weight" and not kv_replicated and not isinstance(p.placements[0], Shard):
                    failures.append(f"{layer.kind} layer's {name} is replicated over TP, not split")
        apply_activation_checkpointing(model, ac)
        if compile:
            for layer in model.layers():
                layer.compile(backend="aot_eager", dynamic=False)

    model = tp_copy(ref, args, mesh, after_tp=split_check_ac_compile)
    ref_params = dict(ref.named_parameters())
    tokens = tokens_for(mesh)
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
    for loops in (1, 3):  # the second loop count accumulates onto the first's gradients, as microbatches do
        want = F.cross_entropy(ref(tokens, loops=loops).flatten(0, 1), tokens.flatten(), reduction="sum")
        aux = ref.moe_aux_loss()
        (want + aux).backward()
        with loss_parallel():
            got = F.cross_entropy(model(tokens, loops=loops).flatten(0, 1), tokens.flatten(), reduction="sum")
            got_aux = model.moe_aux_loss()  # this rank's share of the balance loss
            (got.to_local() + got_aux).backward()
        got_aux = got_aux.detach().clone()
        dist.all_reduce(got_aux)
        what = f"n_kv_heads={args.n_kv_heads} ac={ac} compile={compile} loops={loops}"
        for name, a, b in (("loss", got.to_local(), want), ("balance loss", got_aux, aux)):
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                failures.append(f"{what}: {name} {a.item()} != {b.item()}")
    reduce_partial_grads(model)
    norm = full(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], foreach=True))
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    if not torch.allclose(norm, ref_norm, rtol=1e-5):
        failures.append(f"{what}: gradient norm {norm.item()} != {ref_norm.item()}")
    for name, p in model.named_parameters():
        g, r = full(p.grad), ref_params[plain_name(name)].grad
        # atol scales with the gradient's largest entry past 1 (the input adapter's sums every loop's tokens)
        if not torch.allclose(g, r, rtol=1e-5, atol=1e-6 * max(1.0, r.abs().max().item())):
            failures.append(
                f"{what}: grad of {name} differs by {(g - r).abs().max().item():.2e} "
                f"(largest {r.abs().max().item():.2e})"
            )


def check_planned_activations(mesh, failures: list) -> None:
    """The memory plan's count of a TP rank's activations (traced on the meta device) equals what the
    real TP forward keeps for backward on this rank, within 10%."""
    cfg = load_config(
        ROOT / "train_configs" / "debug.toml", ["--training.seq_len", "64", "--training.local_batch_size", "2"]
    )
    args = model_args_from_config(cfg, 257)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(args)
    apply_tensor_parallel(model, mesh)
    model.set_sequence_shards(SequenceShards(mesh.get_group()))
    model.to_empty(device="cpu")
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    for loops in (1, 3):
        with loss_parallel():
            measured = live_activation_bytes(lambda: summed_loss(model(tokens, loops=loops), tokens), model)
        planned = activation_bytes(args, cfg, torch.float32, loops, mesh)
        if abs(planned - measured) > 0.1 * measured:
            failures.append(f"planned TP activations at k={loops}: {planned} bytes, measured {measured}")


def checks(mesh, failures: list) -> None:
    if "--compile" in sys.argv:
        check(ARGS, "full", mesh, failures, compile=True)
    else:
        check(ARGS, "none", mesh, failures)
        check(dataclasses.replace(ARGS, n_kv_heads=1), "full", mesh, failures)
        check(ARGS, "selective", mesh, failures)
        # FiLM on the output block as well (the production recipe's), computed inside the recurrent block
        check(ARGS.with_recurrence(conditioning_exit=True), "none", mesh, failures)
        # the training aids with parameters of their own (issue 35): the input adapter and the state norm
        aids = ARGS.with_recurrence(recurrent_input="state_plus_adapted_input", state_norm=True, backprop_loops=2)
        check(aids, "none", mesh, failures)
        check_planned_activations(mesh, failures)


if __name__ == "__main__":
    run_checks("tp_grads", checks)
