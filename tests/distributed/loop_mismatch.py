"""FSDP2 on 2 gloo ranks at different loop counts, for each production config's options on the debug
model, launched by tests/test_gradient_anchor.py: rank 0 runs k = 1 (the one-loop override), rank 1
runs k = K; two updates; every gradient equals the single-process gradient of both microbatches
(mean of the two losses), so no collective is mismatched and none is wrong. One line per failure.

    torchrun --standalone --nproc_per_node 2 tests/distributed/loop_mismatch.py koi4b.toml ...
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from elr.config import load_config  # noqa: E402
from elr.models import build_model  # noqa: E402
from elr.models.from_config import model_args_from_config  # noqa: E402
from elr.parallel.parallelize import apply_fsdp  # noqa: E402

VOCAB = 512


def loss_of(model, tokens, loops):
    logits = model(tokens, loops=loops)
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()) + model.moe_aux_loss()


def check(config: str, mesh, failures: list) -> None:
    cfg = load_config(str(ROOT / "train_configs" / config), ["--model.flavor", "debug"])
    args = model_args_from_config(cfg, vocab_size=VOCAB)
    K, rank = args.recurrence.max_loops, dist.get_rank()
    models = []
    for _ in range(2):  # the reference and the sharded copy, from one seed
        torch.manual_seed(0)
        model = build_model(args)
        model.init_weights()
        model.train()
        models.append(model)
    ref, sharded = models
    apply_fsdp(sharded, mesh, torch.float32)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    for update in range(2):
        gen = torch.Generator().manual_seed(update)
        tokens = torch.randint(0, VOCAB, (2, 2, 16), generator=gen)  # [rank, batch, seq]
        loops = (1, K)
        torch.manual_seed(10 + update)
        loss_of(sharded, tokens[rank], loops[rank]).backward()
        ref_loss = sum(loss_of(ref, tokens[r], loops[r]) for r in range(2)) / 2
        ref_loss.backward()
        ref_params = dict(ref.named_parameters())
        for name, p in sharded.named_parameters():
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            want = ref_params[name].grad
            want = torch.zeros_like(got) if want is None else want
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
                failures.append(
                    f"{config} update {update + 1}: grad of {name} differs by {(got - want).abs().max().item():.2e}"
                )
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    failures: list[str] = []
    for config in sys.argv[1:]:
        check(config, mesh, failures)
    for line in failures[:20]:
        print(f"rank {dist.get_rank()}: {line}", flush=True)
    dist.barrier()
    if dist.get_rank() == 0 and not failures:
        print(f"loop_mismatch: all checks passed ({', '.join(sys.argv[1:])})")
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
