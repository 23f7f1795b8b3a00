"""Added training compute of an ELR run against its non-recurrent baseline (our reading of Eq. 5), and
what its loop sampling costs in waiting on a cluster.

    python scripts/estimate_cost.py --config train_configs/koi4b.toml        # at 8 GPUs
    python scripts/estimate_cost.py train_configs/koi4b.toml train_configs/gpt_0p5b.toml --gpus 64

A token trained at k loops passes through L_in + k L_rec + L_out layers; the baseline's passes
through L = L_in + L_rec + L_out. With a late switch at fraction s of the steps and mean loop count
E[k] = f + (1 - f) sum_k w_k k in the mixed phase,

    cost / baseline = s + (1 - s) (L_in + E[k] L_rec + L_out) / L            (layers)

The FLOP column weighs each layer by its analytic training FLOPs at the config's seq_len and counts
the embedding/head once per token, as model.num_flops_per_token does, so it depends (a little) on
the vocabulary. The embedding, input and output blocks and head cost `fixed` loops (their FLOPs over
one loop's). That comes from the config's tokenizer without loading an encoding: a local ranks
file is read, a tiktoken encoding name is looked up (elr.text.tokenizer.ENCODING_VOCAB), so the figures are the same
whether or not the encoding is cached on this machine; `--vocab-size N` overrides it (e.g. 131072,
the Nemotron vocabulary the paper's models use). The params columns count the model the config
trains after its late switch (conditioning included); active counts top-k of the routed experts.

Waiting: under FSDP every microbatch all-gathers and reduce-scatters, so all data-parallel ranks meet on
each one and a microbatch costs what its slowest rank's k costs. `wait x` is the mixed phase's step time
over the same work without waiting, from the config's own sampler at `--gpus` GPUs (data-parallel ranks
= GPUs / (tp x cp), microbatches from the batch sizes) over 200 updates; `depths/update` is the mean
number of distinct loop counts in an update; `run x (time)` is the run's GPU time against the
baseline's, FLOPs and waiting together.

Totals: `tokens` is training.steps x the global batch x seq_len; `FLOPs` is the run's training compute
(its k = 1 FLOPs per token x tokens x `run x (FLOPs)`), beside the same run mixed-depth from the first
step (`no switch`) and the non-recurrent baseline's. `GPU-hours` divide each by --mfu x --peak-tflops,
the mixed phase's waiting included: an estimate at an assumed utilisation, not a measurement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elr.cli import HelpFormatter
from elr.config import load_config
from elr.errors import ConfigError

FORMULA = "cost / baseline = s + (1 - s) * (L_in + E[k] * L_rec + L_out) / L\nE[k] = f + (1 - f) * sum_k w_k * k"


def estimate(
    config_path: str, vocab_size: int | None = None, gpus: int = 8, peak_tflops: float = 989.0, mfu: float = 0.4
) -> dict:
    import torch

    from elr.data.job_data import job_tokenizer_path
    from elr.data.loader import microbatches
    from elr.models import build_model
    from elr.models.from_config import check_model_config, model_args_from_config
    from elr.parallel.parallel_dims import ParallelDims
    from elr.text.tokenizer import vocab_size as tokenizer_vocab
    from elr.train.loop_sampler import SAMPLING, LoopSampler, expected_wait

    cfg = load_config(config_path)
    check_model_config(cfg)
    vocab_size = vocab_size or tokenizer_vocab(job_tokenizer_path(cfg))
    e = cfg.elr
    sampler = LoopSampler(e.max_loops, e.sampling, e.one_loop_override, e.loop_weights)
    mean_k = sampler.mean_loops() if e.enabled else 1.0
    args = model_args_from_config(cfg, vocab_size=vocab_size)
    n_in, n_rec, n_out = args.partition
    n_layers = n_in + n_rec + n_out
    s = e.switch_at
    mixed_layers = (n_in + mean_k * n_rec + n_out) / n_layers
    with torch.device("meta"):
        model = build_model(args)
    f1 = model.num_flops_per_token(cfg.training.seq_len, 1)
    per_loop = model.num_flops_per_token(cfg.training.seq_len, 2) - f1
    mixed_flops = (f1 + (mean_k - 1) * per_loop) / f1
    fixed = f1 / per_loop - 1
    p = cfg.parallelism
    dims = ParallelDims(
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        gpus,
        ep=p.expert_parallel_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
    )
    try:
        global_batch, n_micro = microbatches(cfg.training, dims.dp_world)
    except ConfigError as err:
        raise ConfigError(f"{Path(config_path).name} at --gpus {gpus}: {err}") from None
    waits = {
        mode: expected_wait(
            LoopSampler(e.max_loops, mode, e.one_loop_override, e.loop_weights),
            dims.dp_world,
            n_micro,
            fixed,
            group_size=dims.ep,
        )
        if e.enabled
        else (1.0, 1.0)
        for mode in SAMPLING
    }
    wait, depths = waits[e.sampling]
    tokens = cfg.training.steps * global_batch * cfg.training.seq_len
    baseline_flops = tokens * f1  # k = 1 everywhere: the non-recurrent stack (the conditioning heads left out)
    per_hour = peak_tflops * 1e12 * mfu * 3600
    params = sum(p.numel() for p in model.parameters())
    experts = sum(m.w1.numel() + m.w2.numel() for m in model.moe_layers())
    active = params - experts + experts * args.moe_top_k / max(args.moe_experts, 1)
    return {
        "config": Path(config_path).name,
        "partition": f"{n_in}/{n_rec}/{n_out}",
        "K": e.max_loops,
        "f": e.one_loop_override,
        "p1": sampler.p_one_loop() if e.enabled else 1.0,
        "E[k]": mean_k,
        "s": s,
        "mixed x (layers)": mixed_layers,
        "run x (layers)": s + (1 - s) * mixed_layers,
        "run x (FLOPs)": s + (1 - s) * mixed_flops,
        "fixed": fixed,
        "sampling": e.sampling,
        "GPUs": gpus,
        "ranks x micro": f"{dims.dp_world}x{n_micro}",
        "wait x": wait,
        "depths/update": depths,
        "run x (time)": s + (1 - s) * mixed_flops * wait,
        "tokens": f"{tokens:.3g}",
        "FLOPs": f"{baseline_flops * (s + (1 - s) * mixed_flops):.3g}",
        "FLOPs no switch": f"{baseline_flops * mixed_flops:.3g}",
        "FLOPs baseline": f"{baseline_flops:.3g}",
        "GPU-hours": f"{baseline_flops * (s + (1 - s) * mixed_flops * wait) / per_hour:,.0f}",
        "GPU-hours no switch": f"{baseline_flops * mixed_flops * wait / per_hour:,.0f}",
        "GPU-hours baseline": f"{baseline_flops / per_hour:,.0f}",
        "vocab": vocab_size,
        "params": human(params),
        "active": human(active),
        "wait x by sampling": {mode: w for mode, (w, _) in waits.items()},
    }


def human(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("configs", nargs="*", help="TOML job configs")
    parser.add_argument("--config", action="append", default=[], help="a TOML job config (repeatable; as train.py)")
    parser.add_argument("--gpus", type=int, default=8, help="world size to cost the loop sampling's waiting at")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary to size the embedding/head with (default: the config tokenizer's)",
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="one GPU's dense bf16 peak, TFLOP/s (H100 SXM: 989)"
    )
    parser.add_argument("--mfu", type=float, default=0.4, help="the model FLOPs utilisation the GPU-hours assume")
    args = parser.parse_args()
    if not (args.peak_tflops > 0 and 0 < args.mfu <= 1):
        parser.error("--peak-tflops must be positive and --mfu in (0, 1]")
    configs = args.configs + args.config
    if not configs:
        parser.error("name at least one config (--config FILE)")
    try:
        rows = [estimate(path, args.vocab_size, args.gpus, args.peak_tflops, args.mfu) for path in configs]
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(FORMULA)
    modes = [row.pop("wait x by sampling") for row in rows]
    # one row per quantity, one column per config: as many configs as fit, and never wider than 100
    # columns for a few
    cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()] for row in rows]
    names = list(rows[0])
    width = max(map(len, names))
    col = [max(len(c[j]) for j in range(len(names))) for c in cells]
    for i, name in enumerate(names):
        print(name.ljust(width) + "".join("  " + c[i].rjust(w) for c, w in zip(cells, col)))
    print(
        f"GPU-hours at {args.mfu:.0%} of {args.peak_tflops:g} TFLOP/s per GPU (--mfu, --peak-tflops), waiting included"
    )
    for row, waits in zip(rows, modes):
        others = ", ".join(f"{mode} {w:.2f}x" for mode, w in waits.items() if mode != row["sampling"])
        print(
            f"{row['config']} at {row['GPUs']} GPUs ({row['ranks x micro']} ranks x microbatches):\n"
            f"  {row['sampling']} sampling waits {row['wait x']:.2f}x per mixed-depth step ({others})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
