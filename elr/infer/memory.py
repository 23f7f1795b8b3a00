"""Memory of one request's inference state: attention KV caches and GDP states, by formula.

Per attention slot: keys and values, 2 x n_kv_heads x head_dim x context x bytes. Per GDP slot: the
recurrent state, heads x head_dim^2 x bytes, plus the short convolutions' last kernel_size - 1
inputs. A layer outside the recurrent block has one slot; a recurrent layer has k slots in
`per_loop` mode and one in `last_loop` mode (elr/infer/cache.py). Matches `InferenceCache.nbytes`.
"""

from __future__ import annotations

import torch

from elr.infer.cache import MODES
from elr.models import ModelArgs


def slot_counts(args: ModelArgs, loops: int, mode: str) -> dict[str, int]:
    """Number of KV (kind A) and state (kind G) slots per request."""
    if mode not in MODES:
        raise ValueError(f"unknown KV cache mode {mode!r}; use one of {', '.join(MODES)}")
    n_in, n_rec, _ = args.partition
    recurrent = args.layer_pattern[n_in:n_in + n_rec]
    copies = loops if mode == "per_loop" else 1
    return {kind: args.layer_pattern.count(kind) + (copies - 1) * recurrent.count(kind) for kind in "AG"}


def inference_state_bytes(args: ModelArgs, loops: int, context_len: int, mode: str = "per_loop",
                          dtype: torch.dtype = torch.bfloat16, batch: int = 1) -> dict[str, int]:
    """Bytes of attention KV and GDP state for `batch` requests of `context_len` tokens at k=loops."""
    size = torch.empty((), dtype=dtype).element_size()
    slots = slot_counts(args, loops, mode)
    kv = 2 * args.n_kv_heads * args.head_dim * context_len * size
    H, D, n_h = args.gdp_heads, args.gdp_head_dim, args.gdp_householder
    state = H * D * D * size + (args.gdp_conv_size - 1) * (1 + 2 * n_h) * H * D * size
    return {"attention_kv": batch * slots["A"] * kv, "gdp_state": batch * slots["G"] * state}


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def memory_table(args: ModelArgs, max_loops: int, context_len: int, dtype: torch.dtype) -> str:
    """Markdown table: bytes per request at each k and mode, with the ratio to one loop."""
    one = inference_state_bytes(args, 1, context_len, "per_loop", dtype)["attention_kv"]
    lines = [f"inference state per request, {context_len} tokens, {str(dtype).removeprefix('torch.')}",
             "| k | mode | attention KV | x one loop | GDP state |", "|---|---|---|---|---|"]
    for k in range(1, max_loops + 1):
        for mode in MODES:
            b = inference_state_bytes(args, k, context_len, mode, dtype)
            lines.append(f"| {k} | {mode} | {human_bytes(b['attention_kv'])} | "
                         f"{b['attention_kv'] / one if one else 0:.2f} | {human_bytes(b['gdp_state'])} |")
    return "\n".join(lines)
