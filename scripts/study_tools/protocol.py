"""A study group's protocol: what each run is paired with, and the baseline trained on the FLOPs of a mixed run.

A group named in the variants file's `[protocol.<group>]` table (e.g. `switch_wsd`) pairs every member seed by
seed with two references on the same schedule:
- the group's matched baseline (`baseline`);
- the member's own architecture trained at k = 1 only (the member's `k1_control`): the member's overrides with
  `elr.max_loops = 1` and without the keys only a mixed-depth phase uses (ONE_LOOP_DROPS), so the comparison
  separates what the loops and the switch cost k = 1 from what the architecture itself does at one loop.
A member with `flops_of = "<variant>"` is trained for as many updates (same batch, so the same tokens per update)
as it takes to spend that variant's training FLOPs: steps = round(suite steps x F(variant) / F(member)), with
F the expected training FLOPs per token over the run (model.num_flops_per_token at each update's expected loop
counts: one loop before a late switch, then the sampler's closed-form p(k) with its override and schedule).
"""

from __future__ import annotations

from pathlib import Path

# What a variant's spec says about its protocol, copied into its report entry.
PROTOCOL_KEYS = ("baseline", "k1_control", "flops_of", "flops_vs_baseline")

# The keys that only a mixed-depth phase uses: how loop counts are drawn, the late switch and what opens the
# later loops after it, the parameters and objectives that act from loop 2 on or after the switch only. A member's
# k = 1-only control drops them; every other key is the member's own.
ONE_LOOP_DROPS = frozenset(
    {
        "elr.sampling",
        "elr.one_loop_override",
        "elr.loop_weights",
        "elr.loop_weights_start",
        "elr.loop_schedule_steps",
        "elr.emulated_ranks",
        "elr.switch_at",
        "elr.switch_conditioning",
        "elr.stop_at_switch",
        "elr.identity_loops",
        "elr.loop_gate_lr_scale",
        "elr.loop_fade_steps",
        "elr.initial_state_noise",
        "elr.loop_gate",
        "elr.loop_gate_floor",
        "elr.loop_delta_rank",
        "elr.switch_warmup_steps",
        "elr.switch_heal_steps",
        "elr.switch_heal_lr_scale",
        "elr.k1_anchor",
        "elr.k1_anchor_steps",
        "elr.loop_consistency",
    }
)


def own_k1_overrides(overrides: dict) -> dict:
    """The overrides of a run's own architecture trained at k = 1 only (`max_loops 1`, same options)."""
    return {**{k: v for k, v in overrides.items() if k not in ONE_LOOP_DROPS}, "elr.max_loops": 1}


def check_protocols(variants: dict[str, dict], protocols: dict[str, dict]) -> None:
    """Every protocol names variants that exist; every member's k = 1-only control is its own architecture
    at one loop; a FLOPs-matched member names a variant to match; no variant is in two protocol groups (its
    baseline would be ambiguous). Raises ValueError naming the first fault."""
    for v, spec in variants.items():
        groups = [g for g in spec["groups"] if g in protocols]
        if len(groups) > 1:
            raise ValueError(f"[{v}] in protocol groups {groups}: a run is paired with one group's references")
    for group, protocol in protocols.items():
        members = [v for v, spec in variants.items() if group in spec["groups"]]
        baseline = protocol.get("baseline")
        if baseline not in variants or baseline not in members:
            raise ValueError(f"[protocol.{group}] baseline {baseline!r}: not a variant of group {group}")
        for v in members:
            spec = variants[v]
            control = spec.get("k1_control")
            if control is not None:
                if control not in variants:
                    raise ValueError(f"[{v}] k1_control {control!r}: no such variant")
                want = own_k1_overrides(spec["overrides"])
                if variants[control]["overrides"] != want:
                    raise ValueError(
                        f"[{v}] k1_control {control!r}: its overrides are not {v}'s at k = 1 only; want {want}"
                    )
            target = spec.get("flops_of")
            if target is not None and target not in variants:
                raise ValueError(f"[{v}] flops_of {target!r}: no such variant")


def expected_loop_counts(cfg) -> list[dict[int, float]]:
    """Per update 1..steps of a job, the expected share of its microbatches at each k (closed form)."""
    from elr.config import switch_step
    from elr.train.loop_sampler import LoopSampler

    e, steps = cfg.elr, cfg.training.steps
    if not e.enabled or e.max_loops == 1:
        return [{1: 1.0}] * steps
    switch = switch_step(cfg)
    sampler = LoopSampler(
        e.max_loops,
        e.sampling,
        e.one_loop_override,
        e.loop_weights,
        start_weights=e.loop_weights_start,
        schedule_steps=e.loop_schedule_steps,
        schedule_from=switch,
    )
    shares = []
    for step in range(1, steps + 1):
        if step - 1 < switch:  # the model after step - 1 updates is still in the one-loop phase
            shares.append({1: 1.0})
            continue
        probs = (1 - e.one_loop_override) * sampler.probs_at(step)
        share = {k: probs[k - 1].item() for k in range(1, e.max_loops + 1)}
        share[1] += e.one_loop_override
        shares.append(share)
    return shares


def load_run_config(config: Path, overrides: dict, steps: int):
    """The job config a study run trains: the suite's base config, the run's overrides, its updates."""
    from elr.config import load_config

    from .runs import cli_value

    args = [f"--{key}={cli_value(value)}" for key, value in overrides.items()]
    return load_config(config, [*args, f"--training.steps={steps}", "--job.dump_folder=unused"])


def flops_per_token(config: Path, overrides: dict, steps: int) -> float:
    """Expected training FLOPs per token over a run of `steps` updates (model.num_flops_per_token at each
    update's expected loop counts; the model built on the meta device), with what the switch's objectives add:
    every exit of a k >= 2 forward under `loop_consistency`, the teacher's forward at k = 1 while `k1_anchor`
    weighs."""
    import torch

    from elr.config import switch_step
    from elr.data.job_data import job_tokenizer_path
    from elr.models import build_model
    from elr.models.from_config import model_args_from_config
    from elr.text.tokenizer import vocab_size

    cfg = load_run_config(config, overrides, steps)
    with torch.device("meta"):
        model = build_model(model_args_from_config(cfg, vocab_size=vocab_size(job_tokenizer_path(cfg))))
    e, seq = cfg.elr, cfg.training.seq_len
    switch = switch_step(cfg) if e.switch_at else 0
    anchor_steps = e.k1_anchor_steps or max(steps - switch, 1)
    total = 0.0
    for step, share in enumerate(expected_loop_counts(cfg), start=1):
        mixed = step - 1 >= switch
        for k, p in share.items():
            # the consistency term reads every exit of a k >= 2 forward; the anchor adds its teacher's forward
            flops = model.num_flops_per_token(seq, k, every_loop=mixed and k >= 2 and e.loop_consistency > 0)
            if mixed and k == 1 and e.k1_anchor and step - switch - 1 < anchor_steps:
                flops += model.num_flops_per_token(seq, 1) / 3
            total += p * flops
    return total / steps


def plan(
    config: Path, variants: dict[str, dict], protocols: dict[str, dict], names: list[str], steps: int
) -> dict[str, dict]:
    """The specs of the variants `names` (of the suite's `variants`), each protocol member's with its group's
    `baseline`, its training FLOPs against that baseline's (`flops_vs_baseline`: per token times updates, tokens
    per update being equal) and, for a FLOPs-matched member, its updates (`steps`)."""
    planned = {v: dict(variants[v]) for v in names}
    for group, protocol in protocols.items():
        members = [v for v in names if group in variants[v]["groups"]]
        if not members:
            continue
        base_flops = flops_per_token(config, variants[protocol["baseline"]]["overrides"], steps) * steps
        for v in members:
            spec = planned[v]
            spec["baseline"] = protocol["baseline"]
            if "flops_of" in spec:
                target = flops_per_token(config, variants[spec["flops_of"]]["overrides"], steps) * steps
                spec["steps"] = round(target / flops_per_token(config, spec["overrides"], steps))
            run_steps = spec.get("steps", steps)
            spec["flops_vs_baseline"] = flops_per_token(config, spec["overrides"], run_steps) * run_steps / base_flops
    return planned
