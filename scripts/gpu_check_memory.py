"""The scale section of the one-command GPU check: training, memory against the plan, float8.

    python scripts/gpu_check_memory.py            # on one GPU (about 5 minutes on an H100/H200)
    python scripts/gpu_check_memory.py --dry-run  # CPU, tiny shapes: proves the script runs end to end

1. The debug config with torch.compile for 30 steps: the loss must fall.
2. A reduced-depth koi_4b-shaped model (koi_4b widths, layers G F | G F A F | G F) at seq 8192, k = 4,
   for each AC mode: one fwd + bwd, torch.cuda.max_memory_allocated above weights and optimizer state
   next to the plan's activations + backward working set + gradients, then tokens/s and MFU over a
   few steps (bf16 weights, eager, the PyTorch GDP chunk op).
3. The MoE's grouped-GEMM experts against the per-expert loop in bf16, forward and backward.
4. float8 (torchao) on the debug config for a few steps: the loss stays finite.
Prints one markdown table to paste into README.md and docs/LOG.md; exit code 1 if a check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from elr.cli import HelpFormatter
from elr.config import load_config

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
DEBUG_TOML = ROOT / "train_configs" / "debug.toml"
AC_MODES = [("none", "op"), ("selective", "op"), ("selective", "2"), ("full", "op")]


def train_losses(steps: int, extra: list[str], dump: Path) -> list[float]:
    from elr.train.trainer import Trainer

    trainer = Trainer(
        load_config(
            DEBUG_TOML,
            [
                "--training.steps",
                str(steps),
                "--validation.freq",
                "0",
                "--metrics.log_freq",
                "1",
                "--metrics.enable_tensorboard",
                "false",
                "--job.dump_folder",
                str(dump),
                *extra,
            ],
        )
    )
    losses = []
    for step in range(1, steps + 1):
        scalars = trainer.train_step(step).scalars
        losses.append(scalars["loss/train"])
    trainer.close()
    return losses


def reduced_koi(seq_len: int, dry_run: bool):
    """koi_4b's widths with 8 layers (2 in, 4 recurrent, 2 out); in a dry run, the debug widths."""
    from elr.models import flavors

    base = flavors["debug"] if dry_run else flavors["koi_4b"]
    return dataclasses.replace(
        base,
        layer_pattern="GF" + "GFAF" + "GF",
        partition=(2, 4, 2),
        max_seq_len=seq_len,
        vocab_size=8192 if dry_run else 200019,
    ).with_recurrence(max_loops=4, update="adaptive_delta", conditioning=True)


def memory_rows(dry_run: bool, device: torch.device, peak_tflops: float) -> list[list[str]]:
    import torch

    from elr.models import build_model
    from elr.parallel.activation_checkpoint import apply_activation_checkpointing
    from elr.tools.activation_memory import live_activation_bytes
    from elr.tools.memory_plan import GiB, microbatch_bytes
    from elr.train.loss import summed_loss

    seq_len, loops = (64, 4) if dry_run else (8192, 4)
    dtype = torch.float32 if dry_run else torch.bfloat16
    args = reduced_koi(seq_len, dry_run)
    rows = []
    for mode, option in AC_MODES:
        cfg = load_config(
            DEBUG_TOML,
            [
                "--training.seq_len",
                str(seq_len),
                "--training.local_batch_size",
                "1",
                "--activation_checkpoint.mode",
                mode,
                "--activation_checkpoint.selective_ac_option",
                option,
            ],
        )
        activations, backward_work = microbatch_bytes(args, cfg, dtype, loops)
        torch.manual_seed(0)
        with torch.device(device):
            model = build_model(args)
        model.init_weights()
        model.to(dtype)
        apply_activation_checkpointing(model, mode, option)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, args.vocab_size, (1, seq_len), device=device)

        def step():
            summed_loss(model(tokens, loops=loops), tokens).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        # the plan's activations and backward working set, plus this unsharded model's gradients
        predicted = activations + backward_work + sum(p.numel() * p.element_size() for p in model.parameters())
        if device.type == "cuda":
            step()  # optimizer state and allocator warm-up
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            summed_loss(model(tokens, loops=loops), tokens).backward()
            torch.cuda.synchronize()
            measured = (torch.cuda.max_memory_allocated() - base) / GiB
            optimizer.zero_grad(set_to_none=True)
        else:  # no allocator statistics on CPU: count what the forward keeps alive instead
            measured = live_activation_bytes(lambda: summed_loss(model(tokens, loops=loops), tokens), model) / GiB
        n_steps = 1 if dry_run else 3
        start = time.perf_counter()
        for _ in range(n_steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) / n_steps
        mfu = 100 * model.num_flops_per_token(seq_len, loops) * seq_len / elapsed / (peak_tflops * 1e12)
        name = mode if mode != "selective" else f"selective ({option})"
        rows.append(
            [
                f"koi-shaped 8 layers, seq {seq_len}, k={loops}, AC {name}",
                f"{measured:.2f}",
                f"{predicted / GiB:.2f}",
                f"{seq_len / elapsed:,.0f}",
                f"{mfu:.1f}",
            ]
        )
        model = optimizer = step = None  # free them before the next mode builds its own
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def grouped_moe_row(device: torch.device) -> tuple[list[str], bool]:
    """The MoE's grouped-GEMM experts against the per-expert loop, forward and backward, in bf16."""
    import torch

    import elr.models.ffn as ffn
    from elr.models import flavors
    from elr.models.experts import grouped_experts, looped_experts

    torch.manual_seed(0)
    moe = ffn.MoE(flavors["debug"]).to(device=device, dtype=torch.bfloat16)
    moe.init_weights(0.02)
    x = torch.randn(4, 64, moe.w1.shape[-1], device=device, dtype=torch.bfloat16)
    upstream = torch.randn_like(x)
    results = []
    for experts in (grouped_experts, looped_experts):
        ffn.grouped_experts = experts
        moe.zero_grad()
        out = moe(x)
        out.backward(upstream)
        results.append((out.detach().float(), moe.w1.grad.float(), moe.w2.grad.float()))
    ffn.grouped_experts = grouped_experts
    diff = max((a - b).abs().max().item() for a, b in zip(*results))
    ok = diff < 5e-2
    return [
        f"MoE grouped GEMM vs expert loop, bf16 fwd+bwd: max diff {diff:.1e} ({'ok' if ok else 'MISMATCH'})",
        "",
        "",
        "",
        "",
    ], ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, few steps")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU dense bf16 peak for MFU")
    args = parser.parse_args()

    import torch

    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    ok = True
    table = [["check", "measured GiB", "plan GiB", "tokens/s", "MFU %"]]
    with tempfile.TemporaryDirectory() as tmp:
        steps = 8 if dry else 30
        small = (
            [
                "--training.seq_len",
                "32",
                "--training.local_batch_size",
                "4",
                "--training.global_batch_size",
                "4",
                "--lr_scheduler.warmup_steps",
                "2",
            ]
            if dry
            else []
        )
        losses = train_losses(steps, [*small, "--compile.enable", str(not dry).lower()], Path(tmp) / "debug")
        fell = losses[-1] < losses[0]
        ok &= fell
        table.append(
            [
                f"debug, {'eager' if dry else 'compile'}, {steps} steps: loss {losses[0]:.3f} -> "
                f"{losses[-1]:.3f} ({'falls' if fell else 'DOES NOT FALL'})",
                "",
                "",
                "",
                "",
            ]
        )
        row, moe_ok = grouped_moe_row(device)
        ok &= moe_ok
        table.append(row)
        table += memory_rows(dry, device, args.peak_tflops)
        f8 = train_losses(3, [*small, "--float8.enable", "true"], Path(tmp) / "float8")
        finite = all(math.isfinite(x) for x in f8)
        ok &= finite
        table.append(
            [
                f"float8 debug, 3 steps{' (emulated)' if dry else ''}: loss {f8[0]:.3f} -> {f8[-1]:.3f}"
                f" ({'finite' if finite else 'NOT FINITE'})",
                "",
                "",
                "",
                "",
            ]
        )
    print(f"device: {torch.cuda.get_device_name() if not dry else 'CPU (dry run)'}")
    for row in table[:1] + [["---"] * 5] + table[1:]:
        print("| " + " | ".join(row) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
