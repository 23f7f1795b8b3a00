"""Added training compute of an ELR run against its non-recurrent baseline (our reading of Eq. 5).

    python scripts/estimate_cost.py train_configs/koi4b.toml train_configs/gpt_0p5b.toml

A token trained at k loops passes through L_in + k L_rec + L_out layers; the baseline's passes
through L = L_in + L_rec + L_out. With a late switch at fraction s of the steps and mean loop count
E[k] = f + (1 - f) sum_k w_k k in the mixed phase,

    cost / baseline = s + (1 - s) (L_in + E[k] L_rec + L_out) / L            (layers)

The FLOP column weighs each layer by its analytic training FLOPs at the config's seq_len and counts
the embedding/head once per token, as model.num_flops_per_token does, so it depends (a little) on
the vocabulary. That comes from the config's tokenizer without loading an encoding: a local ranks
file is read, a tiktoken encoding name is looked up (elr.tokenizer.ENCODING_VOCAB), so the figures are the same
whether or not the encoding is cached on this machine; `--vocab-size N` overrides it (e.g. 131072,
the Nemotron vocabulary the paper's models use). The params columns count the model the config
trains after its late switch (conditioning included); active counts top-k of the routed experts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from elr.cli import HelpFormatter
from elr.config import load_config
from elr.errors import ConfigError
from elr.models import build_model
from elr.models.from_config import check_model_config, model_args_from_config
from elr.tokenizer import vocab_size as tokenizer_vocab
from elr.train.token_files import job_tokenizer_path
from elr.train.loop_sampler import LoopSampler

FORMULA = (
    "cost / baseline = s + (1 - s) * (L_in + E[k] * L_rec + L_out) / L,   "
    "E[k] = f + (1 - f) * sum_k w_k * k"
)


def estimate(config_path: str, vocab_size: int | None = None) -> dict:
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
    params = sum(p.numel() for p in model.parameters())
    experts = sum(m.w1.numel() + m.w2.numel() for m in model.moe_layers())
    active = params - experts + experts * args.moe_top_k / max(args.moe_experts, 1)
    return {
        "config": Path(config_path).name, "partition": f"{n_in}/{n_rec}/{n_out}", "K": e.max_loops,
        "f": e.one_loop_override, "p1": sampler.p_one_loop() if e.enabled else 1.0, "E[k]": mean_k, "s": s,
        "mixed x (layers)": mixed_layers, "run x (layers)": s + (1 - s) * mixed_layers,
        "run x (FLOPs)": s + (1 - s) * mixed_flops, "vocab": vocab_size,
        "params": human(params), "active": human(active),
    }


def human(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("configs", nargs="+", help="TOML job configs")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="vocabulary to size the embedding/head with (default: the config tokenizer's)")
    args = parser.parse_args()
    try:
        rows = [estimate(path, args.vocab_size) for path in args.configs]
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(FORMULA)
    header = list(rows[0])
    cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    for line in (header, *cells):
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
