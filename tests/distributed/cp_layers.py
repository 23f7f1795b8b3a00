"""Context parallelism on 2 gloo ranks equals one process; launched by tests/test_context_parallel.py.

Every rank builds the same weights and inputs, runs the whole sequence in one process as the
reference, then its own shard under CP. Checked, forward and backward (input and parameter
gradients, the latter summed over the CP ranks as data parallelism would): one attention layer
(GQA), one GDP layer with short convolutions, the GDP op with and without an initial state, and the
debug model (every layer kind, ELR step and FiLM conditioning active, the MoE balance loss counted
over the whole sequence) at k = 1 and k = 3, and at
k = 3 under full and selective activation checkpointing (backward re-runs the gathers). Shards of
37 tokens (74 expanded sub-steps) are not a multiple of the GDP chunk (64).
"""

import copy
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from elr.config import load_config  # noqa: E402
from elr.models import build_model  # noqa: E402
from elr.models.args import flavors  # noqa: E402
from elr.models.attention import Attention  # noqa: E402
from elr.models.from_config import model_args_from_config  # noqa: E402
from elr.models.gdp import GatedDeltaProduct  # noqa: E402
from elr.parallel.activation_checkpoint import apply_activation_checkpointing  # noqa: E402
from elr.parallel.context_parallel import (  # noqa: E402
    ContextParallel,
    context_parallel_gated_delta_product,
    enable_context_parallel,
    shard_sequence,
)
from elr.parallel.parallelize import SequenceShards  # noqa: E402
from elr.tools.activation_memory import live_activation_bytes  # noqa: E402
from elr.train.loss import summed_loss  # noqa: E402
from elr_kernels.gated_delta_product import gated_delta_product  # noqa: E402

SHARD = 37
TOLERANCE = 1e-5  # max |CP - one process| relative to max |one process|, per tensor
ARGS = dataclasses.replace(flavors["debug"], gdp_impl="chunk", cond_dim=16).with_recurrence(
    max_loops=3, update="adaptive_delta", conditioning=True
)


WORST: dict[str, float] = {}  # the largest error of each check group, over tensors and ranks


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    error = ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).reshape(1)
    dist.all_reduce(error, op=dist.ReduceOp.MAX)  # every rank fails alike
    group = name.split(" d")[0].removesuffix(" output").removesuffix(" logits")
    WORST[group] = max(WORST.get(group, 0.0), error.item())
    assert error.item() <= TOLERANCE, f"{name}: {error.item():.2e} > {TOLERANCE}"


def summed(grad: torch.Tensor, group) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def check_module(name, reference, forward, inputs, mesh):
    """forward(module, *inputs, cp: bool) -> output [B, T, ...]; inputs are full sequences [B, T, ...]."""
    group, rank, cp = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    sharded = copy.deepcopy(reference)
    sharded.context_parallel = ContextParallel(group)  # the hook enable_context_parallel installs on a mixer
    full = [x.clone().requires_grad_() for x in inputs]
    local = [shard_sequence(x, rank, cp).clone().requires_grad_() for x in inputs]
    want = forward(reference, *full, cp=False)
    got = forward(sharded, *local, cp=True)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(7))
    (want * upstream).sum().backward()
    (got * shard_sequence(upstream, rank, cp)).sum().backward()
    check(f"{name} output", got, shard_sequence(want, rank, cp))
    for i, (x, x_local) in enumerate(zip(full, local)):
        check(f"{name} d input {i}", x_local.grad, shard_sequence(x.grad, rank, cp))
    for (param_name, p), p_cp in zip(reference.named_parameters(), sharded.parameters()):
        check(f"{name} d {param_name}", summed(p_cp.grad, group), p.grad)


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    group, rank, cp = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    T = SHARD * cp
    x = torch.randn(2, T, ARGS.dim)

    rope = build_model(ARGS).rope
    attention = Attention(ARGS)
    attention.init_weights(0.02)

    def run_attention(module, h, cp):
        start = rank * h.shape[1] if cp else 0
        return module(h, rope[:, start : start + h.shape[1]])

    check_module("attention", attention, run_attention, [x], mesh)

    gdp = GatedDeltaProduct(ARGS)
    with torch.no_grad():
        gdp.init_weights(0.02)
    check_module("gdp layer", gdp, lambda module, h, cp: module(h), [x], mesh)

    # The op itself, with and without a state before the first shard.
    B, H, D, n_h = 2, 3, 16, 2
    q = F.normalize(torch.randn(B, T, H, D), dim=-1)
    k = F.normalize(torch.randn(B, T * n_h, H, D), dim=-1)
    v, g = torch.randn(B, T * n_h, H, D), -0.05 * torch.rand(B, T, H)  # weak decay: the state survives a shard
    beta = 2 * torch.rand(B, T * n_h, H)
    for with_state in (False, True):
        state = torch.randn(B, H, D, D, requires_grad=True) if with_state else None
        inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
        want, _ = gated_delta_product(*inputs, num_householder=n_h, initial_state=state, impl="chunk")
        local = []
        for x_full, per_token in zip(inputs, (1, n_h, n_h, 1, n_h)):  # k, v, beta hold n_h rows per token
            local.append(x_full.detach()[:, rank * SHARD * per_token : (rank + 1) * SHARD * per_token].requires_grad_())
        state_cp = state.detach().clone().requires_grad_() if with_state else None
        got = context_parallel_gated_delta_product(
            *local, num_householder=n_h, group=group, initial_state=state_cp, impl="chunk"
        )
        upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
        (want * upstream).sum().backward()
        (got * shard_sequence(upstream, rank, cp)).sum().backward()
        name = f"gdp op {'with' if with_state else 'without'} initial state"
        check(f"{name} output", got, shard_sequence(want, rank, cp))
        for label, x_full, x_local, per_token in zip("q k v g beta".split(), inputs, local, (1, n_h, n_h, 1, n_h)):
            piece = x_full.grad[:, rank * SHARD * per_token : (rank + 1) * SHARD * per_token]
            check(f"{name} d{label}", x_local.grad, piece)
        if with_state:
            check(f"{name} d initial_state", summed(state_cp.grad, group), state.grad)

    # The debug model, every ELR path made non-trivial (zero-initialised heads moved off zero).
    model = build_model(ARGS)
    with torch.no_grad():
        model.init_weights()
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    tokens = torch.randint(0, ARGS.vocab_size, (2, T + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    for loops, ac in ((1, "none"), (3, "none"), (3, "full"), (3, "selective")):
        reference, sharded = copy.deepcopy(model), copy.deepcopy(model)
        enable_context_parallel(sharded, mesh)
        sharded.set_sequence_shards(
            SequenceShards(group)
        )  # as parallelize() does: routes counted over the whole sequence
        apply_activation_checkpointing(sharded, ac)  # the recomputed forward gathers again in backward
        want = reference(inputs, loops=loops)
        got = sharded(shard_sequence(inputs, rank, cp), loops=loops)
        want_aux, got_aux = reference.moe_aux_loss(), sharded.moe_aux_loss()  # got: this rank's share
        (F.cross_entropy(want.flatten(0, 1), labels.flatten(), reduction="sum") + want_aux).backward()
        (
            F.cross_entropy(got.flatten(0, 1), shard_sequence(labels, rank, cp).flatten(), reduction="sum") + got_aux
        ).backward()
        check(f"model k={loops} AC {ac} logits", got, shard_sequence(want, rank, cp))
        check(f"model k={loops} AC {ac} balance loss", summed(got_aux.detach(), group), want_aux.detach())
        for (name, p), p_cp in zip(reference.named_parameters(), sharded.parameters()):
            if p.grad is not None:
                check(f"model k={loops} AC {ac} d {name}", summed(p_cp.grad, group), p.grad)
        if loops == 1:
            try:
                sharded(shard_sequence(inputs, rank, cp), cache=object())
            except ValueError as e:
                assert "context parallel" in str(e)
            else:
                raise AssertionError("a cache under CP must be refused")

    # What the last rank (which keeps every earlier rank's keys and values) holds for backward, for
    # tests/test_context_parallel.py to hold the memory plan's traced count to.
    cfg = load_config(ROOT / "train_configs" / "debug.toml", ["--training.seq_len", str(T)])
    memory_model = build_model(model_args_from_config(cfg, 257))
    memory_model.init_weights()
    enable_context_parallel(memory_model, mesh)
    for loops in (1, 3):
        mine = shard_sequence(tokens[:, :T] % 257, rank, cp)
        held = live_activation_bytes(lambda: summed_loss(memory_model(mine, loops=loops), mine), memory_model)
        if rank == cp - 1:
            print(f"activations of the last CP rank at k={loops}: {held} bytes", flush=True)

    dist.barrier()
    if rank == 0:
        for group_name, error in WORST.items():
            print(f"{group_name}: max relative error {error:.1e} (outputs and gradients)")
        print("context parallel: all checks passed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
