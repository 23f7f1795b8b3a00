"""The KV-cache modes by name, and what each keeps once per loop: plain data, so that a command's --help and
argument checks name them without importing torch (elr/infer/cache.py implements them)."""

from __future__ import annotations

# mode -> the kinds of state (InferenceState.name) a recurrent layer keeps once per loop (None: all)
PER_LOOP_STATES = {"per_loop": None, "last_loop_kv": ("gdp_state",), "last_loop": ()}
MODES = tuple(PER_LOOP_STATES)


def keeps_per_loop(mode: str, state_name: str) -> bool:
    """Whether a recurrent layer whose kind keeps `state_name` has one entry per loop in `mode`."""
    kinds = PER_LOOP_STATES[mode]
    return kinds is None or state_name in kinds
