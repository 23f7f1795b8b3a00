"""Micro-benchmarks, timed in one process so the ratios between variants are what count.

    python scripts/bench.py gdp

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


BENCHMARKS = {"gdp": bench_gdp}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=sorted(BENCHMARKS))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--naive-repeats", type=int, default=2)
    args = parser.parse_args()
    BENCHMARKS[args.which](args)


if __name__ == "__main__":
    main()
