"""Timing in one process: medians of interleaved rounds, so a burst of load from other processes hits
every variant alike, and the small tables the benchmarks print."""

import statistics
import time


def time_call(fn, repeats, warmup=1):
    """Median wall time of fn() in seconds, after warm-up calls."""
    return interleaved_medians([fn], repeats, warmup)[0]


def interleaved_medians(fns, repeats, warmup=1):
    """Median wall time of each fn, timed in rounds that call every fn once, after warm-up rounds."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]


def print_table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
