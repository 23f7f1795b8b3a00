"""Micro-benchmarks, timed in one process so the ratios between variants are what count.

    python scripts/bench.py gdp
    python scripts/bench.py model --flavor debug --seq-len 128 --batch 16

Each benchmark is one function registered in BENCHMARKS; it prints a small table.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def time_call(fn, repeats, warmup=1):
    """Median wall time of fn() in seconds, after warm-up calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


def bench_gdp(args):
    """Gated DeltaProduct forward+backward: token-loop oracle vs chunked PyTorch form."""
    from kernels.gated_delta_product import gated_delta_product

    B, T, H, K, V, n_h = 1, args.seq_len, 4, 64, 64, 2
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = torch.nn.functional.normalize(randn(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(randn(B, T * n_h, H, K), dim=-1)
    v = randn(B, T * n_h, H, V)
    g = torch.nn.functional.logsigmoid(randn(B, T, H))
    beta = 2 * torch.sigmoid(randn(B, T * n_h, H))
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]

    def step(impl):
        o, _ = gated_delta_product(*inputs, num_householder=n_h, impl=impl)
        o.sum().backward()
        for x in inputs:
            x.grad = None

    print(f"gated_delta_product fwd+bwd, B={B} T={T} H={H} K={K} V={V} n_h={n_h}, fp32, "
          f"{torch.get_num_threads()} threads")
    naive = time_call(lambda: step("naive"), repeats=args.naive_repeats)
    chunk = time_call(lambda: step("chunk"), repeats=args.repeats)
    print_table(["impl", "fwd+bwd ms", "speedup"],
                [["naive", f"{naive * 1e3:.1f}", "1.0x"],
                 ["chunk", f"{chunk * 1e3:.1f}", f"{naive / chunk:.1f}x"]])


def bench_model(args):
    """Training step (fwd+bwd) of a flavor: the non-recurrent baseline vs ELR at k = 1..K.

    At k=1 ELR runs every layer once, as the baseline does; its extra work is the adaptive step and
    the conditioning heads. Later loops add the recurrent block's cost each.
    """
    import dataclasses

    import torch.nn.functional as F

    from elr.models import build_model, flavors

    base = dataclasses.replace(flavors[args.flavor], max_seq_len=args.seq_len)
    torch.manual_seed(0)
    tokens = torch.randint(0, base.vocab_size, (args.batch, args.seq_len))

    def make(**kw):
        model = build_model(dataclasses.replace(base, **kw))
        model.init_weights()
        return model

    def step(model, loops):
        F.cross_entropy(model(tokens, loops=loops).flatten(0, 1), tokens.flatten()).backward()
        model.zero_grad(set_to_none=True)

    K = args.max_loops
    baseline, elr = make(), make(max_loops=K, update="adaptive_delta", conditioning=True)
    t_base = time_call(lambda: step(baseline, 1), repeats=args.repeats)
    rows = [["baseline", "1", f"{t_base * 1e3:.1f}", "1.00x", "-",
             f"{baseline.num_flops_per_token(args.seq_len, 1) / 1e6:.2f}"]]
    t_one = None
    for k in range(1, K + 1):
        t = time_call(lambda: step(elr, k), repeats=args.repeats)
        t_one = t_one or t
        rows.append(["ELR", str(k), f"{t * 1e3:.1f}", f"{t / t_base:.2f}x", f"{t / t_one:.2f}x",
                     f"{elr.num_flops_per_token(args.seq_len, k) / 1e6:.2f}"])
    print(f"{args.flavor}: fwd+bwd, batch {args.batch} x {args.seq_len} tokens, fp32, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print_table(["model", "k", "ms", "vs baseline", "vs k=1", "MFLOP/token"], rows)


BENCHMARKS = {"gdp": bench_gdp, "model": bench_model}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=sorted(BENCHMARKS))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--naive-repeats", type=int, default=2)
    parser.add_argument("--flavor", default="debug", help="model: the flavor to time")
    parser.add_argument("--batch", type=int, default=16, help="model: sequences per step")
    parser.add_argument("--max-loops", type=int, default=3, help="model: time ELR at k = 1..this")
    args = parser.parse_args()
    BENCHMARKS[args.which](args)


if __name__ == "__main__":
    main()
