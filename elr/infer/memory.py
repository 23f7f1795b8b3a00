"""Memory of one request's inference state (attention KV caches, GDP states), by formula.

Each layer kind that keeps state between decoding calls registers the bytes of one entry
(`LayerKind.inference_state`, elr/models/layers.py): attention 2 x n_kv_heads x head_dim x context,
GDP heads x head_dim^2 plus the short convolutions' last kernel_size - 1 inputs, times the element
size. A layer outside the recurrent block has one entry; a recurrent layer has k entries where the
mode keeps its kind's state per loop and one otherwise (elr/infer/cache.py). Matches
`InferenceCache.nbytes`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from elr.infer.kv_modes import MODES, keeps_per_loop
from elr.models import ModelArgs
from elr.models.layers import LAYER_KINDS


def entry_counts(args: ModelArgs, loops: int, mode: str) -> dict[str, int]:
    """Cache entries per request, by layer kind (the kinds that keep state)."""
    if mode not in MODES:
        raise ValueError(f"unknown KV cache mode {mode!r}; use one of {', '.join(MODES)}")
    n_in, n_rec, _ = args.partition
    recurrent = args.layer_pattern[n_in : n_in + n_rec]
    return {
        letter: args.layer_pattern.count(letter)
        + (loops - 1 if keeps_per_loop(mode, kind.inference_state.name) else 0) * recurrent.count(letter)
        for letter, kind in LAYER_KINDS.items()
        if kind.inference_state is not None
    }


def inference_state_bytes(
    args: ModelArgs,
    loops: int,
    context_len: int,
    mode: str = "per_loop",
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 1,
) -> dict[str, int]:
    """Bytes of each kind's state ("attention_kv", "gdp_state") for `batch` requests of `context_len`
    tokens at k=loops."""
    size = torch.empty((), dtype=dtype).element_size()
    return {
        LAYER_KINDS[letter].inference_state.name: batch
        * count
        * LAYER_KINDS[letter].inference_state.bytes(args, context_len, size)
        for letter, count in entry_counts(args, loops, mode).items()
    }


def free_bytes(device: torch.device | str) -> int:
    """Memory a new allocation can take: the GPU's free memory, or the machine's MemAvailable on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(
    args: ModelArgs, loops: int, context_len: int, mode: str, dtype: torch.dtype, batch: int, device: torch.device | str
) -> None:
    """A ValueError, before anything is allocated, when `batch` requests of `context_len` tokens at k=loops
    need more inference state (and RoPE table) than the device has free: one line, not an allocator crash."""
    need = sum(inference_state_bytes(args, loops, context_len, mode, dtype, batch).values())
    need += context_len * args.rope_dim * 4  # the RoPE table grown to the context (float32 cos and sin)
    free = free_bytes(device)
    if need > free:
        raise ValueError(
            f"{batch} prompt(s) of up to {context_len} tokens at k={loops} ({mode}) need "
            f"{human_bytes(need)} of inference state, more than the {human_bytes(free)} free on "
            f"{torch.device(device)}: lower --max-new-tokens, the prompts or the loop count"
        )


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def memory_table(args: ModelArgs, max_loops: int, context_len: int, dtype: torch.dtype) -> str:
    """Markdown table: bytes per request at each k and mode, with the ratio to one loop."""
    one = inference_state_bytes(args, 1, context_len, "per_loop", dtype)["attention_kv"]
    lines = [
        f"inference state per request, {context_len} tokens, {str(dtype).removeprefix('torch.')}",
        "| k | mode | attention KV | x one loop | GDP state |",
        "|---|---|---|---|---|",
    ]
    for k in range(1, max_loops + 1):
        for mode in MODES:
            b = inference_state_bytes(args, k, context_len, mode, dtype)
            lines.append(
                f"| {k} | {mode} | {human_bytes(b['attention_kv'])} | "
                f"{b['attention_kv'] / one if one else 0:.2f} | {human_bytes(b['gdp_state'])} |"
            )
    return "\n".join(lines)
