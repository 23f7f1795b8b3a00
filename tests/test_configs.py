"""The shipped production configs: the recommended recipe (the paper's loop counts and override, each
slot drawing its own k, FiLM on the output block only), and a matched baseline for each."""

from pathlib import Path

import pytest
from trainer_utils import ROOT

from elr.config import load_config
from elr.config.recurrence import names as recurrence_names
from elr.train.loop_sampler import LoopSampler

CONFIGS = ROOT / "train_configs"
# The recurrence's options: they build the network, so every stage of one model keeps them (frozen on resume).
FROZEN = [f"elr.{name}" for name in recurrence_names()]
# (config, K, one-loop override, loop weights, switch): Table 3's "synchronized, 15% override" for GPT-0.5B
# (uniform, the paper's); Table 6's "10% one-loop rank override" for the 4B/30B hybrids with k = 1..4 drawn
# 0.1 / 0.2 / 0.3 / 0.4 (docs/recurrence.md, "The curve of the shipped recipe": uniform draws let the curve
# turn up after k = 2); no late switch (docs/recurrence.md, "The late switch and one-loop parity").
DEEP = [0.1, 0.2, 0.3, 0.4]
PRODUCTION = [
    ("gpt_0p5b.toml", 5, 0.15, [], 0.0),
    ("gdp_hybrid_4b.toml", 4, 0.1, DEEP, 0.0),
    ("koi4b.toml", 4, 0.1, DEEP, 0.0),
    ("gdp_hybrid_30b_a3b.toml", 4, 0.1, DEEP, 0.0),
    ("koi4b_sft.toml", 4, 0.1, DEEP, 0.0),
]
# A later stage starts from its own run's checkpoint: the baseline's stage from the baseline's run.
FROM_OWN_RUN = {"koi4b_sft.toml", "koi4b_rlvr.toml"}
# The RLVR stage draws its k per group (4:1:1:1, no override): not the pretraining recipe's sampling.
WITH_BASELINE = [name for name, *_ in PRODUCTION] + ["koi4b_rlvr.toml"]
# Runs for a CPU: the quick start, its SFT, and the RLVR demo's two stages.
CPU_RUNS = {"debug.toml", "sft_debug.toml", "sft_arith_debug.toml", "debug_rlvr.toml"}


def flat(path: Path) -> dict:
    return {
        f"{section}.{key}": value
        for section, keys in load_config(path).to_dict().items()
        for key, value in keys.items()
    }


def test_every_production_config_is_listed_here_with_a_baseline():
    shipped = {p.name for p in CONFIGS.glob("*.toml")} - CPU_RUNS - {"koi4b_midtrain.toml"}
    assert shipped == set(WITH_BASELINE) | {name.replace(".toml", "_baseline.toml") for name in WITH_BASELINE}


@pytest.mark.parametrize("name, max_loops, override, weights, switch_at", PRODUCTION)
def test_production_configs_run_the_recommended_recipe(name, max_loops, override, weights, switch_at):
    """The paper's K and override, no late switch; stratified draws (within the seed spread of independent, at
    1.05x wait instead of 1.27x at 8 GPUs), FiLM from the budget on loop 1 and the output block (docs/recurrence.md,
    "Which conditioning the configs ship"), the state norm between loops and, at K = 4, k drawn 0.1 / 0.2 / 0.3 /
    0.4 ("The curve of the shipped recipe": k = 1 below the matched baseline on the mean of 3 seeds on prose and
    code, k = 4 2.3% / 2.8% below its own k = 1)."""
    e = load_config(CONFIGS / name).elr
    assert (e.enabled, e.sampling, e.max_loops, e.one_loop_override, e.loop_weights, e.switch_at) == (
        True,
        "stratified",
        max_loops,
        override,
        weights,
        switch_at,
    )
    assert (e.conditioning, e.conditioning_first_loop, e.conditioning_later_loops, e.conditioning_exit) == (
        True,
        True,
        False,
        True,
    )
    assert e.state_norm  # README "The training aids on text": loops buy 2.1% instead of 1.3%, 3 seeds
    sampler = LoopSampler(e.max_loops, e.sampling, e.one_loop_override, e.loop_weights)
    # paper: Table 3 (K = 5, uniform); Table 6's override (K = 4) with k = 1 drawn 10% of the rest
    expected_p1 = {0.1: 0.1 + 0.9 * 0.1, 0.15: 0.32}[override]
    assert sampler.p_one_loop() == pytest.approx(expected_p1)
    ks = sampler.sample(step=7, n_ranks=8, n_micro=4)
    override_ranks = (ks == 1).all(dim=1)
    assert 1 <= override_ranks.sum() < 8 and len(set(ks.flatten().tolist())) > 2  # mixed depths, override ranks
    assert (ks[~override_ranks] == ks[~override_ranks][0]).all()  # no rank waits for another's loops


@pytest.mark.parametrize("name", WITH_BASELINE)
def test_baseline_differs_from_its_elr_config_only_in_elr_keys(name):
    elr, baseline = flat(CONFIGS / name), flat(CONFIGS / name.replace(".toml", "_baseline.toml"))
    differ = {key for key in elr if elr[key] != baseline[key]}
    if name in FROM_OWN_RUN:
        assert "_baseline/" in baseline["checkpoint.initial_load_path"]
        differ.discard("checkpoint.initial_load_path")
    assert differ - {"job.description", "job.dump_folder"} <= {k for k in elr if k.startswith("elr.")}
    assert "job.dump_folder" in differ  # a baseline never writes into the ELR run's folder
    assert (baseline["elr.enabled"], baseline["elr.max_loops"], baseline["elr.conditioning"]) == (False, 1, False)


def test_koi4b_midtrain_continues_koi4b_at_256k_with_its_mixed_depth_schedule():
    """Table 6, stage 2: 50B tokens at 256K context, the same schedule, from pretraining's last step."""
    pre, mid = flat(CONFIGS / "koi4b.toml"), flat(CONFIGS / "koi4b_midtrain.toml")
    elr_keys = {k for k in pre if k.startswith("elr.") and k != "elr.switch_at"}
    assert {k: mid[k] for k in elr_keys} == {k: pre[k] for k in elr_keys} and mid["elr.switch_at"] == 0.0
    assert mid["model.flavor"] == pre["model.flavor"] and mid["training.seq_len"] == 262144
    tokens = mid["training.steps"] * mid["training.global_batch_size"] * mid["training.seq_len"]
    assert abs(tokens - 50e9) < mid["training.global_batch_size"] * mid["training.seq_len"]
    final = Path(pre["job.dump_folder"]) / pre["checkpoint.folder"] / f"step-{pre['training.steps']}"
    assert Path(mid["checkpoint.initial_load_path"]) == final
    assert mid["parallelism.context_parallel_degree"] > 1 and mid["activation_checkpoint.mode"] == "full"


def test_koi4b_sft_continues_midtraining_with_its_mixed_depth_schedule_on_conversations():
    """Table 6, stage 3: SFT as the mixed-depth phase (loop counts drawn as in pretraining, conditioning
    on), from mid-training's last step, weights only (initial_load_path)."""
    mid, sft = flat(CONFIGS / "koi4b_midtrain.toml"), flat(CONFIGS / "koi4b_sft.toml")
    assert {k: sft[k] for k in sft if k.startswith("elr.")} == {k: mid[k] for k in mid if k.startswith("elr.")}
    assert sft["model.flavor"] == mid["model.flavor"] and sft["tokenizer.path"] == mid["tokenizer.path"]
    final = Path(mid["job.dump_folder"]) / mid["checkpoint.folder"] / f"step-{mid['training.steps']}"
    assert Path(sft["checkpoint.initial_load_path"]) == final


def test_sft_debug_fine_tunes_the_quick_start_model():
    """The tiny SFT run: the quick start's model and loop sampling, from its checkpoint, on data/chat."""
    debug, sft = flat(CONFIGS / "debug.toml"), flat(CONFIGS / "sft_debug.toml")
    same = [k for k in debug if k.startswith(("elr.", "model.", "tokenizer."))] + ["training.seq_len"]
    assert {k: sft[k] for k in same} == {k: debug[k] for k in same}
    assert Path(sft["checkpoint.initial_load_path"]) == Path(debug["job.dump_folder"]) / debug["checkpoint.folder"]
    assert sft["data.path"] == "data/chat"


def test_koi4b_rlvr_continues_sft_with_its_recurrence_and_the_papers_rlvr_loop_counts():
    """Table 6, stage 4: 200 steps, k drawn 4:1:1:1, from SFT's last step; the recurrence (frozen on a
    resume, and what the SFT model was built with) unchanged."""
    sft, rl = flat(CONFIGS / "koi4b_sft.toml"), flat(CONFIGS / "koi4b_rlvr.toml")
    assert {k: rl[k] for k in FROZEN} == {k: sft[k] for k in FROZEN}
    assert (rl["rl.enable"], rl["training.steps"], rl["elr.loop_weights"], rl["elr.one_loop_override"]) == (
        True,
        200,
        [4.0, 1.0, 1.0, 1.0],
        0.0,
    )
    final = Path(sft["job.dump_folder"]) / sft["checkpoint.folder"] / f"step-{sft['training.steps']}"
    assert Path(rl["checkpoint.initial_load_path"]) == final and rl["model.flavor"] == sft["model.flavor"]
    p1 = LoopSampler(4, "stratified", 0.0, rl["elr.loop_weights"]).p_one_loop()
    assert p1 == pytest.approx(4 / 7)  # the paper's p1 ~ 0.57


def test_the_rlvr_demo_starts_from_its_sft_run_with_the_same_model():
    sft, rl = flat(CONFIGS / "sft_arith_debug.toml"), flat(CONFIGS / "debug_rlvr.toml")
    assert {k: rl[k] for k in FROZEN} == {k: sft[k] for k in FROZEN} and rl["model.flavor"] == sft["model.flavor"]
    assert Path(rl["checkpoint.initial_load_path"]) == Path(sft["job.dump_folder"]) / sft["checkpoint.folder"]
    assert rl["tokenizer.path"] == sft["tokenizer.path"] and rl["rl.prompts"] == "arithmetic"
